"""vrl/model/ops.py's hand-written backwards against autodiff, op by op, in the real train step compiled
ahead of time for a TPU slice (no TPU needed: libtpu describes it, requirements-tpu.txt).

    python bench/hand_vjp.py [--config svformer,468m] [--topology v5e:4x4] [--microbatches 8]
                             [--remat full] [--attention_impl auto] [--attention_chunks 4]
                             [--autodiff project,attention,swiglu,cross_entropy]

Rows: every op hand-written; each op alone by autodiff (the others hand-written); every op by
autodiff. The attention op only runs on the XLA path, so its row appears with
--attention_impl=xla (under auto, a TPU trains with splash). Columns, per chip: the step's total
memory and temporaries (XLA's memory analysis) and XLA's cost analysis of the compiled step:
flops (recomputation included) and bytes accessed. The cost analysis counts a loop's body once
(the layer scan, the microbatch loop), so its figures compare the rows, they are not the step's
totals. Each row is one compile (minutes at 468M).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from configs import base  # noqa: E402
from vrl.model.config import HAND_VJP_OPS  # noqa: E402
from vrl.train import aot  # noqa: E402
from vrl.train.config import from_configdict  # noqa: E402


def settings(attention_impl: str, autodiff: list[str]) -> list[str]:
    """model.hand_vjp values: all, each op of `autodiff` alone by autodiff, and none when that is every op."""
    ops = [op for op in autodiff if op != 'attention' or attention_impl == 'xla']
    every = set(autodiff) == set(HAND_VJP_OPS)
    return ['all', *(','.join(o for o in HAND_VJP_OPS if o != op) for op in ops), *(['none'] if every else [])]


def label(hand_vjp: str) -> str:
    if hand_vjp in ('all', 'none'):
        return {'all': 'all hand-written', 'none': 'all autodiff'}[hand_vjp]
    autodiff = [op for op in HAND_VJP_OPS if op not in hand_vjp.split(',')]
    return f'{autodiff[0]} by autodiff'


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--config', default='svformer,468m', help="configs/base.py's VARIANT,SIZE[,SEQ]")
    parser.add_argument('--topology', default='v5e:4x4')
    parser.add_argument('--microbatches', type=int, default=8)
    parser.add_argument('--remat', default='full')
    parser.add_argument('--attention_impl', default='auto')
    parser.add_argument('--attention_chunks', type=int, default=4)
    parser.add_argument(
        '--autodiff',
        default=','.join(HAND_VJP_OPS),
        help='the ops to try by autodiff, one row each (all of them: also a row with none hand-written)',
    )
    args = parser.parse_args()
    jax.config.update('jax_platforms', 'cpu')
    devices, hbm = aot.tpu_devices(args.topology)
    config = from_configdict(base.get_config(args.config))
    model = dataclasses.replace(
        config.model, remat=args.remat, attention_impl=args.attention_impl, attention_chunks=args.attention_chunks
    )
    config = dataclasses.replace(
        config, model=model, train=dataclasses.replace(config.train, microbatches=args.microbatches)
    )
    print(
        f'{args.config} on {args.topology}: microbatches={args.microbatches}, remat={args.remat}, '
        f'attention_impl={args.attention_impl}, attention_chunks={args.attention_chunks}; per chip'
    )
    print('| setting | total GiB | temporaries GiB | HLO TFLOP (loop bodies once) | HLO GB accessed (same) |')
    print('|---|---|---|---|---|')
    for hand_vjp in settings(args.attention_impl, args.autodiff.split(',')):
        setting = dataclasses.replace(config, model=dataclasses.replace(config.model, hand_vjp=hand_vjp))
        report = aot.compile_train_step(aot.execution(setting, devices[0].platform, lambda line: None), devices, hbm)
        print(
            f'| {label(hand_vjp)} | {report.total_bytes / aot.GiB:.2f} | {report.temp_bytes / aot.GiB:.2f} | '
            f'{report.hlo_flops / 1e12:.2f} | {report.hlo_bytes_accessed / 1e9:.1f} |',
            flush=True,
        )


if __name__ == '__main__':
    main()
