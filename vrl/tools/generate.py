"""Generate from a trained workdir: `python -m vrl.tools.generate --workdir=DIR --prompt="ROMEO:"`.

Loads the run's config (WORKDIR/config.json), its tokenizer and the latest checkpoint's
parameters, decodes every prompt in one batch with the KV cache (vrl/model/decode.py), prints the
completions and a summary: prefill and decode tokens/s and the KV cache's bytes.
"""

from __future__ import annotations

import sys

from absl import flags

from vrl.core import cli, storage
from vrl.data import pipeline
from vrl.model import accounting, decode
from vrl.train.trained import TrainedRun, load_trained


def make_generator(run: TrainedRun, max_len: int) -> decode.Generator:
    """A Generator over the run's parameters, on its mesh."""
    return decode.Generator(
        run.config.model,
        run.trainer.graphdef,
        run.params,
        max_len=max_len,
        eos_id=run.tokenizer.eos_id,
        mesh=run.trainer.mesh,
    )


def _define_flags() -> dict:
    """The command's flags, defined only when it runs (the notebook and vrl.experiments.compare import this module)."""
    return {
        'workdir': flags.DEFINE_string('workdir', None, 'A training workdir (config.json + checkpoints/).'),
        'prompt': flags.DEFINE_multi_string('prompt', [], 'A prompt; repeat the flag for several.'),
        'prompts_file': flags.DEFINE_string('prompts_file', None, 'A file with one prompt per line.'),
        'max_new_tokens': flags.DEFINE_integer('max_new_tokens', 64, 'Tokens to generate per prompt.'),
        'temperature': flags.DEFINE_float('temperature', 0.0, '0 = greedy.'),
        'top_k': flags.DEFINE_integer('top_k', 0, 'Sample from the k most likely tokens; 0 = off.'),
        'top_p': flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass; 1 = off.'),
        'seed': flags.DEFINE_integer('seed', 0, 'Sampling seed.'),
        'max_len': flags.DEFINE_integer(
            'max_len',
            0,
            'The most positions (prompt + new tokens) a sequence may '
            'take; the cache holds what the prompts need, up to this; 0 = the trained seq_len.',
        ),
        'context': flags.DEFINE_integer(
            'context',
            1,
            "Devices each KV cache's positions are split over (a long "
            "prompt's cache larger than one device's memory); the mesh axis at -1 gives "
            'them up.',
        ),
    }


def main(args: cli.Args) -> None:
    cli.require(args, 'workdir')
    prompts = list(args['prompt'].value)
    if args['prompts_file'].value:
        prompts += storage.path(args['prompts_file'].value).read_text().splitlines()
    if not prompts or any(not p.strip() for p in prompts):
        raise decode.DecodeError('empty prompt: give --prompt="some text" (or a --prompts_file without blank lines).')
    sampling = decode.Sampling(
        temperature=args['temperature'].value,
        top_k=args['top_k'].value,
        top_p=args['top_p'].value,
        max_new_tokens=args['max_new_tokens'].value,
        seed=args['seed'].value,
    )
    if args['max_len'].value < 0:
        raise decode.DecodeError(f'max_len={args["max_len"].value} is invalid: allowed >= 1 (0 = the trained seq_len).')
    if args['context'].value < 1:
        raise decode.DecodeError(
            f"context={args['context'].value} is invalid: allowed >= 1 (devices a cache's positions are split over)."
        )
    run = load_trained(args['workdir'].value, args['context'].value)
    config, tokenizer = run.config, run.tokenizer
    sampling.check_vocab(config.model.vocab_size)
    encoded = [pipeline.prompt_tokens(config.data, tokenizer, p) for p in prompts]
    # the cache holds what the prompts and new tokens need, at most --max_len (or the trained length)
    max_len = min(args['max_len'].value or config.data.seq_len, max(map(len, encoded)) + sampling.max_new_tokens)
    max_len = -(-max_len // args['context'].value) * args['context'].value  # whole positions on each device
    if max_len > config.data.seq_len:
        cache = accounting.kv_cache_bytes(config.model, max_len) * len(encoded)
        print(
            f'warning: {max_len} positions (prompt + --max_new_tokens) are beyond the trained seq_len '
            f'{config.data.seq_len}: RoPE positions past it were never seen in training; the KV cache takes '
            f'{cache / 1e6:,.1f} MB.',
            file=sys.stderr,
        )
    generator = make_generator(run, max_len)
    result = generator.generate(encoded, sampling)
    for prompt, tokens in zip(prompts, result.tokens):
        print(f'--- {prompt}{tokenizer.decode(t for t in tokens if t != tokenizer.eos_id)}')
    prompt_tokens = sum(map(len, encoded))
    new_tokens = len(prompts) * result.decode_steps
    print(
        f'{config.model.variant_name}: prefill {prompt_tokens / result.prefill_seconds:,.0f} tokens/s, '
        f'decode {new_tokens / result.decode_seconds:,.0f} tokens/s ({len(prompts)} sequences x '
        f'{result.decode_steps} steps), KV cache {result.cache_bytes:,} bytes '
        f'({result.cache_bytes / len(prompts) / max_len:,.0f} per token per sequence)'
    )


def cli_main() -> None:
    """`vrl-generate` (pyproject.toml's scripts): `python -m vrl.tools.generate` by another name."""
    cli.run(main, _define_flags)


if __name__ == '__main__':
    cli_main()
