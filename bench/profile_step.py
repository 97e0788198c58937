"""Where a train step's time goes on this machine: the XLA ops of one profiled step, summed by kind.

    python bench/profile_step.py [--config 82m] [--variant vanilla] [--dtype float32] [--seq_len 512]
                                 [--batch 4] [--members 1] [--top 25]

Compiles the step (bench/train_throughput.py's setup), warms it up, then records two steps with
jax.profiler and reads the trace back (jax.profiler.ProfileData): the XLA:CPU thunks each step ran
(dots, fusions, copies, converts, ...), on every thread. Prints the op time by kind and the
`--top` ops by total time, each as ms per step and share of all op time. Op time summed over
threads can exceed the step's wall time where ops run in parallel. Each op is named with the line of
vrl's source it came from and the line that called it (the compiled program's stack frames; a fusion's
are its root's), and the time is summed by that line too, so a variant's cost shows where in its
module it is spent. `--members N` profiles the step
of N seeds trained together (issue #29); `--config reproduce_cpu` (or tiny) runs at that config's own
batch x seq_len unless --seq_len/--batch say otherwise.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from bench.train_throughput import NAMED, Stepper, bench_config  # noqa: E402
from vrl.core import backend, cli, host_memory  # noqa: E402

STEPS = 2


def op_times(stepper: Stepper) -> dict[str, float]:
    """Seconds per step of each XLA op name, summed over the threads that ran it."""
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for _ in range(STEPS):
                stepper.step()
        trace = next(Path(folder).rglob('*.xplane.pb'))
        data = jax.profiler.ProfileData.from_file(str(trace))
    totals = collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith('/host:CPU'):
            continue
        for line in plane.lines:
            for event in line.events:
                if 'hlo_op' in dict(event.stats) or line.name.startswith('XLA'):
                    totals[event.name] += event.duration_ns / 1e9 / STEPS
    return totals


def sources(stepper: Stepper) -> dict[str, str]:
    """Each op name of the compiled step -> where in vrl it came from, its innermost two frames in vrl's
    files ('attnres.py:128 < decoder.py:260'), read from the compiled program's stack-frame tables."""
    hlo = stepper.compiled().as_text()

    def table(title: str) -> dict[int, str]:  # a section of 'id value' lines after its title
        body = re.search(rf'^{title}\n(.*?)(?:\n\n|\n[A-Z]\w+\n)', hlo, re.S | re.M)
        return {int(i): v for i, v in (line.split(None, 1) for line in body.group(1).splitlines())} if body else {}

    files = {i: Path(name.strip('"')) for i, name in table('FileNames').items()}
    lines = {}
    for i, fields in table('FileLocations').items():
        field = dict(re.findall(r'(\w+)=(\d+)', fields))
        lines[i] = (files[int(field['file_name_id'])], field['line'])
    frames = {}
    for i, fields in table('StackFrames').items():
        field = dict(re.findall(r'(\w+)=(\d+)', fields))
        frames[i] = (int(field['file_location_id']), int(field['parent_frame_id']) - 1)  # parent: 0-based
    found = {}
    for op, frame in re.findall(r'^\s*(?:ROOT )?%([\w.\-]+) = .*?stack_frame_id=(\d+)', hlo, re.M):
        chain, frame = [], int(frame)
        while frame in frames and len(chain) < 2:
            (file, line), frame = lines[frames[frame][0]], frames[frame][1]
            if 'vrl' in file.parts and 'site-packages' not in file.parts:
                chain.append(f'{file.name}:{line}')
        found[op] = ' < '.join(chain) or '(outside vrl)'
    return found


def kind(op: str) -> str:
    """An op name's kind: its name without the numeric suffix XLA adds (`fusion.12` -> fusion)."""
    return re.sub(r'[._]\d+$', '', re.sub(r'(\.\d+)+$', '', op))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--config', default='82m')
    parser.add_argument('--variant', default='vanilla')
    parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
    parser.add_argument('--seq_len', type=int, help="default: tiny's and reproduce_cpu's own, else 512")
    parser.add_argument('--batch', type=int, help="default: tiny's and reproduce_cpu's own, else 4")
    parser.add_argument('--members', type=int, default=1, help='seeds trained together in one step')
    parser.add_argument('--top', type=int, default=25)
    args = parser.parse_args()
    cli.enable_compilation_cache()  # the program text for the source lines: a cache hit
    sized = args.config not in NAMED  # a configs/base.py size: its own batch is a pod's
    config = bench_config(
        args.config,
        args.variant,
        args.seq_len or (512 if sized else None),
        args.batch or (4 if sized else None),
        'none',
        args.dtype,
    )
    stepper = Stepper(config, args.members)
    wall = min(stepper.step() for _ in range(2))
    times = op_times(stepper)
    total = sum(times.values())
    print(
        f'{backend.describe_cpu_isa()}; {args.config} {args.variant} x {args.members} {args.dtype}, batch '
        f'{config.data.batch_size} x {config.data.seq_len}: step {wall * 1e3:,.0f} ms wall, '
        f'{total * 1e3:,.0f} ms of op time over threads'
    )
    where = sources(stepper)
    by_kind, by_source = collections.Counter(), collections.Counter()
    for op, seconds in times.items():
        by_kind[kind(op)] += seconds
        by_source[where.get(op, '(not in the program)').split(' <')[0]] += seconds
    named = collections.Counter({f'{op} {where.get(op, "")}': seconds for op, seconds in times.items()})
    tables = (('kind', by_kind, len(by_kind)), ('source line', by_source, args.top), ('op', named, args.top))
    for title, counter, n in tables:
        print(f'\n{title:>60} | {"ms/step":>8} | {"share":>6}')
        for name, seconds in counter.most_common(n):
            print(f'{name[:60]:>60} | {seconds * 1e3:>8,.1f} | {seconds / total:>6.1%}')


if __name__ == '__main__':
    host_memory.use_huge_pages()
    main()
