"""Train-step throughput and MFU on this machine, per variant, for the tiny and the 82M configs.

    python bench/train_throughput.py [--configs tiny,82m] [--variants all|vanilla,svformer,...]
                                     [--seq_len 512] [--batch 4] [--steps 5] [--dtype bfloat16] [--context 1]
                                     [--json FILE] [--repeats 1]

Variants are vrl/model/presets.py's names (`--variants all`, the default, runs every preset). On a
shared host step times drift by several percent over minutes, so each variant's steps are taken
beside vanilla's in one process, a run of each in turn: `vs vanilla` is the ratio of the two medians
taken side by side, and vanilla's own row is the median over all its steps. Each run starts with an
untimed step: the first step after the other program ran is slow, a cost that training, which runs
one program, never pays (at 82M on CPU, Block Attention Residuals' first step 5.8-5.9 s against 4.8 s
for the next ones; stepping the two in strict alternation measured that cost beside the step: +20%
where the steady step is +10%, and 10 points apart between processes). `--repeats R` takes R rounds
of `--steps` each and gives the median round's ratio with the lowest and highest in brackets.

MFU counts model FLOPs only: 6 x (weight-matmul parameters, the output head included) per token
plus the causal attention matmuls (vrl.model.accounting.training_flops_per_token). The peak is this
host's matmul FLOP/s in the compute dtype (`--dtype`: float32 by default on CPU, bfloat16 on
accelerators): this CPU's reference rate of a jitted 1024^3 matmul, measured once with its cores idle
and kept (vrl.train.metrics.host_matmul_peak; the table's first line names it, with the CPU's ISA and
whose matmul kernels ran: XLA's, or oneDNN's on an AMX CPU); on an accelerator, the device's bf16 peak.
Step time is the median of the timed steps; `GiB` is the compiled step's memory per device as
XLA plans it (arguments, outputs and temporaries, less what they alias), read from the same
program through the compilation cache. `--context N` splits each sequence over N devices
(mesh.context; docs/scaling-out.md): run it with N and with 1 on the same devices to see what
context parallelism costs or saves. `--json FILE` also writes the rows there, one JSON object a line (a
docs table's cost columns read them: vrl/experiments/tables.py). Like `python -m vrl.main`, the script restarts itself
with glibc's huge-page malloc (vrl/core/host_memory.py); VRL_HUGE_PAGES=0 measures without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import base, reproduce_cpu, tiny  # noqa: E402
from vrl.core import backend, cli, host_memory, sharding  # noqa: E402
from vrl.model import accounting, presets  # noqa: E402
from vrl.train import aot, metrics  # noqa: E402
from vrl.train.config import Config, from_configdict  # noqa: E402
from vrl.train.step import TrainSteps  # noqa: E402

NAMED = {'tiny': tiny.get_config, 'reproduce_cpu': reproduce_cpu.get_config}


def bench_config(
    name: str, variant: str, seq_len: int | None, batch: int | None, remat: str, dtype: str, context: int = 1
) -> Config:
    """The `name` config ('tiny', 'reproduce_cpu' or a configs/base.py size) as `variant` (a
    vrl/model/presets.py name), at this batch x seq_len (None: the config's own), remat, compute dtype
    and mesh.context, its microbatches fitted to the devices."""
    config = from_configdict(NAMED[name]() if name in NAMED else base.get_config(f'vanilla,{name}'))
    model = presets.apply(variant, dataclasses.replace(config.model, compute_dtype=dtype, remat=remat))
    data = dataclasses.replace(
        config.data, seq_len=seq_len or config.data.seq_len, batch_size=batch or config.data.batch_size
    )
    mesh = dataclasses.replace(config.mesh, context=context)
    config = dataclasses.replace(config, model=model, data=data, mesh=mesh)
    return aot.resolve(config, jax.devices(), aot.local_hbm_bytes(), lambda line: None)[
        0
    ]  # the named configs' microbatches=0


class Stepper:
    """One config's sharded state, a fixed random batch and its jitted step, compiled and warmed up;
    with `members` > 1, a group of that many seeds trained in one step (vrl/train/step.py RunGroup)."""

    def __init__(self, config: Config, members: int = 1):
        self.config = config
        self.group = TrainSteps(config, sharding.make_mesh(config.mesh)).group(members)  # 1: the TrainSteps's own step
        self.state = self.group.init_state(list(range(members)))
        rng = np.random.default_rng(0)
        shape = (config.data.batch_size, config.data.seq_len)
        self.batch = self.group.device_batch(
            {
                'inputs': rng.integers(0, config.model.vocab_size, shape, dtype=np.int32),
                'targets': rng.integers(0, config.model.vocab_size, shape, dtype=np.int32),
                'loss_mask': np.ones(shape, np.int32),
            }
        )
        self.step()  # compile and warm up

    def compiled(self) -> jax.stages.Compiled:
        """The step as compiled (with the compilation cache on, a cache hit after the first step)."""
        return self.group.train_step.lower(self.state, self.batch).compile()

    def memory_gib(self) -> float | None:
        """The compiled step's memory per device (arguments, outputs and temporaries, less what
        aliases), as XLA plans it; None where the backend does not say."""
        try:
            stats = self.compiled().memory_analysis()
            used = (
                stats.argument_size_in_bytes
                + stats.output_size_in_bytes
                + stats.temp_size_in_bytes
                - stats.alias_size_in_bytes
            )
        except (AttributeError, NotImplementedError, TypeError):
            return None
        return used / 2**30

    def step(self) -> float:
        """Seconds for one train step."""
        start = time.perf_counter()
        self.state, out = self.group.train_step(self.state, self.batch)
        jax.block_until_ready(out)
        return time.perf_counter() - start


def measure_against(
    vanilla: Stepper, config: Config, steps: int, repeats: int = 1
) -> tuple[float, float, list[float], float | None]:
    """(median step seconds of `config`, median of vanilla's steps taken in between, each repeat's ratio of the
    two medians less one, its memory GiB): `repeats` rounds of `steps` steps of vanilla then `steps` of
    `config`, each after one untimed step."""
    variant = Stepper(config)
    times, vanilla_times, ratios = [], [], []
    for _ in range(repeats):
        vanilla.step()  # untimed: the first step after the other program's is slow (see above)
        theirs = [vanilla.step() for _ in range(steps)]
        variant.step()
        mine = [variant.step() for _ in range(steps)]
        ratios.append(statistics.median(mine) / statistics.median(theirs) - 1)
        times, vanilla_times = times + mine, vanilla_times + theirs
    return statistics.median(times), statistics.median(vanilla_times), ratios, variant.memory_gib()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--configs', default='tiny,82m')
    parser.add_argument('--variants', default='all', help='vrl/model/presets.py names, comma-separated, or all')
    parser.add_argument('--seq_len', type=int, default=512)
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--remat', default='none')
    parser.add_argument('--context', type=int, default=1, help='devices each sequence is split over (mesh.context)')
    parser.add_argument(
        '--dtype',
        choices=('float32', 'bfloat16'),
        help='compute dtype (default: float32 on CPU, bfloat16 on accelerators)',
    )
    parser.add_argument('--json', default='', help='also write the rows to this file, a JSON object a line')
    parser.add_argument(
        '--repeats', type=int, default=1, help="rounds of --steps steps per variant; > 1 adds each round's range"
    )
    args = parser.parse_args()
    cli.enable_compilation_cache()  # the memory column's second compile is a cache hit
    args.dtype = args.dtype or ('float32' if jax.default_backend() == 'cpu' else 'bfloat16')
    measured = metrics.peak_flops(compute_dtype=args.dtype)
    peak = measured.flops
    huge_pages = 'glibc.malloc.hugetlb' in os.environ.get('GLIBC_TUNABLES', '')
    isa = f' ({backend.describe_cpu_isa()})' if jax.default_backend() == 'cpu' else ''
    args.machine = f'{jax.device_count()} x {jax.devices()[0].device_kind}{isa}, {os.cpu_count()} cores'
    args.rows = []
    malloc = f'huge-page malloc {"on" if huge_pages else "off"} (vrl/core/host_memory.py)'
    print(f'{args.machine}, {args.dtype}; peak {measured}; {malloc}')
    variants = list(presets.PRESETS) if args.variants == 'all' else args.variants.split(',')
    args.width, args.relative_width = max(map(len, variants)), 23 if args.repeats > 1 else 11
    print(
        f'{"config":>6} | {"variant":>{args.width}} | {"batch x seq":>11} | {"params":>8} | {"step s":>7} | '
        f'{"vs vanilla":>{args.relative_width}} | {"tokens/s":>9} | {"GFLOP/s":>8} | {"MFU":>6} | {"GiB":>6}'
    )
    for name in args.configs.split(','):
        sizes = (args.seq_len, args.batch, args.remat, args.dtype, args.context)
        vanilla = Stepper(bench_config(name, 'vanilla', *sizes))
        vanilla_all = []
        for variant in variants:
            if variant == 'vanilla':
                continue
            config = bench_config(name, variant, *sizes)
            seconds, vanilla_seconds, ratios, memory = measure_against(vanilla, config, args.steps, args.repeats)
            vanilla_all.append(vanilla_seconds)
            relative = f'{statistics.median(ratios):+.1%}'  # one round: the two medians' ratio
            if args.repeats > 1:  # each round's ratio: how far one round's figure can be trusted
                relative += f' [{min(ratios):+.0%}, {max(ratios):+.0%}]'
            _print_row(name, variant, config, seconds, relative, args, peak, memory)
        if 'vanilla' in variants:
            seconds = statistics.median(vanilla_all or [vanilla.step() for _ in range(args.steps)])
            _print_row(name, 'vanilla', vanilla.config, seconds, '(reference)', args, peak, vanilla.memory_gib())
    if args.json:
        Path(args.json).write_text(''.join(json.dumps(row) + '\n' for row in args.rows))


def _print_row(
    name: str, variant: str, config: Config, seconds: float, relative: str, args, peak: float, memory: float | None
) -> None:
    tokens_per_sec = config.data.batch_size * config.data.seq_len / seconds
    flops = accounting.training_flops_per_token(config.model, config.data.seq_len) * tokens_per_sec
    params = accounting.account(config.model, config.data.seq_len).params
    print(
        f'{name:>6} | {variant:>{args.width}} | {args.batch:>4} x {args.seq_len:<4} | {params / 1e6:>7.2f}M | '
        f'{seconds:>7.3f} | {relative:>{args.relative_width}} | {tokens_per_sec:>9,.0f} | {flops / 1e9:>8,.1f} | '
        f'{flops / peak:>6.1%} | {"-" if memory is None else f"{memory:.2f}":>6}',
        flush=True,
    )
    args.rows.append(
        {'config': name, 'variant': variant, 'batch': args.batch, 'seq_len': args.seq_len, 'dtype': args.dtype}
        | {'step_seconds': round(seconds, 4), 'vs_vanilla': relative, 'gib': memory and round(memory, 3)}
        | {'machine': args.machine, 'date': time.strftime('%Y-%m-%d')}
    )


if __name__ == '__main__':
    host_memory.use_huge_pages()
    main()
