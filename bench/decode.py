"""KV-cache bytes and decode tokens/s per variant, at a given filled context, for the 82M config.

    python bench/decode.py [--size 82m] [--layers N] [--contexts 512,2048,8192] [--batches 1,8] [--new_tokens 16]
                           [--variants vanilla,resformer,svformer]   (vrl/model/presets.py names)
                           [--window 1024 --global_layers 4,8]       (local/global attention)
                           [--repeats 1]

The cache is filled with random keys and values up to the context (prefill is not timed:
each decode step reads the whole cache, which is what the context length changes). Compute
is float32 on CPU (caches too), the config's dtype on accelerators. At each context and batch every
variant's loop is compiled and run once untimed, then timed in `--repeats` rounds, a run of each variant
in turn: `decode tok/s` is the median round's, `vs <first variant>` the median of each round's ratio to
the first variant's (with the lowest and highest in brackets where there are several rounds). On a
shared 2-core host one run of 16 tokens moves by 10-25% between runs (2026-12-07: Block Attention
Residuals from 17% slower than vanilla to 14% faster at 512 x 1), so a comparison takes rounds.

`of bound`: the bytes one decode step must read (the parameters, and the filled part of the
cache) per second, as a fraction of this host's memory bandwidth, measured in the same run as
a jitted copy of a 1 GiB array (--probe_mib; 2 GiB moved: read + write), before and after the rows (the
better of the two: on a shared host it varies by half). `of reads` counts the cache as the
layers read it: each layer reads a key and a value slot, so a slot that several layers share
(SVFormer's V_1, CLA's groups) is read once per layer. Layers run one after the other, so no
decode step reads less; where the cache outgrows the CPU's caches, `of reads` is the column that
says how close a step is to memory speed, and the stored bytes (`of bound`) say what fits.

`formula MiB`: vrl.model.accounting.kv_cache_bytes for the batch at the allocated length (context +
new tokens), which the allocated `KV cache MiB` must equal: with --window, a slot that only one
local layer reads is a ring buffer of the window (docs/variants.md, "Local and global layers").
`history B/token`: what DenseFormer and MUDD hold per new token within a step beside the cache, the
outputs of every layer (vrl.model.accounting.layer_history_bytes_per_token); nothing of it stays.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from configs import base  # noqa: E402
from vrl.core import host_memory  # noqa: E402
from vrl.model import accounting, decode, presets  # noqa: E402
from vrl.model import cache as cache_lib  # noqa: E402
from vrl.model.decoder import Decoder  # noqa: E402
from vrl.train import aot  # noqa: E402
from vrl.train.config import Config, from_configdict  # noqa: E402


def memory_bandwidth(n_bytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes/s moved by the best of `repeats` jitted copies of an n_bytes float32 array (read + write)."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0000001)  # a real pass over the data, not an aliased no-op
    jax.block_until_ready(copy(x))
    best = float('inf')
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(copy(x))
        best = min(best, time.perf_counter() - start)
    return 2 * n_bytes / best


def bytes_per_step(cfg, params, batch: int, context: int) -> tuple[int, int]:
    """What one decode step must read: every parameter, and the filled cache of each sequence
    counted once (as stored) and as the layers read it (a key and a value slot per layer)."""
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    row = 2 * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize  # a key and a value
    read = sum(min(cfg.attention_window, context) if local else context for local in cfg.local_layers) * row
    return weights + batch * accounting.kv_cache_bytes(cfg, context), weights + batch * read


class DecodeLoop:
    """One variant's decode loop at a batch and a filled context, compiled and run once untimed; `seconds()`
    times one run of `new_tokens` steps from a fresh copy of the cache."""

    def __init__(self, cfg, batch: int, context: int, new_tokens: int):
        cfg = aot.execution(Config(model=cfg), jax.default_backend()).model  # this platform's ops
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        generator = decode.Generator(cfg, graphdef, nnx.to_pure_dict(state), max_len=context + new_tokens, eos_id=-1)
        cache = generator.new_cache(batch)
        keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(cache))))
        cache = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype) if x.ndim > 1 else x, cache)
        self.cache = cache._replace(index=jnp.asarray(context, jnp.int32))
        self.logits = jax.random.normal(jax.random.key(2), (batch, cfg.padded_vocab_size))
        self.pad = jnp.zeros((batch,), jnp.int32)
        self.params = generator.params
        self.loop = generator.decode_fn(decode.Sampling(max_new_tokens=new_tokens))  # donates the cache: copies
        self.tokens = batch * new_tokens
        self.cache_bytes = cache_lib.cache_bytes(self.cache)
        self.bound = bytes_per_step(cfg, generator.params, batch, context)
        self.seconds()  # untimed: compiles

    def seconds(self) -> float:
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, self.cache))
        start = time.perf_counter()
        jax.block_until_ready(self.loop(self.params, fresh, self.logits, self.pad, jax.random.key(0)))
        return time.perf_counter() - start


def measure(loops: dict[str, DecodeLoop], repeats: int) -> dict[str, tuple[float, list[float]]]:
    """Per variant: its median tokens/s over `repeats` rounds, each round one run of every variant in turn,
    and each round's ratio to the first variant's tokens/s less one (the first's own: zeros)."""
    rounds = [{variant: loop.seconds() for variant, loop in loops.items()} for _ in range(repeats)]
    first = next(iter(loops))
    return {
        variant: (
            loop.tokens / statistics.median(r[variant] for r in rounds),
            [r[first] / r[variant] - 1 for r in rounds],
        )
        for variant, loop in loops.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--size', default='82m')
    parser.add_argument('--contexts', default='512,2048,8192')
    parser.add_argument('--batches', default='1,8')
    parser.add_argument('--new_tokens', type=int, default=16)
    parser.add_argument('--repeats', type=int, default=1, help='rounds of a run of each variant; > 1 adds their range')
    parser.add_argument('--variants', default='vanilla,resformer,svformer')
    parser.add_argument('--probe_mib', type=int, default=1024, help='the bandwidth probe copy (a real one: 1 GiB)')
    parser.add_argument('--window', type=int, default=0, help='model.attention_window of every variant (0: off)')
    parser.add_argument('--global_layers', default='', help='model.global_layers with --window, e.g. 4,8')
    parser.add_argument('--layers', type=int, default=0, help="n_layers instead of the size's (0: the size's)")
    args = parser.parse_args()
    probe = args.probe_mib * 2**20
    bandwidth_before = memory_bandwidth(probe)
    rows = []
    variants = args.variants.split(',')
    for context in map(int, args.contexts.split(',')):
        for batch in map(int, args.batches.split(',')):
            loops = {}
            for variant in variants:
                cfg = presets.apply(variant, from_configdict(base.get_config(f'vanilla,{args.size}')).model)
                cfg = dataclasses.replace(
                    cfg,
                    compute_dtype='float32' if jax.default_backend() == 'cpu' else 'bfloat16',
                    n_layers=args.layers or cfg.n_layers,
                    attention_window=args.window,
                    global_layers=tuple(int(n) for n in args.global_layers.split(',') if n),
                )
                loops[variant] = DecodeLoop(cfg, batch, context, args.new_tokens)
                formula = batch * accounting.kv_cache_bytes(cfg, context + args.new_tokens)
                rows.append([variant, context, batch, formula, accounting.layer_history_bytes_per_token(cfg)])
            for row, (loop, (tokens_per_sec, ratios)) in zip(
                rows[-len(variants) :], zip(loops.values(), measure(loops, args.repeats).values())
            ):
                row += [loop.cache_bytes, tokens_per_sec, loop.bound, ratios]
    bandwidth_after = memory_bandwidth(probe)
    bandwidth = max(bandwidth_before, bandwidth_after)  # a shared host's best moment in this run
    windows = f'; window {args.window}, global layers {args.global_layers or "none"}' if args.window else ''
    print(
        f'{args.size}{windows}, {jax.devices()[0].device_kind}; {args.new_tokens} decode steps after the context; '
        f'memory bandwidth {bandwidth / 1e9:.1f} GB/s ({args.probe_mib} MiB copy; '
        f'{bandwidth_before / 1e9:.1f} before the rows, {bandwidth_after / 1e9:.1f} after)'
    )
    width, relative_width = max(map(len, variants)), 19 if args.repeats > 1 else 10
    print(
        f'{"variant":>{width}} | {"context":>7} | {"batch":>5} | {"KV cache MiB":>12} | {"formula MiB":>11} | '
        f'{"decode tok/s":>12} | {"vs " + variants[0]:>{relative_width}} | {"of bound":>8} | {"of reads":>8} | '
        f'{"history B/token":>15}'
    )
    for variant, context, batch, formula, history, n_bytes, tokens_per_sec, (stored, read), ratios in rows:
        steps_per_sec = tokens_per_sec / batch
        relative = f'{statistics.median(ratios):+.1%}'
        if variant == variants[0]:
            relative = '(reference)'
        elif args.repeats > 1:  # each round's ratio: how far one round's figure can be trusted
            relative += f' [{min(ratios):+.0%}, {max(ratios):+.0%}]'
        print(
            f'{variant:>{width}} | {context:>7} | {batch:>5} | {n_bytes / 2**20:>12,.1f} | {formula / 2**20:>11,.1f} | '
            f'{tokens_per_sec:>12,.1f} | {relative:>{relative_width}} | {stored * steps_per_sec / bandwidth:>8.1%} | '
            f'{read * steps_per_sec / bandwidth:>8.1%} | {history:>15,}'
        )


if __name__ == '__main__':
    host_memory.use_huge_pages()
    main()
