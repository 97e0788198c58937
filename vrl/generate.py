"""Generate from a trained workdir: `python -m vrl.generate --workdir=DIR --prompt="ROMEO:"`.

Loads the run's config (WORKDIR/config.json), its tokenizer and the latest checkpoint's
parameters, decodes every prompt in one batch with the KV cache (vrl/decode.py), prints the
completions and a summary: prefill and decode tokens/s and the KV cache's bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags, logging

from vrl import checkpoint, data, decode, sharding
from vrl.config import Config
from vrl.step import Trainer
from vrl.tokenizer import Tokenizer
from vrl.train import load_run

_WORKDIR = flags.DEFINE_string('workdir', None, 'A training workdir (config.json + checkpoints/).')
_PROMPT = flags.DEFINE_multi_string('prompt', [], 'A prompt; repeat the flag for several.')
_PROMPTS_FILE = flags.DEFINE_string('prompts_file', None, 'A file with one prompt per line.')
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 64, 'Tokens to generate per prompt.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.0, '0 = greedy.')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample from the k most likely tokens; 0 = off.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass; 1 = off.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
_MAX_LEN = flags.DEFINE_integer('max_len', 0, 'Cache length (prompt + new tokens); 0 = the trained seq_len.')


def make_generator(config: Config, workdir: str, tokenizer: Tokenizer, max_len: int) -> decode.Generator:
    """The latest checkpoint's parameters, sharded by the training rules, behind a Generator."""
    trainer = Trainer(config, sharding.make_mesh(config.mesh))
    params = checkpoint.restore_params(workdir, trainer.abstract_state.params)
    return decode.Generator(config.model, trainer.graphdef, params, max_len=max_len, eos_id=tokenizer.eos_id,
                            mesh=trainer.mesh)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    if not _WORKDIR.value:
        raise app.UsageError('--workdir is required')
    logging.set_verbosity(logging.WARNING)
    prompts = list(_PROMPT.value)
    if _PROMPTS_FILE.value:
        prompts += Path(_PROMPTS_FILE.value).read_text().splitlines()
    try:
        if not prompts or any(not p.strip() for p in prompts):
            raise decode.DecodeError('empty prompt: give --prompt="some text" (or a --prompts_file without '
                                     'blank lines).')
        config, tokenizer = load_run(_WORKDIR.value)
        max_len = _MAX_LEN.value or config.data.seq_len
        generator = make_generator(config, _WORKDIR.value, tokenizer, max_len)
        sampling = decode.Sampling(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
                                   max_new_tokens=_MAX_NEW_TOKENS.value, seed=_SEED.value)
        encoded = [data.prompt_tokens(config.data, tokenizer, p) for p in prompts]
        result = generator.generate(encoded, sampling)
    except (decode.DecodeError, FileNotFoundError, checkpoint.CheckpointMismatchError) as e:
        sys.exit(f'error: {e}')
    for prompt, tokens in zip(prompts, result.tokens):
        print(f'--- {prompt}{tokenizer.decode(t for t in tokens if t != tokenizer.eos_id)}')
    prompt_tokens = sum(map(len, encoded))
    new_tokens = len(prompts) * result.decode_steps
    print(f'{config.model.attention}: prefill {prompt_tokens / result.prefill_seconds:,.0f} tokens/s, '
          f'decode {new_tokens / result.decode_seconds:,.0f} tokens/s ({len(prompts)} sequences x '
          f'{result.decode_steps} steps), KV cache {result.cache_bytes:,} bytes '
          f'({result.cache_bytes / len(prompts) / max_len:,.0f} per token per sequence)')


if __name__ == '__main__':
    app.run(main)
