"""Compare variants in one command: train each (variant, seed), evaluate, analyse, report.

    python -m vrl.experiments.compare --config=configs/tiny.py --variants=vanilla,resformer,svformer \\
        [--seeds=0,1,2] --workdir=DIR [--config.train.steps=400 ...]
    python -m vrl.experiments.compare --list_variants

Variants are vrl/model/presets.py's names. Every run has the base config's shape, data order (data.seed)
and token budget (steps x batch x seq_len); the seed sets the parameter init (train.seed). A variant's
seeds train together, one compiled step over a run axis sharing each batch (--group_runs=false:
one after another), on the local devices (on a pod, every host runs this same command, as with
vrl.main); each run writes DIR/runs/<variant>-s<seed>/, a vrl.main workdir. A finished run (its
result.json exists) is reused, an unfinished one resumes from its checkpoint, so adding a variant
trains only that one and an interrupted comparison continues where it stopped.

DIR gets report.md (a table per variant: final eval loss, mean and spread over seeds; its
difference from vanilla's, seed by seed; parameters; KV-cache bytes per token; train tokens/s; then
every pair of variants, or each against --baseline, differenced by seed with a 95% interval and what
the seeds can show),
results.json (the same numbers and the curves), and PNGs: eval loss, training loss relative to
vanilla after a moving average (the paper's "relative training loss"; the window is
vrl/experiments/curves.py's), and vrl.experiments.analyze's per-layer entropy, similarity, first-token attention and
norms, averaged over seeds. One process at a time writes DIR (vrl/experiments/grid.py). With
--tasks (lm-eval task names; needs requirements-extra.txt), each run is also evaluated on them
by vrl.tools.evaluate and the report gets a table of their metrics, mean over seeds; tasks added later
are evaluated on the finished runs without training them again.
"""

from __future__ import annotations

import dataclasses
import json

import jax
from absl import flags, logging
from etils import epath
from ml_collections import config_flags

from vrl.core import cli, extras, storage
from vrl.experiments import compare_report, curves, grid, launchers, ledger
from vrl.experiments.grid import BASELINE, Downstream, Run
from vrl.model import presets
from vrl.train.config import Config, from_configdict

EVAL_POINTS = 8  # a run evaluates at least this often, so that even a short one draws an eval curve


def plan(base: Config, variants: list[str], seeds: list[int]) -> list[Run]:
    """Every (variant, seed): the base config with the variant's model fields and the seed's init.
    Runs record every step (the relative-loss curves need each step's loss), print at the config's
    log_every, evaluate at least EVAL_POINTS times (train.eval_every lowered where it is rarer), and print
    no sample."""
    eval_every = max(1, base.train.steps // EVAL_POINTS)
    if base.train.eval_every:
        eval_every = min(base.train.eval_every, eval_every)
    if not variants:
        raise grid.GridError(f'--variants is empty: name at least one of {", ".join(presets.PRESETS)}.')
    if len(set(variants)) < len(variants) or len(set(seeds)) < len(seeds):
        raise grid.GridError(
            f'--variants={",".join(variants)} / --seeds={",".join(map(str, seeds))}: each name and seed once.'
        )
    runs = []
    for variant in variants:
        model = presets.apply(variant, base.model)
        for seed in seeds:
            runs.append(
                Run(
                    variant,
                    seed,
                    dataclasses.replace(
                        base,
                        model=model,
                        train=dataclasses.replace(
                            base.train,
                            seed=seed,
                            log_every=1,
                            sample_tokens=0,
                            print_every=base.train.log_every,
                            eval_every=eval_every,
                        ),
                    ),
                )
            )
    return runs


def compare(
    base: Config,
    variants: list[str],
    seeds: list[int],
    workdir: epath.Path,
    analysis_sequences: int,
    downstream: Downstream | None = None,
    group_runs: bool = True,
    baseline: str = '',
    report_only: bool = False,
    launching: launchers.Launching | None = None,
) -> tuple[list[dict], list[dict]]:
    """Trains what is missing (nothing with `report_only`), recording each run in DIR/results.jsonl, then
    writes report.md, results.json and the plots from that ledger; returns the table rows and the paired
    differences (every pair of variants, or each against `baseline`)."""
    if baseline and baseline not in variants:
        raise grid.GridError(f'--baseline={baseline} is not among --variants={",".join(variants)}: name one of them.')
    runs = plan(base, variants, seeds)
    directory = grid.GridDirectory(workdir, 'compare.json', 'comparison')
    directory.check_same_base(base)
    if downstream:
        downstream.index()  # an unknown task is an error before anything trains
    if BASELINE not in variants:
        logging.warning('no vanilla among --variants: the deltas and relative-loss plot need it')
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
            grid.train_all(runs, workdir, analysis_sequences, downstream, group_runs, held)
        results = grid.from_ledger(runs, held)
        rows = compare_report.summarize(results, variants)
        pairs = compare_report.differences(results, variants, baseline)
        if jax.process_index() == 0:
            figures = compare_report.write_plots(results, variants, workdir)
            record = {'table': rows, 'differences': pairs, 'runs': results}
            directory.write_text('results.json', json.dumps(record, indent=1))
            directory.write_text('report.md', compare_report.report(rows, figures, base, seeds, pairs))
    finally:
        directory.close()
    return rows, pairs


def listing(runs: list[Run], workdir: epath.Path, held: ledger.Ledger, launching: launchers.Launching | None) -> str:
    """--list: each run and whether the ledger holds it or its workdir finished it; then the jobs a
    launcher would submit."""
    lines = []
    for run in runs:
        finished = (workdir / 'runs' / run.name / 'result.json').exists()
        lines.append(f'{run.name:<40} {"recorded" if held.held(run.config) else "finished" if finished else "new"}')
    if launching:
        lines.append(launching.describe(runs, workdir, held))
    return '\n'.join(lines)


def _define_flags() -> dict:
    """The command's flags, defined only when it runs (the notebook imports this module's functions)."""
    return launchers.define_flags() | {
        'config': config_flags.DEFINE_config_file(
            'config',
            None,
            'The base config (configs/*.py); its model shape, data and budget are shared by every run.',
            lock_config=True,
        ),
        'variants': flags.DEFINE_list('variants', [], 'vrl/model/presets.py names, e.g. vanilla,resformer,svformer.'),
        'seeds': flags.DEFINE_list('seeds', ['0'], 'Parameter-init seeds; each variant is trained once per seed.'),
        'workdir': flags.DEFINE_string('workdir', None, 'Where the runs, the report and the plots go.'),
        'list_variants': flags.DEFINE_bool('list_variants', False, 'Print the variant presets and exit.'),
        'list': flags.DEFINE_bool(
            'list',
            False,
            'Print the runs (recorded in the ledger, finished or not) and the jobs a launcher would submit.',
        ),
        'analysis_sequences': flags.DEFINE_integer(
            'analysis_sequences', 16, 'Validation sequences for vrl.experiments.analyze per run (0: none).'
        ),
        'tasks': flags.DEFINE_list('tasks', [], 'lm-eval tasks to evaluate every run on (vrl.tools.evaluate).'),
        'task_limit': flags.DEFINE_float('task_limit', None, 'Examples per task (< 1: a fraction).'),
        'include_path': flags.DEFINE_string('include_path', None, 'A folder of lm-eval task YAMLs of your own.'),
        'baseline': flags.DEFINE_string(
            'baseline',
            '',
            'A variant of --variants that every other is compared with, paired by seed; empty: every pair.',
        ),
        'report_only': flags.DEFINE_bool(
            'report_only',
            False,
            'Train nothing: remake report.md, results.json and the figures from DIR/results.jsonl alone.',
        ),
        'group_runs': flags.DEFINE_bool(
            'group_runs',
            True,
            "Train a variant's seeds together in one compiled step "
            '(vrl/experiments/grid.py); false: one run after another.',
        ),
    }


def parse_seeds(values: list[str]) -> list[int]:
    try:
        return [int(s) for s in values]
    except ValueError:
        raise grid.GridError(f'--seeds={",".join(values)} is invalid: allowed integers such as 0,1,2.') from None


def main(args: cli.Args) -> None:
    if args['list_variants'].value:
        print(presets.listing())
        return
    cli.require(args, 'config', 'workdir')
    cli.enable_compilation_cache()
    extras.require('vrl.experiments.compare (for its figures)', 'matplotlib')
    if args['tasks'].value:
        extras.require('--tasks (lm-evaluation-harness)', 'lm_eval')
    workdir = storage.path(args['workdir'].value)
    if args['list'].value:
        base = from_configdict(args['config'].value)
        runs = plan(base, args['variants'].value, parse_seeds(args['seeds'].value))
        print(listing(runs, workdir, ledger.Ledger(workdir, base), launchers.from_flags(args)))
        return
    downstream = (
        Downstream(args['tasks'].value, args['task_limit'].value, args['include_path'].value)
        if args['tasks'].value
        else None
    )
    rows, pairs = compare(
        from_configdict(args['config'].value),
        args['variants'].value,
        parse_seeds(args['seeds'].value),
        workdir,
        args['analysis_sequences'].value,
        downstream,
        args['group_runs'].value,
        args['baseline'].value,
        args['report_only'].value,
        launchers.from_flags(args),
    )
    print(f'final eval loss, mean ± standard deviation over seeds {",".join(args["seeds"].value)}:')
    for r in rows:
        print(
            f'{r["variant"]}: eval loss {curves.plus_minus(r["eval_loss"], r["eval_loss_spread"])}, '
            f'vs vanilla {r["delta_vs_vanilla"]:+.4f}' + (f' ({r["judgement"]})' if r['judgement'] else '')
        )
    if pairs:
        print('differences, paired by seed:')
        for p in pairs:
            difference = curves.Difference(*(p[k] for k in ('mean', 'spread', 'seeds', 'low', 'high')))
            print(f'{p["a"]} − {p["b"]}: {difference.describe()}: {compare_report.shown(p)}')
        print(curves.what_seeds_show(min(p['seeds'] for p in pairs)))
    print(f'report: {workdir / "report.md"}')


def cli_main() -> None:
    """`vrl-compare` (pyproject.toml's scripts): `python -m vrl.experiments.compare` by another name."""
    cli.run(main, _define_flags, schema=Config)


if __name__ == '__main__':
    cli_main()
