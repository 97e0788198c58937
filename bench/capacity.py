"""How many sequences' KV caches fit in a given memory, per variant (arithmetic, no device needed).

    python bench/capacity.py [--size 82m|180m|468m] [--memory_gib 16] [--contexts 2048,8192,32768]
                             [--dtype bfloat16] [--variants vanilla,svformer,...]   (vrl/model/presets.py names)

SVFormer keeps one value slot for all layers, so its batch is about 2L / (L + 1) of vanilla's;
the column `expected` shows that bound for SVFormer rows (and the kv-head ratio for GQA/MQA).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import base  # noqa: E402
from vrl.model import accounting, presets  # noqa: E402
from vrl.train.config import from_configdict  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--size', default='82m')
    parser.add_argument('--memory_gib', type=float, default=16.0)
    parser.add_argument('--contexts', default='2048,8192,32768')
    parser.add_argument('--dtype', default='bfloat16')
    parser.add_argument('--variants', default=','.join(presets.PRESETS))
    args = parser.parse_args()
    base_model = from_configdict(base.get_config(f'vanilla,{args.size}')).model
    base_model = dataclasses.replace(base_model, compute_dtype=args.dtype)
    L = base_model.n_layers
    print(f'{args.size} ({L} layers), {args.dtype} cache, {args.memory_gib:g} GiB: the largest batch per context')
    variants = args.variants.split(',')
    width = max(map(len, variants))
    contexts = [int(c) for c in args.contexts.split(',')]
    print(
        f'{"variant":>{width}} | {"cache B/token":>13} | '
        + ' | '.join(f'{f"batch @{c}":>11}' for c in contexts)
        + f' | {"vs vanilla":>10} | {"expected":>8}'
    )
    vanilla = presets.apply('vanilla', base_model)
    for variant in variants:
        cfg = presets.apply(variant, base_model)
        batches = [accounting.max_batch_for_cache(cfg, c, args.memory_gib * 2**30) for c in contexts]
        ratio = accounting.kv_cache_bytes_per_token(vanilla) / accounting.kv_cache_bytes_per_token(cfg)
        kv_heads = vanilla.n_kv_heads / cfg.n_kv_heads
        expected = kv_heads * (2 * L / (L + 1) if cfg.attention == 'svformer' else 1.0) * cfg.kv_share
        print(
            f'{variant:>{width}} | {accounting.kv_cache_bytes_per_token(cfg):>13,} | '
            + ' | '.join(f'{b:>11,}' for b in batches)
            + f' | {ratio:>9.3f}x | {expected:>7.3f}x'
        )


if __name__ == '__main__':
    main()
