"""Compare variants in one command: train each (variant, seed), evaluate, analyse, report.

    python -m vrl.compare --config=configs/tiny.py --variants=vanilla,resformer,svformer \\
        [--seeds=0,1,2] --workdir=DIR [--config.train.steps=400 ...]
    python -m vrl.compare --list_variants

Variants are vrl/presets.py's names. Every run has the base config's shape, data order (data.seed)
and token budget (steps x batch x seq_len); the seed sets the parameter init (train.seed). Runs go
one after another on the local devices (on a pod, every host runs this same command, as with
vrl.main); each writes DIR/runs/<variant>-s<seed>/, a vrl.main workdir. A finished run (its
result.json exists) is reused, an unfinished one resumes from its checkpoint, so adding a variant
trains only that one and an interrupted comparison continues where it stopped.

DIR gets report.md (a table per variant: final eval loss, mean and spread over seeds; its
difference from vanilla's, seed by seed; parameters; KV-cache bytes per token; train tokens/s),
results.json (the same numbers and the curves), and PNGs: eval loss, training loss relative to
vanilla after a moving average (the paper's "relative training loss"; the window is
vrl/curves.py's), and vrl.analyze's per-layer entropy, similarity, first-token attention and
norms, averaged over seeds. One process at a time writes DIR (vrl/grid.py). With
--tasks (lm-eval task names; needs requirements-extra.txt), each run is also evaluated on them
by vrl.evaluate and the report gets a table of their metrics, mean over seeds; tasks added later
are evaluated on the finished runs without training them again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from vrl import analyze, curves, grid, plots, presets
from vrl.config import Config, from_configdict
from vrl.grid import Downstream, Run

BASELINE = 'vanilla'


def plan(base: Config, variants: list[str], seeds: list[int]) -> list[Run]:
    """Every (variant, seed): the base config with the variant's model fields and the seed's init.
    Runs log every step (the relative-loss curves need each step's loss) and print no sample."""
    if not variants:
        raise grid.GridError(f'--variants is empty: name at least one of {", ".join(presets.PRESETS)}.')
    if len(set(variants)) < len(variants) or len(set(seeds)) < len(seeds):
        raise grid.GridError(f'--variants={",".join(variants)} / --seeds={",".join(map(str, seeds))}: '
                             'each name and seed once.')
    runs = []
    for variant in variants:
        model = presets.apply(variant, base.model)
        for seed in seeds:
            runs.append(Run(variant, seed, dataclasses.replace(
                base, model=model, train=dataclasses.replace(base.train, seed=seed, log_every=1, sample_prompt=''))))
    return runs


def summarize(results: list[dict], variants: list[str]) -> list[dict]:
    """One row per variant; deltas pair each seed with vanilla's run of the same seed."""
    by_variant = {v: [r for r in results if r['variant'] == v] for v in variants}
    baseline = {r['seed']: r['eval_loss'] for r in by_variant.get(BASELINE, [])}
    rows = []
    for variant, runs in by_variant.items():
        loss, loss_spread = curves.mean_and_spread([r['eval_loss'] for r in runs])
        deltas = [r['eval_loss'] - baseline[r['seed']] for r in runs if r['seed'] in baseline]
        delta, delta_spread = curves.mean_and_spread(deltas) if deltas else (math.nan, math.nan)
        rows.append({'variant': variant, 'model': runs[0]['model'], 'seeds': [r['seed'] for r in runs],
                     'eval_loss': loss, 'eval_loss_spread': loss_spread, 'delta_vs_vanilla': delta,
                     'delta_spread': delta_spread, 'params': runs[0]['params'],
                     'kv_cache_bytes_per_token': runs[0]['kv_cache_bytes_per_token'],
                     'tokens_per_sec': float(np.mean([r['tokens_per_sec'] for r in runs])),
                     'downstream': _mean_downstream([r.get('downstream', {}) for r in runs])})
    return rows


def _mean_downstream(per_run: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """{task: {metric: mean over the runs}} for the metrics every run has."""
    tasks = set.intersection(*(set(d) for d in per_run)) if per_run else set()
    return {task: {metric: float(np.mean([d[task][metric] for d in per_run]))
                   for metric in set.intersection(*(set(d[task]) for d in per_run))} for task in sorted(tasks)}


def write_plots(results: list[dict], variants: list[str], workdir: Path) -> list[Path]:
    by_variant = {v: [r for r in results if r['variant'] == v] for v in variants}
    eval_lines, relative_lines = [], []
    train_curves = {v: curves.mean_curve([r['train_loss'] for r in runs]) for v, runs in by_variant.items()}
    window = curves.smoothing_window(max(r['step'] for r in results))
    for color, (variant, runs) in enumerate(by_variant.items()):
        curve = curves.mean_curve([r['eval_curve'] for r in runs])
        eval_lines.append(plots.Line(variant, list(curve), list(curve.values()), '-', color))
        if BASELINE in train_curves:
            steps, relative = curves.relative_loss(train_curves[variant], train_curves[BASELINE], window)
            relative_lines.append(plots.Line(variant, steps, relative, '-', color))
    written = [plots.line_plot(workdir / 'eval_loss.png', 'Validation loss', 'step', 'eval loss (mean over seeds)',
                               eval_lines)]
    if relative_lines:
        written.append(plots.line_plot(
            workdir / 'relative_train_loss.png', f'Training loss minus vanilla\'s ({window}-step moving average)',
            'step', 'relative training loss (mean over seeds)', relative_lines, markers=False))
    analysed = {v: [r['analysis'] for r in runs if r['analysis']] for v, runs in by_variant.items()}
    mean_analysis = {variant: {'variant': by_variant[variant][0]['model'], **{
        k: np.mean([a[k] for a in analyses], axis=0).tolist() for k in analyze.STATISTICS}}
        for variant, analyses in analysed.items() if analyses}
    return written + (analyze.plot(mean_analysis, workdir) if mean_analysis else [])


def report(rows: list[dict], figures: list[Path], base: Config, seeds: list[int]) -> str:
    tokens = base.train.steps * base.data.batch_size * base.data.seq_len
    lines = [
        '# Variant comparison', '',
        f'{base.train.steps} steps x {base.data.batch_size} x {base.data.seq_len} tokens ({tokens:,} tokens) on '
        f'`{base.data.mixture or base.data.name}`, seeds {", ".join(map(str, seeds))}; {base.model.n_layers} layers, d_model '
        f'{base.model.d_model}. Eval loss: mean ± standard deviation over seeds; the delta pairs each seed with '
        'vanilla\'s run of the same seed.', '',
        '| variant | model | final eval loss | Δ vs vanilla | params | KV cache B/token | train tokens/s |',
        '|---|---|---|---|---|---|---|',
    ]
    for r in rows:
        delta = ('—' if math.isnan(r['delta_vs_vanilla']) else
                 '+' * (r['delta_vs_vanilla'] >= 0) + curves.plus_minus(r['delta_vs_vanilla'], r['delta_spread']))
        lines.append(f'| {r["variant"]} | {r["model"]} | {curves.plus_minus(r["eval_loss"], r["eval_loss_spread"])} | '
                     f'{delta} | {r["params"]:,} | {r["kv_cache_bytes_per_token"]:,} | {r["tokens_per_sec"]:,.0f} |')
    columns = sorted({(task, metric) for r in rows for task, metrics in r['downstream'].items() for metric in metrics})
    if columns:
        lines += ['', '## Downstream tasks (lm-eval, mean over seeds)', '',
                  '| variant | ' + ' | '.join(f'{task} {metric}' for task, metric in columns) + ' |',
                  '|---|' + '---|' * len(columns)]
        for r in rows:
            lines.append(f'| {r["variant"]} | ' + ' | '.join(
                f'{r["downstream"][t][m]:.4f}' if m in r['downstream'].get(t, {}) else '—' for t, m in columns) + ' |')
    lines += ['', '## Figures', ''] + [f'![{f.stem}]({f.name})' for f in figures]
    return '\n'.join(lines) + '\n'


def compare(base: Config, variants: list[str], seeds: list[int], workdir: Path, analysis_sequences: int,
            downstream: Downstream | None = None) -> list[dict]:
    """Trains what is missing, then writes report.md, results.json and the plots; returns the table rows."""
    runs = plan(base, variants, seeds)
    directory = grid.GridDirectory(workdir, 'compare.json', 'comparison')
    directory.check_same_base(base)
    if downstream:
        downstream.index()  # an unknown task is an error before anything trains
    if BASELINE not in variants:
        logging.warning('no vanilla among --variants: the deltas and relative-loss plot need it')
    directory.open(base)
    try:
        results = [grid.train_or_reuse(run, workdir, analysis_sequences, downstream) for run in runs]
        rows = summarize(results, variants)
        if jax.process_index() == 0:
            figures = write_plots(results, variants, workdir)
            directory.write_text('results.json', json.dumps({'table': rows, 'runs': results}, indent=1))
            directory.write_text('report.md', report(rows, figures, base, seeds))
    finally:
        directory.close()
    return rows


def _define_flags() -> dict:
    """The command's flags, defined only when it runs (the notebook imports this module's functions)."""
    return {
        'config': config_flags.DEFINE_config_file('config', None, 'The base config (configs/*.py); its model shape, '
                                                  'data and budget are shared by every run.', lock_config=True),
        'variants': flags.DEFINE_list('variants', [], 'vrl/presets.py names, e.g. vanilla,resformer,svformer.'),
        'seeds': flags.DEFINE_list('seeds', ['0'], 'Parameter-init seeds; each variant is trained once per seed.'),
        'workdir': flags.DEFINE_string('workdir', None, 'Where the runs, the report and the plots go.'),
        'list_variants': flags.DEFINE_bool('list_variants', False, 'Print the variant presets and exit.'),
        'analysis_sequences': flags.DEFINE_integer('analysis_sequences', 16,
                                                   'Validation sequences for vrl.analyze per run (0: none).'),
        'tasks': flags.DEFINE_list('tasks', [], 'lm-eval tasks to evaluate every run on (vrl.evaluate).'),
        'task_limit': flags.DEFINE_float('task_limit', None, 'Examples per task (< 1: a fraction).'),
        'include_path': flags.DEFINE_string('include_path', None, 'A folder of lm-eval task YAMLs of your own.'),
    }


def parse_seeds(values: list[str]) -> list[int]:
    try:
        return [int(s) for s in values]
    except ValueError:
        raise grid.GridError(f'--seeds={",".join(values)} is invalid: allowed integers such as 0,1,2.') from None


def main(argv: list[str], args: dict) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    if args['list_variants'].value:
        print(presets.listing())
        return
    if args['config'].value is None or not args['workdir'].value:
        raise app.UsageError('give --config, --variants and --workdir (or --list_variants)')
    logging.set_verbosity(logging.WARNING)
    errors = grid.RUN_ERRORS
    if args['tasks'].value:
        try:
            from vrl import evaluate
        except ImportError as e:
            sys.exit(f'error: --tasks {e}')
        errors += (evaluate.EvaluateError,)
    try:
        workdir = Path(args['workdir'].value).absolute()
        downstream = (Downstream(args['tasks'].value, args['task_limit'].value, args['include_path'].value)
                      if args['tasks'].value else None)
        rows = compare(from_configdict(args['config'].value), args['variants'].value,
                       parse_seeds(args['seeds'].value), workdir, args['analysis_sequences'].value, downstream)
    except errors as e:
        sys.exit(f'error: {e}')
    for r in rows:
        print(f'{r["variant"]}: eval loss {curves.plus_minus(r["eval_loss"], r["eval_loss_spread"])}, '
              f'vs vanilla {r["delta_vs_vanilla"]:+.4f}')
    print(f'report: {workdir / "report.md"}')


if __name__ == '__main__':
    _ARGS = _define_flags()
    app.run(lambda argv: main(argv, _ARGS))
