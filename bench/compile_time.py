"""Jit compile time of forward + backward vs depth, with and without the layer scan.

    python bench/compile_time.py [--layers 4,12,24,48] [--d_model 256]

First the seconds to build a tiny Decoder eagerly (goal: <= 3 s on a 2-core CPU), then a table; with scan, compile
time should barely grow with depth (the goal: L=48
within 1.3x of L=4), while the unrolled loop grows about linearly.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from vrl.model.config import ModelConfig  # noqa: E402
from vrl.model.decoder import Decoder  # noqa: E402
from vrl.train import aot  # noqa: E402
from vrl.train.config import Config  # noqa: E402


def build_seconds(cfg: ModelConfig) -> float:
    """Building the model eagerly (random weights on the device): vrl/model/params.py keeps its compiles few."""
    start = time.perf_counter()
    jax.block_until_ready(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0))))
    return time.perf_counter() - start


def compile_seconds(cfg: ModelConfig, seq_len: int = 128, batch: int = 2) -> float:
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)

    def loss(state, tokens):
        logits = nnx.merge(graphdef, state)(tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    start = time.perf_counter()
    jax.jit(jax.value_and_grad(loss)).lower(state, tokens).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--layers', default='4,12,24,48')
    parser.add_argument('--d_model', type=int, default=256)
    parser.add_argument('--attention', default='resformer')
    args = parser.parse_args()
    base = ModelConfig(
        attention=args.attention,
        vocab_size=1024,
        d_model=args.d_model,
        n_heads=4,
        n_kv_heads=4,
        head_dim=args.d_model // 4,
        d_ff=4 * args.d_model,
        compute_dtype='float32',
    )
    base = aot.execution(Config(model=base), jax.default_backend()).model
    tiny = dataclasses.replace(base, n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64)
    first, other = build_seconds(tiny), build_seconds(dataclasses.replace(tiny, d_model=48, d_ff=96))
    print(
        f'eager build of a tiny {args.attention} Decoder: {first:.2f} s first in the process, {other:.2f} s for '
        'another shape (goal: <= 3 s)'
    )
    compile_seconds(dataclasses.replace(base, n_layers=2))  # warm up jax's own caches
    print(f'{args.attention}, d_model {args.d_model}, fwd+bwd jit compile seconds ({jax.default_backend()})')
    print(f'{"layers":>6} | {"scan":>7} | {"loop":>7}')
    first_scan = None
    for n in map(int, args.layers.split(',')):
        scan = compile_seconds(dataclasses.replace(base, n_layers=n, scan_layers=True))
        loop = compile_seconds(dataclasses.replace(base, n_layers=n, scan_layers=False))
        first_scan = first_scan or scan
        print(f'{n:>6} | {scan:>7.2f} | {loop:>7.2f}   scan vs first: {scan / first_scan:.2f}x')


if __name__ == '__main__':
    main()
