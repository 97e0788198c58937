"""The paper's headline claims as one command: size ladders x learning-rate sweeps x seeds (x sequence lengths).

    python -m vrl.experiments.study --config=configs/reproduce_cpu.py --variants=vanilla,resformer,svformer \\
        --sizes=d64,d96,d128 --lrs=1e-3,3e-3,1e-2 --seeds=0,1 [--seq_lens=64,128,256] \\
        [--budget=steps|params] [--fit_metric=TASK/METRIC] --workdir=DIR [--list] [--config.train.steps=400 ...]

Every (variant, size, LR, seq_len, seed) is a vrl.main workdir under DIR/runs/, trained, reused or
resumed by vrl/experiments/grid.py exactly as vrl.experiments.compare's runs are, so adding a size, LR or seed trains
only
the new runs. --list prints the planned grid (parameters, tokens, estimated time, what is done)
without training.

Sizes (docs/scaling.md): `base` is the base config's shape; `d<width>` sets d_model, with as many
heads of the base head_dim as fit, the base's query heads per kv head and d_ff/d_model ratio;
`l<layers>` sets the depth; `d128l12` both. Every size keeps the base's tokens per step. --budget:
`steps` (default) gives every run the base's train.steps; `params` scales each size's steps with its
vanilla non-embedding parameters (the base shape keeps train.steps), i.e. tokens proportional to
parameters. The cosine's decay_steps keep their ratio to train.steps, and final_lr its ratio to
peak_lr. A seq_len other than the base's keeps tokens per step (batch = tokens / seq_len).

DIR gets study.md, results.json and PNGs: final eval loss per LR (mean and spread over seeds) and
the best LR, flagged where it sits at the edge of the sweep; per variant a power-law fit of loss vs
non-embedding parameters at each size's best LR (vrl/experiments/scaling.py) and the parameters saved against
vanilla at equal loss, with a bootstrap interval over seeds; per size the tokens each variant
needs to reach vanilla's final eval loss (data saved); per size and seq_len the critical step
after which vanilla's smoothed training loss stays below the variant's.

With --config.train.downstream_tasks, every run scores those lm-eval tasks while it trains: study.md
gets their final scores and DIR the curves over training (seeds as bands), and --fit_metric=TASK/METRIC
fits sizes on that score instead of the loss ("which size of vanilla matches ResFormer on
hellaswag"; the best LR is still the one of lowest eval loss).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from typing import Any

import jax
from absl import flags
from etils import epath
from ml_collections import config_flags

from vrl.core import cli, extras, storage
from vrl.experiments import grid, launchers, ledger, study_report
from vrl.experiments.compare import parse_seeds
from vrl.experiments.grid import GridError, Run
from vrl.experiments.study_report import BASELINE, Axes
from vrl.model import accounting, presets, resolve
from vrl.model.config import ModelConfig
from vrl.train import metrics
from vrl.train.config import Config, from_configdict
from vrl.train.rundir import checkpoint

BUDGETS = ('steps', 'params')
_SIZE = re.compile(r'(?:d(\d+))?(?:l(\d+))?')
# Until a run of this study has finished, --list's time estimate assumes this fraction of the
# host's measured matmul peak, plus a fixed cost per run (compiles, evals, checkpoints).
_GUESS_PEAK_FRACTION = 0.2
_GUESS_SECONDS_PER_RUN = 20.0


def sized(name: str, base: ModelConfig) -> ModelConfig:
    """The model shape a size name stands for (module docstring); GridError names a bad one."""
    allowed = "allowed 'base', d<width>, l<layers> or both (d128l12)"
    match = _SIZE.fullmatch(name)
    if name == 'base':
        return base
    if not name or match is None:
        raise GridError(f'--sizes: {name!r} is not a size; {allowed}.')
    width, layers = match.groups()
    fields: dict[str, Any] = {}
    if layers:
        fields['n_layers'] = int(layers)
    if width:
        d_model = int(width)
        group = base.n_heads // base.n_kv_heads
        n_heads = d_model // base.head_dim
        if d_model % base.head_dim or n_heads % group or not n_heads:
            raise GridError(
                f'--sizes: {name!r} needs d_model={d_model} to be a multiple of head_dim x query heads '
                f'per kv head = {base.head_dim * group}.'
            )
        d_ff = max(8, round(base.d_ff * d_model / base.d_model / 8) * 8)
        fields.update(d_model=d_model, n_heads=n_heads, n_kv_heads=n_heads // group, d_ff=d_ff)
    return dataclasses.replace(base, **fields)


def check(base: Config, axes: Axes) -> None:
    """Every axis non-empty, distinct and valid; GridError names the first that is not."""
    for flag, values in (
        ('--variants', axes.variants),
        ('--sizes', axes.sizes),
        ('--lrs', axes.lrs),
        ('--seeds', axes.seeds),
        ('--seq_lens', axes.seq_lens),
    ):
        if not values:
            raise GridError(f'{flag} is empty: give at least one value.')
        if len(set(values)) < len(values):
            raise GridError(f'{flag}={",".join(map(str, values))}: each value once.')
    if axes.budget not in BUDGETS:
        raise GridError(f'--budget={axes.budget} is invalid: allowed {", ".join(BUDGETS)}.')
    bad = [lr for lr in axes.lrs if not (math.isfinite(lr) and lr > 0)]
    if bad:
        raise GridError(f'--lrs: {bad[0]} is invalid: allowed floats > 0.')
    tokens = base.data.batch_size * base.data.seq_len
    for seq_len in axes.seq_lens:
        if seq_len < 1 or tokens % seq_len:
            raise GridError(
                f"--seq_lens: {seq_len} is invalid: allowed divisors of the base's tokens per step "
                f'({base.data.batch_size} x {base.data.seq_len} = {tokens}).'
            )
    if axes.fit_metric != 'eval_loss':
        task, _, metric = axes.fit_metric.partition('/')
        if task not in base.train.task_names or not metric:
            raise GridError(
                f'--fit_metric={axes.fit_metric} is invalid: allowed eval_loss or TASK/METRIC of a task '
                f'the runs score while training (--config.train.downstream_tasks='
                f'{base.train.downstream_tasks!r}), such as hellaswag/acc_norm.'
            )
        study_report.lower_is_better(metric)  # a metric lm-eval knows


def _steps(base: Config, size: ModelConfig, budget: str) -> int:
    if budget == 'steps':
        return base.train.steps
    vanilla = accounting.non_embedding_params
    ratio = vanilla(presets.apply(BASELINE, size)) / vanilla(presets.apply(BASELINE, base.model))
    return max(1, round(base.train.steps * ratio))


def plan(base: Config, axes: Axes) -> list[Run]:
    """Every run of the grid, in the order they train: size, seq_len, LR, variant, seed."""
    check(base, axes)
    runs = []
    tokens = base.data.batch_size * base.data.seq_len
    for size, seq_len, lr in itertools.product(axes.sizes, axes.seq_lens, axes.lrs):
        shape = sized(size, base.model)
        steps = _steps(base, shape, axes.budget)
        decay_steps = base.optimizer.decay_steps and max(  # 0 follows each run's train.steps
            base.optimizer.warmup_steps + 1, round(base.optimizer.decay_steps * steps / base.train.steps)
        )
        schedule = dataclasses.replace(
            base.optimizer,
            peak_lr=lr,
            final_lr=base.optimizer.final_lr * lr / base.optimizer.peak_lr,
            decay_steps=decay_steps,
        )
        data = dataclasses.replace(base.data, seq_len=seq_len, batch_size=tokens // seq_len)
        coordinates = (('size', size), ('lr', f'lr{lr:g}'), ('seq', f'L{seq_len}'))
        for variant in axes.variants:
            model = presets.apply(variant, shape)
            for seed in axes.seeds:
                train_cfg = dataclasses.replace(
                    base.train, steps=steps, seed=seed, log_every=1, sample_tokens=0, print_every=base.train.log_every
                )
                config = dataclasses.replace(base, model=model, data=data, optimizer=schedule, train=train_cfg)
                runs.append(Run(variant, seed, config, coordinates))
    return runs


# --- the grid before training: --list ---


def _seconds_per_flop(finished: list[dict], model: ModelConfig) -> tuple[float, float, str]:
    """(seconds per training FLOP, seconds per run, where the figures come from): from the `finished` runs'
    ledger rows, or a guess."""
    timed = [r for r in finished if r.get('seconds') and r.get('flops')]
    if timed:
        return (
            sum(r['seconds'] for r in timed) / sum(r['flops'] for r in timed),
            0.0,
            f'from the {len(timed)} runs of this study in its ledger',
        )
    peak = metrics.peak_flops(0.0, resolve.local_compute_dtype(model))
    return (
        1 / (_GUESS_PEAK_FRACTION * peak.flops),
        _GUESS_SECONDS_PER_RUN,
        f'a guess: {_GUESS_PEAK_FRACTION:.0%} of the peak, {peak}, + {_GUESS_SECONDS_PER_RUN:.0f} s a run',
    )


def listing(runs: list[Run], workdir: epath.Path) -> str:
    """The planned grid, a line per run: status (recorded in the ledger, finished, at a step, new), shape,
    parameters, tokens, estimated time."""
    rows = ledger.read(workdir / ledger.LEDGER)
    per_flop, per_run, source = _seconds_per_flop(list(rows.values()), runs[0].config.model)
    header = (
        f'{"run":<40} {"status":<12} {"layers":>6} {"d_model":>7} {"non-emb params":>14} {"steps":>6} '
        f'{"tokens":>12} {"est. time":>9}'
    )
    lines, remaining = [header], 0.0
    for run in runs:
        cfg = run.config
        account = accounting.account(cfg.model, cfg.data.seq_len)
        tokens = cfg.train.steps * cfg.data.batch_size * cfg.data.seq_len
        seconds = per_run + per_flop * account.flops_per_token * tokens
        run_dir = workdir / 'runs' / run.name
        if ledger.fingerprint(cfg) in rows:
            status = 'recorded'
        elif (run_dir / 'result.json').exists():
            status = 'finished'
        else:
            remaining += seconds
            saved = checkpoint.latest_step(run_dir) if run_dir.exists() else None
            status = f'at step {saved}' if saved else 'new'
        lines.append(
            f'{run.name:<40} {status:<12} {cfg.model.n_layers:>6} {cfg.model.d_model:>7} '
            f'{account.non_embedding_params:>14,} {cfg.train.steps:>6} {tokens:>12,} {seconds / 60:>8.1f}m'
        )
    lines.append(f'{len(runs)} runs; what is not finished: about {remaining / 60:.0f} minutes ({source}).')
    return '\n'.join(lines)


def study(
    base: Config,
    axes: Axes,
    workdir: epath.Path,
    analysis_sequences: int = 0,
    group_runs: bool = True,
    report_only: bool = False,
    launching: launchers.Launching | None = None,
) -> dict[str, Any]:
    """Trains what is missing (nothing with `report_only`; as scheduler jobs with `launching`), recording
    each run in DIR/results.jsonl, then writes study.md, results.json and the plots from that ledger;
    returns the summary."""
    runs = plan(base, axes)
    directory = grid.GridDirectory(workdir, 'study.json', 'study')
    held = ledger.Ledger(workdir, base)
    if report_only:
        grid.from_ledger(runs, held)  # every run there, before anything is written
    elif launching:
        launching.check(workdir)
    directory.open(base)
    try:
        if launching and not report_only:
            launching.train(runs, workdir, analysis_sequences, held)
        if not report_only:
            grid.train_all(runs, workdir, analysis_sequences, group_runs=group_runs, held=held)
        results = grid.from_ledger(runs, held)
        points = study_report.Points(results, axes)
        fit_seq_len = base.data.seq_len if base.data.seq_len in axes.seq_lens else axes.seq_lens[0]
        summary = study_report.summarize(points, fit_seq_len)
        if jax.process_index() == 0:
            figures = study_report.write_plots(points, summary, workdir)
            directory.write_text(
                'results.json', json.dumps({'axes': dataclasses.asdict(axes), **summary, 'runs': results}, indent=1)
            )
            shapes = {size: sized(size, base.model) for size in axes.sizes}
            directory.write_text('study.md', study_report.report(points, summary, shapes, _intro(base, axes), figures))
    finally:
        directory.close()
    return summary


def _intro(base: Config, axes: Axes) -> str:
    tokens = base.data.batch_size * base.data.seq_len
    budget = (
        f"the base config's {base.train.steps} steps for every run"
        if axes.budget == 'steps'
        else f'steps proportional to non-embedding parameters ({base.train.steps} at the base shape)'
    )
    return (
        f'Variants {", ".join(axes.variants)}; sizes {", ".join(axes.sizes)}; peak LRs '
        f'{", ".join(f"{lr:g}" for lr in axes.lrs)}; seeds {", ".join(map(str, axes.seeds))}; seq_lens '
        f'{", ".join(map(str, axes.seq_lens))}; {tokens:,} tokens per step on '
        f'`{base.data.mixture or base.data.name}`; optimizer {base.optimizer.name} with a '
        f'{base.optimizer.schedule} schedule; budget: {budget}.'
    )


def _define_flags() -> dict:
    return launchers.define_flags() | {
        'config': config_flags.DEFINE_config_file(
            'config',
            None,
            'The base config (configs/*.py): the shape the sizes start from, the data, recipe and budget.',
            lock_config=True,
        ),
        'variants': flags.DEFINE_list('variants', ['vanilla', 'resformer', 'svformer'], 'vrl/model/presets.py names.'),
        'sizes': flags.DEFINE_list('sizes', ['base'], "Size ladder: 'base', d<width>, l<layers>, d<width>l<layers>."),
        'lrs': flags.DEFINE_list('lrs', [], "Peak LRs to sweep (default: the base config's optimizer.peak_lr)."),
        'seeds': flags.DEFINE_list('seeds', ['0'], 'Parameter-init seeds.'),
        'seq_lens': flags.DEFINE_list(
            'seq_lens', [], "Sequence lengths at the base's tokens per step (default: the base's data.seq_len)."
        ),
        'budget': flags.DEFINE_enum(
            'budget',
            'steps',
            BUDGETS,
            'steps: every run trains train.steps; params: steps proportional to non-embedding parameters.',
        ),
        'workdir': flags.DEFINE_string('workdir', None, 'Where the runs, study.md and the plots go.'),
        'group_runs': flags.DEFINE_bool(
            'group_runs',
            True,
            'Train runs that differ only in seed together in one '
            'compiled step (vrl/experiments/grid.py); false: one run after another.',
        ),
        'fit_metric': flags.DEFINE_string(
            'fit_metric',
            'eval_loss',
            'What the size fits are of: eval_loss, or '
            'TASK/METRIC of train.downstream_tasks at the final step (e.g. '
            'hellaswag/acc_norm; a score where higher is better is fitted as 1 - score).',
        ),
        'list': flags.DEFINE_bool('list', False, 'Print the planned grid with estimated times; train nothing.'),
        'report_only': flags.DEFINE_bool(
            'report_only', False, 'Train nothing: remake study.md, results.json and the figures from DIR/results.jsonl.'
        ),
        'analysis_sequences': flags.DEFINE_integer(
            'analysis_sequences', 0, 'Validation sequences for vrl.experiments.analyze per run (0: no analysis).'
        ),
    }


def _floats(flag: str, values: list[str]) -> list[float]:
    try:
        return [float(v) for v in values]
    except ValueError:
        raise GridError(f'{flag}={",".join(values)} is invalid: allowed numbers such as 1e-3,3e-3.') from None


def main(args: cli.Args) -> None:
    cli.require(args, 'config', 'workdir')
    cli.enable_compilation_cache()
    base = from_configdict(args['config'].value)
    if not args['list'].value:
        extras.require('vrl.experiments.study (for its figures)', 'matplotlib')
        if base.train.task_names:
            extras.require('train.downstream_tasks (lm-evaluation-harness)', 'lm_eval')
    axes = Axes(
        args['variants'].value,
        args['sizes'].value,
        _floats('--lrs', args['lrs'].value) if args['lrs'].value else [base.optimizer.peak_lr],
        parse_seeds(args['seeds'].value),
        [int(v) for v in _floats('--seq_lens', args['seq_lens'].value)] or [base.data.seq_len],
        args['budget'].value,
        args['fit_metric'].value,
    )
    workdir = storage.path(args['workdir'].value)
    launching = launchers.from_flags(args)
    if args['list'].value:
        runs = plan(base, axes)
        print(listing(runs, workdir))
        if launching:
            print(launching.describe(runs, workdir, ledger.Ledger(workdir, base)))
        return
    study(
        base,
        axes,
        workdir,
        args['analysis_sequences'].value,
        args['group_runs'].value,
        args['report_only'].value,
        launching,
    )
    print(f'report: {workdir / "study.md"}')


def cli_main() -> None:
    """`vrl-study` (pyproject.toml's scripts): `python -m vrl.experiments.study` by another name."""
    cli.run(main, _define_flags, schema=Config)


if __name__ == '__main__':
    cli_main()
