"""Greedy generations from vLLM, run by tests/test_vllm.py with vLLM's own environment's Python
(.venv/vllm: vLLM, its torch and transformers, the vrl_vllm plugin; no JAX, no vrl); `engine` and
`greedy` are bench/vllm_throughput.py's too.

    python tests/vllm_greedy.py JOBS.json OUT.json

JOBS.json: [{"name": NAME, "model": DIR, "prompts": [[token ids], ...], "max_tokens": N, "max_model_len": M,
"model_impl": "vllm" (vLLM's own models: the plugin's) or "transformers" (vLLM's Transformers backend),
"settings": {any other LLM argument} (optional), "one_at_a_time": true (optional: each prompt generated
alone, in turn, before the batch)}, ...].
OUT.json: {NAME: {"tokens": [[N generated ids] per prompt] (the batch), "alone": the same, one at a time,
"cached": [prompt tokens read from the prefix cache, per prompt, one at a time], "cache_tokens": the
tokens vLLM's KV cache holds}}. Every model in one process (the engine in it too), end of sequence
ignored so that every row is N long.
"""

from __future__ import annotations

import gc
import json
import sys


def engine(model: str, max_model_len: int, kv_cache_bytes: int = 1 << 26, dtype: str = 'float32', **settings):
    """vLLM's offline engine on an export as the tests and bench/vllm_throughput.py run it: float32 (on
    GPUs bfloat16: FlashAttention's), eager (no torch.compile), the export's code trusted, seed 0;
    `settings`: any other LLM argument.
    What is alive before it (torch, transformers, vLLM's modules) is frozen out of the garbage
    collector's passes, which vLLM's start runs several times (0.5 s each over the whole heap)."""
    from vllm import LLM

    gc.freeze()
    return LLM(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        trust_remote_code=True,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_bytes,
        seed=0,
        **settings,
    )


def greedy(max_tokens: int):
    """Greedy sampling of exactly max_tokens: end of sequence ignored."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def main(jobs_path: str, out_path: str) -> None:
    from vllm.inputs import TokensPrompt

    results = {}
    for job in json.loads(open(jobs_path).read()):
        llm = engine(job['model'], job['max_model_len'], model_impl=job['model_impl'], **job.get('settings', {}))
        prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in job['prompts']]
        cache = llm.llm_engine.vllm_config.cache_config
        result = results[job['name']] = {'cache_tokens': cache.num_gpu_blocks * cache.block_size}
        if job.get('one_at_a_time'):
            alone = [llm.generate([prompt], greedy(job['max_tokens']), use_tqdm=False)[0] for prompt in prompts]
            result['alone'] = [list(o.outputs[0].token_ids) for o in alone]
            result['cached'] = [o.num_cached_tokens for o in alone]
        outputs = llm.generate(prompts, greedy(job['max_tokens']), use_tqdm=False)
        result['tokens'] = [list(o.outputs[0].token_ids) for o in outputs]
        del llm
    with open(out_path, 'w') as f:
        json.dump(results, f)


if __name__ == '__main__':  # vLLM starts processes by spawning: the work stays under this guard
    main(*sys.argv[1:])
