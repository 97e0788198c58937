"""Uptraining a trained vanilla model into SVFormer, ResFormer and SkipV1Former, at CPU scale (docs/scaling.md,
"Uptraining"): vanilla trained `steps` (configs/reproduce_cpu.py: 400); then `extra` more steps (60: 15%)
as vanilla (continued) and as each target, `--init_from` the vanilla run with the uptraining schedule (a
short warmup to `lr`, cosine to a tenth of it); against each variant trained from scratch for steps + extra.
SkipV1Former (half of its 4 value heads from V_1) twice: by the paper's recipe (layers >= 2's W_V mean-pooled
in pairs) and with the first two heads kept and the others dropped (train.init_value_heads=first). The
uptraining peak LR is bracketed on the first seed (`--lrs`), each target at its best; every row over
`--seeds`. Runs that finished are reused.

    python bench/uptraining.py [--workdir runs/uptraining] [--seeds 0,1,2] [--extra 60] [--lrs 3e-4,1e-3,3e-3]
                               [--targets svformer,resformer,skipv1,skipv1-first]

Prints a table: final eval loss per row (mean and sample s.d. over seeds), and each uptrained row's
difference from vanilla continued and from its own architecture from scratch, paired by seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CONFIG = 'configs/reproduce_cpu.py'
TARGETS = {  # the uptrained model: its config flags, and the variant trained from scratch beside it
    'vanilla': ([], None),
    'svformer': (['--config.model.attention=svformer'], 'svformer'),
    'resformer': (['--config.model.attention=resformer'], 'resformer'),
    'skipv1': (['--config.model.skip_v1=2'], 'skipv1'),
    'skipv1-first': (['--config.model.skip_v1=2', '--config.train.init_value_heads=first'], 'skipv1'),
}


def final_eval_loss(workdir: Path) -> float | None:
    """The last eval_loss in a run's metrics.jsonl (None: the run has not evaluated)."""
    metrics = workdir / 'metrics.jsonl'
    if not metrics.exists():
        return None
    losses = [r['eval_loss'] for r in map(json.loads, metrics.read_text().splitlines()) if 'eval_loss' in r]
    return losses[-1] if losses else None


def run(command: list[str]) -> None:
    print('+', ' '.join(command), flush=True)
    subprocess.run([sys.executable, '-m', *command], check=True)


def uptrain(base: Path, target: str, seed: int, extra: int, lr: float, out: Path) -> float:
    """The vanilla run `base` trained `extra` more steps as `target`; its final eval loss."""
    if final_eval_loss(out) is None or not (out / 'checkpoints' / str(extra)).exists():
        run(
            ['vrl.main', f'--config={CONFIG}', f'--workdir={out}', f'--init_from={base}', *TARGETS[target][0]]
            + [f'--config.train.steps={extra}', f'--config.train.seed={seed}', '--config.data.seed=1']
            + [f'--config.train.eval_every={extra}', f'--config.train.checkpoint_every={extra}']
            + [f'--config.optimizer.peak_lr={lr}', f'--config.optimizer.final_lr={lr / 10}']
            + [f'--config.optimizer.warmup_steps={max(1, extra // 10)}']
        )
    return final_eval_loss(out)


def spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else float('nan')
    return f'{statistics.mean(values):.4f} ± {sd:.4f}'


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--workdir', default='runs/uptraining')
    parser.add_argument('--seeds', default='0,1,2')
    parser.add_argument('--steps', type=int, default=400)
    parser.add_argument('--extra', type=int, default=60)
    parser.add_argument('--lrs', default='3e-4,1e-3,3e-3')
    parser.add_argument('--targets', default='svformer,resformer,skipv1,skipv1-first')
    args = parser.parse_args()
    root, seeds = Path(args.workdir), [int(s) for s in args.seeds.split(',')]
    targets = ['vanilla', *args.targets.split(',')]
    scratch = sorted({TARGETS[t][1] for t in targets[1:]})
    lrs = [float(lr) for lr in args.lrs.split(',')]
    seed_list = f'--seeds={args.seeds}'
    run(
        ['vrl.experiments.compare', f'--config={CONFIG}', '--variants=vanilla', seed_list, f'--workdir={root / "base"}']
    )
    run(
        ['vrl.experiments.compare', f'--config={CONFIG}', f'--variants={",".join(scratch)}', seed_list]
        + [f'--workdir={root / "scratch"}', f'--config.train.steps={args.steps + args.extra}']
    )
    base = {seed: root / 'base' / 'runs' / f'vanilla-s{seed}' for seed in seeds}
    bracket = {
        (target, lr): uptrain(base[seeds[0]], target, seeds[0], args.extra, lr, root / f'{target}-lr{lr:g}-s{seeds[0]}')
        for target in targets
        for lr in lrs
    }
    best = {target: min(lrs, key=lambda lr: bracket[target, lr]) for target in targets}
    rows = {'vanilla': {s: final_eval_loss(base[s]) for s in seeds}}
    for target in targets:
        lr = best[target]
        rows[f'{target} uptrained'] = {
            s: uptrain(base[s], target, s, args.extra, lr, root / f'{target}-lr{lr:g}-s{s}') for s in seeds
        }
    for target in scratch:
        rows[f'{target} from scratch'] = {
            s: final_eval_loss(root / 'scratch' / 'runs' / f'{target}-s{s}') for s in seeds
        }
    print(f'\n{CONFIG}, seeds {args.seeds}; vanilla {args.steps} steps, then {args.extra} more uptraining')
    print(
        'uptraining peak LR, seed '
        + str(seeds[0])
        + ': '
        + '; '.join(f'{t} ' + ', '.join(f'{lr:g} {bracket[t, lr]:.4f}' for lr in lrs) for t in targets)
    )
    print('| run | steps | eval loss (mean ± s.d.) | vs vanilla continued | vs from scratch |')
    print('|---|---|---|---|---|')
    continued = rows['vanilla uptrained']
    for name, losses in rows.items():
        steps = args.steps if name == 'vanilla' else args.steps + args.extra
        values = [losses[s] for s in seeds]
        against = [
            spread([losses[s] - other[s] for s in seeds]) if other is not losses and name.endswith('uptrained') else ''
            for other in (continued, rows.get(f'{TARGETS[name.split(" ")[0]][1]} from scratch', losses))
        ]
        print(f'| {name} | {steps} | {spread(values)} | {against[0]} | {against[1]} |')


if __name__ == '__main__':
    main()
