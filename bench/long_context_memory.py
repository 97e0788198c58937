"""Per-chip memory of the train step at long sequences on a described TPU slice (compiled here, on CPU).

    python bench/long_context_memory.py [--sizes 82m] [--seqs 64k] [--impls splash] [--topology v5p:2x2x2]
                                        [--variant svformer]

Each (size, seq, attention_impl) is `configs/base.py:VARIANT,SIZE,SEQ` with one sequence per chip,
auto-fitted (microbatches, remat) and compiled for the slice as `vrl.main --compile_only --topology`
would (minutes per row: the 82M 64K splash step takes about 2 on 2 CPU cores). The target: the
paper's 64K sequences fit a v5p chip with splash (docs/execution.md). Needs libtpu (requirements-tpu.txt).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import base  # noqa: E402
from vrl.core.config import from_configdict  # noqa: E402
from vrl.train import aot  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--variant', default='svformer')
    parser.add_argument('--sizes', default='82m')
    parser.add_argument('--seqs', default='64k')
    parser.add_argument('--impls', default='splash', help='splash, xla (a row that does not fit says so)')
    parser.add_argument('--topology', default='v5p:2x2x2')
    args = parser.parse_args()
    import jax
    jax.config.update('jax_platforms', 'cpu')  # compile for the described slice only, as --compile_only does
    devices, hbm = aot.tpu_devices(args.topology)
    print(f'| size | tokens / sequence | attention | microbatches | remat | GiB / chip | of {hbm / aot.GiB:.0f} | fits |')
    print('|---|---|---|---|---|---|---|---|')
    for size in args.sizes.split(','):
        for seq in args.seqs.split(','):
            for impl in args.impls.split(','):
                config = from_configdict(base.get_config(f'{args.variant},{size},{seq}'))
                config = dataclasses.replace(
                    config, data=dataclasses.replace(config.data, batch_size=len(devices)),
                    model=dataclasses.replace(config.model, attention_impl=impl))
                try:
                    fitted, report = aot.auto_fit(config, devices, hbm, say=lambda line: None)
                except aot.CompileError as e:
                    print(f'| {size} | {seq} | {impl} | - | - | - | - | no: {" ".join(str(e).split())[:120]} |')
                    continue
                report = report or aot.compile_train_step(fitted, devices, hbm)
                print(f'| {size} | {seq} | {impl} | {fitted.train.microbatches} | {fitted.model.remat} | '
                      f'{report.total_bytes / aot.GiB:.2f} | {hbm / aot.GiB:.0f} | {"yes" if report.fits else "no"} |',
                      flush=True)


if __name__ == '__main__':
    main()
