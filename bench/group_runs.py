"""Seeds trained together (one compiled step over a run axis) against the same seeds one after
another and against one run, at the CPU reproduction config: step time and total time.

    python bench/group_runs.py [--variant vanilla] [--seeds 4] [--steps 400] [--workdir runs/bench_group_runs]
                               [--time_only] [--rounds 20] [--layers N]

Step time: the single-run step and the group's step in alternating rounds in one process on one
batch (a shared host drifts over minutes), each round two steps of each with the second timed (the
first after the other's pays for memory the other freed), median of 20 rounds after one to warm up, with the model
FLOP/s each
reaches against the host's measured matmul peak; `floor at peak` is the least time (vs one run's
step) the group could take at that peak. Total time: `vrl.experiments.compare`'s
runner (grid.train_all) training the variant's seeds in fresh workdirs under --workdir: one seed;
all seeds with --group_runs=false; all seeds grouped. Goal (issue #29): the group in at most 2x one
run's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import reproduce_cpu  # noqa: E402
from vrl.core import cli, host_memory, sharding  # noqa: E402
from vrl.experiments import grid  # noqa: E402
from vrl.model import accounting, presets  # noqa: E402
from vrl.train import aot, metrics  # noqa: E402
from vrl.train.config import Config, from_configdict  # noqa: E402
from vrl.train.step import TrainSteps  # noqa: E402


def config_for(variant: str, steps: int, layers: int = 0) -> Config:
    """The CPU reproduction config for `variant` and `steps`, with `layers` layers (0: its own)."""
    config = from_configdict(reproduce_cpu.get_config())
    model = dataclasses.replace(config.model, n_layers=layers or config.model.n_layers)
    optimizer = dataclasses.replace(config.optimizer, decay_steps=steps)
    return dataclasses.replace(
        config,
        model=presets.apply(variant, model),
        optimizer=optimizer,
        train=dataclasses.replace(config.train, steps=steps, log_every=1, sample_tokens=0),
    )


def step_ms(config: Config, members: int, steps: int = 20) -> tuple[float, float]:
    """Median milliseconds per step of one run and of a group of `members`, in alternating rounds."""
    trainer = TrainSteps(
        aot.execution(config, jax.default_backend(), lambda line: None), sharding.make_mesh(config.mesh)
    )
    group = trainer.group(members)
    tokens = (
        np.random.default_rng(0)
        .integers(0, config.model.vocab_size, (config.data.batch_size, config.data.seq_len + 1))
        .astype(np.int32)
    )
    batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'loss_mask': np.ones_like(tokens[:, 1:])}
    steppers = (trainer, group)
    states = [trainer.init_state(0), group.init_state(list(range(members)))]
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(steps + 1):  # the first round compiles and warms up
        for k, stepper in enumerate(steppers):
            for timed in (False, True):  # the first step after the other's pays for the memory it freed
                start = time.perf_counter()
                states[k], metrics = stepper.train_step(states[k], stepper.device_batch(batch))
                jax.block_until_ready(metrics)
                if timed and i:
                    times[k].append(1000 * (time.perf_counter() - start))
    return float(np.median(times[0])), float(np.median(times[1]))


def total_seconds(config: Config, variant: str, seeds: list[int], workdir: Path, group_runs: bool) -> float:
    """Wall time of grid.train_all training `seeds` from scratch in `workdir` (compile included)."""
    shutil.rmtree(workdir, ignore_errors=True)
    runs = [
        grid.Run(variant, seed, dataclasses.replace(config, train=dataclasses.replace(config.train, seed=seed)))
        for seed in seeds
    ]
    start = time.perf_counter()
    grid.train_all(runs, workdir, 0, group_runs=group_runs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--variant', default='vanilla')
    parser.add_argument('--seeds', type=int, default=4, help='Members of the group.')
    parser.add_argument('--steps', type=int, default=400, help='Steps per run for the total times.')
    parser.add_argument('--workdir', default='runs/bench_group_runs')
    parser.add_argument('--time_only', action='store_true', help='Step times only.')
    parser.add_argument('--rounds', type=int, default=20, help='Timed rounds of the step times.')
    parser.add_argument('--layers', type=int, default=0, help="n_layers instead of the config's (0: the config's)")
    args = parser.parse_args()
    cli.enable_compilation_cache()
    config = config_for(args.variant, args.steps, args.layers)
    one_ms, group_ms = step_ms(config, args.seeds, args.rounds)
    gflop = (
        accounting.account(config.model, config.data.seq_len).flops_per_token
        * config.data.batch_size
        * config.data.seq_len
        / 1e9
    )  # one run's model FLOPs per step
    measured = metrics.peak_flops(0.0, config.model.compute_dtype)
    peak = measured.flops / 1e9
    print(
        f'{args.variant} at the reproduction config ({config.data.batch_size} x {config.data.seq_len} tokens '
        f'per step, {gflop:.1f} model GFLOP per run-step), {jax.device_count()} {jax.devices()[0].platform} '
        f'device(s), peak {measured}\n'
    )
    print('| what | runs | ms per step | per run | vs one run | GFLOP/s | of peak | floor at peak |')
    print('|---|---|---|---|---|---|---|---|')
    for name, runs, ms in (('one run', 1, one_ms), ('group', args.seeds, group_ms)):
        print(
            f'| {name} | {runs} | {ms:.0f} | {ms / runs:.0f} | {ms / one_ms:.2f}x | {runs * gflop / ms * 1000:.0f} | '
            f'{runs * gflop / ms * 1000 / peak:.0%} | {runs * gflop / peak * 1000 / one_ms:.2f}x |'
        )
    if args.time_only:
        return
    root = Path(args.workdir)
    seeds = list(range(args.seeds))
    totals = {
        'one run': (1, total_seconds(config, args.variant, [0], root / 'one', False)),
        'one after another': (args.seeds, total_seconds(config, args.variant, seeds, root / 'apart', False)),
        'group': (args.seeds, total_seconds(config, args.variant, seeds, root / 'group', True)),
    }
    one = totals['one run'][1]
    print(f'\n{args.steps} steps per run, from scratch (compile, evals and checkpoints included)\n')
    print('| what | runs | total s | vs one run |')
    print('|---|---|---|---|')
    for name, (runs, seconds) in totals.items():
        print(f'| {name} | {runs} | {seconds:.0f} | {seconds / one:.2f}x |')


if __name__ == '__main__':
    host_memory.use_huge_pages()
    main()
