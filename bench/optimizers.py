"""AdamW + cosine against Muon + wsd on the CPU reproduction config: loss at equal steps, steps to
reach AdamW's final eval loss, step time.

    python bench/optimizers.py [--variants vanilla,resformer,svformer] [--seeds 0] [--workdir runs/bench_optimizers]
                               [--time_only]

Trains each (optimizer recipe, variant, seed) as a vrl.main workdir under --workdir (finished runs are
reused, interrupted ones resumed). Step time is measured apart, both optimizers' steps alternating in
one process on one batch (a shared host drifts over minutes); `--time_only` measures only that.
Goal (issue #28): Muon + wsd reaches AdamW + cosine's 400-step eval loss in at most 300 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import reproduce_cpu  # noqa: E402
from vrl.core import sharding  # noqa: E402
from vrl.experiments import curves, grid  # noqa: E402
from vrl.model import presets  # noqa: E402
from vrl.train import aot  # noqa: E402
from vrl.train.config import Config, from_configdict  # noqa: E402
from vrl.train.step import TrainSteps  # noqa: E402

OPTIMIZERS = ('adamw', 'muon')


def config_for(name: str, variant: str, seed: int = 0) -> Config:
    config = from_configdict(reproduce_cpu.get_config(name))
    return dataclasses.replace(
        config, model=presets.apply(variant, config.model), train=dataclasses.replace(config.train, seed=seed)
    )


def step_ms(variant: str, steps: int = 20) -> dict[str, float]:
    """Median milliseconds per train step under each optimizer, their steps alternating on one batch."""
    configs = {name: config_for(name, variant) for name in OPTIMIZERS}
    configs = {
        name: aot.execution(config, jax.default_backend(), lambda line: None) for name, config in configs.items()
    }
    trainers = {name: TrainSteps(config, sharding.make_mesh(config.mesh)) for name, config in configs.items()}
    data = configs['adamw'].data
    tokens = np.random.default_rng(0).integers(0, 1024, (data.batch_size, data.seq_len + 1)).astype(np.int32)
    batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'loss_mask': np.ones_like(tokens[:, 1:])}
    states = {name: trainer.init_state(0) for name, trainer in trainers.items()}
    times: dict[str, list[float]] = {name: [] for name in OPTIMIZERS}
    for i in range(steps + 2):  # the first two compile and warm up
        for name, trainer in trainers.items():
            start = time.perf_counter()
            states[name], metrics = trainer.train_step(states[name], trainer.device_batch(batch))
            jax.block_until_ready(metrics)
            if i >= 2:
                times[name].append(1000 * (time.perf_counter() - start))
    return {name: float(np.median(t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--variants', default='vanilla,resformer,svformer')
    parser.add_argument('--seeds', default='0')
    parser.add_argument('--workdir', default='runs/bench_optimizers')
    parser.add_argument('--time_only', action='store_true', help='only the step-time table; train nothing')
    args = parser.parse_args()
    variants, seeds = args.variants.split(','), [int(s) for s in args.seeds.split(',')]
    print('| variant | ' + ' | '.join(f'{name} ms / step' for name in OPTIMIZERS) + ' | ratio |')
    print('|---|' + '---|' * (len(OPTIMIZERS) + 1))
    for variant in variants:
        ms = step_ms(variant)
        print(
            f'| {variant} | '
            + ' | '.join(f'{ms[name]:.0f}' for name in OPTIMIZERS)
            + f' | {ms["muon"] / ms["adamw"]:.2f} |',
            flush=True,
        )
    if args.time_only:
        return
    results = {
        (variant, name): [
            grid.train_or_reuse(
                grid.Run(variant, seed, config_for(name, variant, seed), (('optimizer', name),)), Path(args.workdir), 0
            )
            for seed in seeds
        ]
        for variant in variants
        for name in OPTIMIZERS
    }
    print(f'\n{len(seeds)} seed(s) each; eval loss: mean over seeds\n')
    print("| variant | optimizer | eval @100 | eval @200 | eval @300 | eval @400 | steps to AdamW's final |")
    print('|---|---|---|---|---|---|---|')
    for variant in variants:
        target = curves.mean_curve([r['eval_curve'] for r in results[(variant, 'adamw')]])
        for name in OPTIMIZERS:
            curve = curves.mean_curve([r['eval_curve'] for r in results[(variant, name)]])
            reach = curves.step_to_reach(curve, target[max(target)])
            cells = [f'{curve[s]:.3f}' if s in curve else '-' for s in (100, 200, 300, 400)]
            print(
                f'| {variant} | {name} | {" | ".join(cells)} | {"not reached" if reach is None else f"{reach:.0f}"} |'
            )


if __name__ == '__main__':
    main()
