"""Per-chip memory of the train step at long sequences on a described TPU slice (compiled here, on CPU).

    python bench/long_context_memory.py [--sizes 82m] [--seqs 64k] [--impls splash] [--contexts 1]
                                        [--topology v5p:2x2x2] [--variant svformer]
                                        [--microbatches 0] [--remat auto]

Each (size, seq, attention_impl, context) is `configs/base.py:VARIANT,SIZE,SEQ` with one sequence
per chip, each split over `context` chips (mesh.context; the XLA path), auto-fitted (microbatches,
remat; `--microbatches` and `--remat` fix them, so that one compile answers) and compiled for the
slice as `vrl.main --compile_only --topology` would (minutes per candidate: the 82M 64K splash step
takes about 2 on 2 CPU cores). With context c, c microbatches put a c-th
of a sequence on each chip. The target: the paper's 64K sequences fit a v5p chip
(docs/execution.md). Needs libtpu (requirements-tpu.txt).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import base  # noqa: E402
from vrl.core.config import ConfigError  # noqa: E402
from vrl.train import aot  # noqa: E402
from vrl.train.config import from_configdict  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--variant', default='svformer')
    parser.add_argument('--sizes', default='82m')
    parser.add_argument('--seqs', default='64k')
    parser.add_argument('--impls', default='splash', help='splash, xla (a row that does not fit says so)')
    parser.add_argument('--contexts', default='1', help='chips each sequence is split over (mesh.context)')
    parser.add_argument(
        '--attention_chunks',
        type=int,
        default=None,
        help="the XLA path's query chunks (model.attention_chunks; default the config's)",
    )
    parser.add_argument('--topology', default='v5p:2x2x2')
    parser.add_argument('--microbatches', type=int, default=0, help='train.microbatches; 0 = auto-fitted')
    parser.add_argument('--remat', default='auto', help='model.remat: none, save_dots, full; auto = auto-fitted')
    args = parser.parse_args()
    import jax

    jax.config.update('jax_platforms', 'cpu')  # compile for the described slice only, as --compile_only does
    devices, hbm = aot.tpu_devices(args.topology)
    print(
        f'| size | tokens / sequence | attention | context | microbatches | remat | GiB / chip '
        f'| of {hbm / aot.GiB:.0f} | fits |'
    )
    print('|---|---|---|---|---|---|---|---|---|')
    for size in args.sizes.split(','):
        for seq in args.seqs.split(','):
            for impl, context in itertools.product(args.impls.split(','), map(int, args.contexts.split(','))):
                config = from_configdict(base.get_config(f'{args.variant},{size},{seq}'))
                config = dataclasses.replace(
                    config,
                    data=dataclasses.replace(config.data, batch_size=len(devices)),
                    train=dataclasses.replace(config.train, microbatches=args.microbatches),
                    model=dataclasses.replace(
                        config.model,
                        attention_impl=impl,
                        remat=args.remat,
                        attention_chunks=args.attention_chunks or config.model.attention_chunks,
                    ),
                    mesh=dataclasses.replace(config.mesh, context=context),
                )
                row = f'| {size} | {seq} | {impl} | {context} |'
                try:
                    fitted, report = aot.resolve(config, devices, hbm, say=lambda line: None)
                except (aot.CompileError, ConfigError) as e:
                    print(f'{row} - | - | - | - | no: {" ".join(str(e).split())[:120]} |', flush=True)
                    continue
                report = report or aot.compile_train_step(fitted, devices, hbm)
                print(
                    f'{row} {fitted.train.microbatches} | {fitted.model.remat} | '
                    f'{report.total_bytes / aot.GiB:.2f} | {hbm / aot.GiB:.0f} | {"yes" if report.fits else "no"} |',
                    flush=True,
                )


if __name__ == '__main__':
    main()
