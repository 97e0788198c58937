"""What the training diagnostics cost (vrl/train/diagnostics.py): the seconds of one diagnostics pass
(train.diagnostics_sequences validation-length sequences, every layer's statistics) beside the
seconds of one train step of the same config, and their ratio at the default interval.

    python bench/diagnostics.py [--configs tiny,82m] [--seq_len 512] [--batch 4] [--steps 5]

Both are medians after a compile. A diagnostics pass costs about a forward over its sequences and
does not grow with the batch, so on this CPU, at a small batch, the ratio is an upper bound on the
share of a real run (the 82M config trains 2M tokens per step, ~250x the default batch here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.train_throughput import Stepper, bench_config  # noqa: E402
from vrl.train import diagnostics  # noqa: E402
from vrl.train.config import TrainConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--configs', default='tiny,82m')
    parser.add_argument('--variant', default='resformer')
    parser.add_argument('--seq_len', type=int, default=512)
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--steps', type=int, default=5)
    args = parser.parse_args()
    every, sequences = TrainConfig.diagnostics_every, TrainConfig.diagnostics_sequences
    dtype = 'float32' if jax.default_backend() == 'cpu' else 'bfloat16'
    print(
        f'{jax.device_count()} x {jax.devices()[0].device_kind}, {dtype}; diagnostics of {sequences} sequences '
        f'every {every} steps (the defaults)'
    )
    print(f'{"config":>6} | {"batch x seq":>11} | {"step s":>7} | {"diagnostics s":>13} | {"share at default":>16}')
    for name in args.configs.split(','):
        config = bench_config(name, args.variant, args.seq_len, args.batch, 'none', dtype)
        stepper = Stepper(config)
        trainer = stepper.group.trainer
        stats_fn = diagnostics.summed_stats(trainer)
        tokens = np.random.default_rng(1).integers(
            0, config.model.vocab_size, (sequences, config.data.seq_len), dtype=np.int32
        )

        def diagnose() -> float:
            start = time.perf_counter()
            diagnostics.averaged(stats_fn, trainer, stepper.state.params, tokens, config.data.batch_size)
            return time.perf_counter() - start

        diagnose()  # compile
        step_s = statistics.median(stepper.step() for _ in range(args.steps))
        diag_s = statistics.median(diagnose() for _ in range(args.steps))
        print(
            f'{name:>6} | {config.data.batch_size:>4} x {config.data.seq_len:<4} | {step_s:7.3f} | {diag_s:13.3f} | '
            f'{diag_s / (every * step_s + diag_s):16.3%}'
        )


if __name__ == '__main__':
    main()
