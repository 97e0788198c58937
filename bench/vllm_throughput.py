"""Generation throughput in vLLM (the vrl_vllm plugin) against vrl's own decoding, per variant and
batch size, for the 82M shape with random weights; and how many tokens vLLM's KV cache holds in a
fixed budget.

    python bench/vllm_throughput.py [--size 82m] [--variants vanilla,resformer,svformer] [--batches 1,8,32]
                                    [--prompt_tokens 128] [--new_tokens 128] [--kv_cache_mib 256]

`--requests N` instead measures what a smaller cache buys where the cache binds (vLLM's side only):
N requests at once, long prompts (`--prompt_tokens 2048`), a budget that holds a few dozen of them;
per variant the tokens the cache holds, the sequences it fits at once by vLLM's count, the most that
ran at once (read from the scheduler after each engine step), and the tokens/s of the whole workload.

    python bench/vllm_throughput.py --variants vanilla,svformer,cla2,svformer+cla2 --requests 64 \
        --prompt_tokens 2048 --new_tokens 128 --kv_cache_mib 1024

Needs vLLM's environment (bash serving/vllm/install .venv/vllm); this script runs in vrl's, exports
each variant, times vrl's `decode.Generator` on the same prompts, and runs itself again under
.venv/vllm/bin/python with `--vllm JOBS OUT` for vLLM's side. Both sides: float32 on CPU, greedy, no
token ends a sequence early; the time is one `generate` call for the whole batch (prefill and decode,
vrl's compile excluded: a first call warms it), and vLLM runs eagerly (no torch.compile).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def all_at_once(llm, prompts: list, params) -> dict:
    """Every prompt submitted at once, the engine stepped until all are done: seconds, tokens generated and
    the most requests the scheduler ran at once (its `running` list, in this process with
    VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    generated, most = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        generated += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        most = max(most, len(scheduler.running))
    return {'seconds': time.perf_counter() - start, 'tokens': generated, 'most_running': most}


def vllm_side(jobs_path: str, out_path: str) -> None:
    """Under vLLM's Python: each job's model, its prompts generated as one batch per batch size, or
    (`requests`) all at once."""
    from vllm.inputs import TokensPrompt

    from tests.vllm_greedy import engine, greedy

    results = []
    for job in json.loads(Path(jobs_path).read_text()):
        llm = engine(
            job['model'],
            job['max_model_len'],
            job['kv_cache_bytes'],
            job['dtype'],
            max_num_seqs=max(job['batches']),
            skip_tokenizer_init=True,
        )
        cache = llm.llm_engine.vllm_config.cache_config
        params = greedy(job['new_tokens'])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job['prompts']]
        llm.generate(prompts[:1], greedy(2), use_tqdm=False)  # the first call allocates and warms
        if job['requests']:
            per_sequence = -(-job['max_model_len'] // cache.block_size)  # blocks
            row = all_at_once(llm, prompts, params)
            fits = cache.num_gpu_blocks // per_sequence
            results.append({'variant': job['variant'], 'cache_tokens': cache.num_gpu_blocks * cache.block_size} | row)
            results[-1]['fits'] = fits
            del llm
            continue
        for batch in job['batches']:
            start = time.perf_counter()
            outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            generated = sum(len(o.outputs[0].token_ids) for o in outputs)
            results.append(
                {
                    'variant': job['variant'],
                    'batch': batch,
                    'seconds': seconds,
                    'tokens': generated,
                    'cache_tokens': cache.num_gpu_blocks * cache.block_size,
                }
            )
        del llm
    Path(out_path).write_text(json.dumps(results))


def vrl_side(cfg, model, prompts: list[list[int]], batches: list[int], new_tokens: int, max_len: int) -> dict:
    """{batch: seconds} of vrl's Generator on the first `batch` prompts (after a warming call)."""
    from flax import nnx

    from vrl.model import decode

    generator = decode.Generator(cfg, nnx.graphdef(model), nnx.state(model), max_len=max_len, eos_id=-1)
    sampling = decode.Sampling(max_new_tokens=new_tokens)
    seconds = {}
    for batch in batches:
        generator.generate(prompts[:batch], sampling)  # compiles this batch's programs
        start = time.perf_counter()
        generator.generate(prompts[:batch], sampling)
        seconds[batch] = time.perf_counter() - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--size', default='82m')
    parser.add_argument('--variants', default='vanilla,resformer,svformer')
    parser.add_argument('--batches', default='1,8,32')
    parser.add_argument('--prompt_tokens', type=int, default=128)
    parser.add_argument('--new_tokens', type=int, default=128)
    parser.add_argument('--kv_cache_mib', type=int, default=256)
    parser.add_argument('--requests', type=int, default=0, help='N requests at once, vLLM only (see above)')
    parser.add_argument('--dtype', default='float32', help="vLLM's dtype: bfloat16 on GPUs (FlashAttention)")
    parser.add_argument('--vllm', nargs=2, metavar=('JOBS', 'OUT'), help='(internal) the vLLM side')
    args = parser.parse_args()
    if args.vllm:
        return vllm_side(*args.vllm)
    sys.path.insert(0, str(ROOT))
    import dataclasses

    import numpy as np
    from flax import nnx

    from configs import base
    from tests.test_vllm import VLLM_PYTHON, vllm_env
    from vrl.data import tokenizer as tokenizers
    from vrl.interop import hf
    from vrl.model import presets
    from vrl.model.decoder import Decoder
    from vrl.train import aot
    from vrl.train.config import Config, from_configdict

    # vLLM's own environment (.venv/vllm, on a CPU), else this one (a GPU machine with vllm and the plugin)
    vllm_python = (
        VLLM_PYTHON if VLLM_PYTHON.exists() else Path(sys.executable) if importlib.util.find_spec('vllm') else None
    )
    if vllm_python is None:
        sys.exit(f'no vLLM environment at {VLLM_PYTHON.parent.parent}: make it with bash serving/vllm/install')
    batches = [args.requests] if args.requests else [int(b) for b in args.batches.split(',')]
    max_len = args.prompt_tokens + args.new_tokens
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix='vllm_bench_') as temp:  # the exports: ~330 MB each at 82M
        folder = Path(temp)
        # the prompts are token ids: the export's tokenizer files are only written (vLLM skips loading them)
        words = [' '.join(f'w{i * j % 997}' for j in range(40)) for i in range(200)]
        tokenizer = tokenizers.train(words, 273, str(folder / 'tokenizer.model'))
        jobs, vrl_seconds = [], {}
        for variant in args.variants.split(','):
            cfg = presets.apply(variant, from_configdict(base.get_config(f'vanilla,{args.size}')).model)
            cfg = aot.execution(Config(model=dataclasses.replace(cfg, compute_dtype='float32')), 'cpu').model
            model = Decoder(cfg, rngs=nnx.Rngs(0))
            prompts = rng.integers(3, cfg.vocab_size, (max(batches), args.prompt_tokens)).tolist()
            hf.export(
                nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                cfg,
                max_len,
                tokenizer,
                folder / variant.replace('+', '_'),
            )
            if not args.requests:
                vrl_seconds[variant] = vrl_side(cfg, model, prompts, batches, args.new_tokens, max_len)
            jobs.append(
                {
                    'variant': variant,
                    'model': str(folder / variant.replace('+', '_')),
                    'prompts': prompts,
                    'batches': batches,
                    'new_tokens': args.new_tokens,
                    'max_model_len': max_len,
                    'kv_cache_bytes': args.kv_cache_mib << 20,
                    'requests': args.requests,
                    'dtype': args.dtype,
                }
            )
        (folder / 'jobs.json').write_text(json.dumps(jobs))
        env = {**vllm_env(), 'PYTHONPATH': os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')]))}
        subprocess.run(
            [str(vllm_python), __file__, '--vllm', str(folder / 'jobs.json'), str(folder / 'out.json')],
            env=env,
            check=True,
        )
        results = json.loads((folder / 'out.json').read_text())
    if args.requests:
        return print_cache_bound(args, results)
    print(
        f'{args.size}, float32 on {os.cpu_count()} CPU cores; {args.prompt_tokens} prompt tokens, {args.new_tokens} '
        f'generated per request; vLLM eager, KV cache budget {args.kv_cache_mib} MiB'
    )
    width = max(map(len, args.variants.split(',')))
    print(
        f'{"variant":>{width}} | {"batch":>5} | {"vLLM req/s":>10} | {"vLLM tok/s":>10} | {"vrl tok/s":>9} | '
        f'{"vLLM cache tokens":>17}'
    )
    for row in results:
        ours = row['batch'] * args.new_tokens / vrl_seconds[row['variant']][row['batch']]
        print(
            f'{row["variant"]:>{width}} | {row["batch"]:>5} | {row["batch"] / row["seconds"]:>10.2f} | '
            f'{row["tokens"] / row["seconds"]:>10,.1f} | {ours:>9,.1f} | {row["cache_tokens"]:>17,}'
        )


def print_cache_bound(args, results: list[dict]) -> None:
    print(
        f'{args.size}, vLLM {args.dtype}, eager, {os.cpu_count()} CPU cores; {args.requests} requests at once, '
        f'{args.prompt_tokens} prompt tokens and {args.new_tokens} generated each; KV cache {args.kv_cache_mib} MiB'
    )
    width = max(map(len, args.variants.split(',')))
    print(f'{"variant":>{width}} | cache tokens | fits at once | most running | gen tok/s | seconds')
    for row in results:
        print(
            f'{row["variant"]:>{width}} | {row["cache_tokens"]:>12,} | {row["fits"]:>12} | {row["most_running"]:>12} | '
            f'{row["tokens"] / row["seconds"]:>9,.1f} | {row["seconds"]:>7.1f}'
        )


if __name__ == '__main__':
    main()
