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
vanilla after a 100-step moving average (the paper's "relative training loss"), and vrl.analyze's
per-layer entropy, similarity, first-token attention and norms, averaged over seeds. With
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
from typing import Any

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from vrl import accounting, analyze, checkpoint, corpus, plots, presets, tokenizer, train
from vrl import workdir as workdir_lib
from vrl.config import Config, ConfigError, from_configdict

MOVING_AVERAGE_STEPS = 100
BASELINE = 'vanilla'


class CompareError(ValueError):
    """Bad comparison input; the message names the problem."""


@dataclasses.dataclass(frozen=True)
class Run:
    variant: str
    seed: int
    config: Config

    @property
    def name(self) -> str:
        return f'{self.variant.replace(":", "-")}-s{self.seed}'


def plan(base: Config, variants: list[str], seeds: list[int]) -> list[Run]:
    """Every (variant, seed): the base config with the variant's model fields and the seed's init.
    Runs log every step: the relative-loss curves need each step's loss."""
    if not variants:
        raise CompareError(f'--variants is empty: name at least one of {", ".join(presets.PRESETS)}.')
    if len(set(variants)) < len(variants) or len(set(seeds)) < len(seeds):
        raise CompareError(f'--variants={",".join(variants)} / --seeds={",".join(map(str, seeds))}: '
                           'each name and seed once.')
    runs = []
    for variant in variants:
        model = presets.apply(variant, base.model)
        for seed in seeds:
            runs.append(Run(variant, seed, dataclasses.replace(
                base, model=model, train=dataclasses.replace(base.train, seed=seed, log_every=1))))
    return runs


def check_same_base(workdir: Path, base: Config) -> None:
    """Refuses a workdir that holds runs of another base config, naming the first difference."""
    record = workdir / 'compare.json'
    if not record.exists():
        return
    saved = json.loads(record.read_text())['base_config']
    for name, (old, value) in workdir_lib.changes(saved, workdir_lib.as_json(base)).items():
        raise CompareError(f'{workdir} holds a comparison of another config: {name} was {old!r} there and is '
                           f'{value!r} now; use another --workdir (nothing was changed).')


@dataclasses.dataclass
class Downstream:
    """lm-eval tasks to run on every run (vrl.evaluate), with one task index for all of them."""
    tasks: list[str]
    limit: float | None = None
    include_path: str | None = None
    _task_manager: Any = dataclasses.field(default=None, init=False, repr=False)

    def index(self) -> Any:
        """lm-eval's TaskManager for the tasks, built once; EvaluateError names an unknown task."""
        from vrl import evaluate  # lm-eval: requirements-extra.txt
        if self._task_manager is None:
            self._task_manager = evaluate.task_manager_for(self.tasks, self.include_path)
        return self._task_manager

    def metrics(self, run_dir: Path, tasks: list[str]) -> dict[str, dict[str, float]]:
        """{requested task: {metric: value}}: lm-eval's numbers without their stderr and filter suffix; a
        group without its own aggregate gets each subtask's, named 'subtask/metric'."""
        from vrl import evaluate  # lm-eval: requirements-extra.txt
        results = evaluate.evaluate(str(run_dir), tasks, limit=self.limit, task_manager=self.index()).results

        def numbers(task: str, prefix: str = '') -> dict[str, float]:
            return {prefix + name.split(',')[0]: float(value) for name, value in results['results'].get(task, {}).items()
                    if isinstance(value, (int, float)) and '_stderr' not in name}
        by_task = {}
        for task in tasks:
            by_task[task] = numbers(task)
            if not by_task[task]:
                for subtask in results.get('group_subtasks', {}).get(task, []):
                    by_task[task].update(numbers(subtask, f'{subtask}/'))
        return by_task


def train_or_reuse(run: Run, workdir: Path, analysis_sequences: int, downstream: Downstream | None = None
                   ) -> dict[str, Any]:
    """The run's result: read back if it finished before, else trained (or resumed), evaluated, analysed;
    then evaluated on the downstream tasks it has no result for."""
    run_dir = workdir / 'runs' / run.name
    result_file = run_dir / 'result.json'
    reused = result_file.exists()
    if reused:
        logging.warning('%s: finished before, reused', run.name)
        result = json.loads(result_file.read_text())
    else:
        result = _train(run, run_dir, analysis_sequences)
    result.setdefault('downstream', {})
    missing = [t for t in (downstream.tasks if downstream else []) if t not in result['downstream']]
    if missing:
        result['downstream'].update(downstream.metrics(run_dir, missing))
    if (missing or not reused) and jax.process_index() == 0:
        result_file.write_text(json.dumps(result))
    return json.loads(json.dumps(result))  # keys as strings, as when read back


def _train(run: Run, run_dir: Path, analysis_sequences: int) -> dict[str, Any]:
    """Trains (or resumes) the run, analyses it, and gathers its numbers from metrics.jsonl."""
    outcome = train.run(run.config, str(run_dir))
    if outcome.preempted:
        raise SystemExit(f'{run.name} was preempted and saved; run the same command to resume')
    analysis = analyze.analyze_run(str(run_dir), analysis_sequences, 0, 8)
    records = _metrics(run_dir / 'metrics.jsonl')
    speeds = [r['tokens_per_sec'] for step, r in sorted(records.items()) if 'tokens_per_sec' in r][1:]
    eval_curve = {step: r['eval_loss'] for step, r in sorted(records.items()) if 'eval_loss' in r}
    if outcome.step not in eval_curve:  # stopped between its last save and its final eval
        raise CompareError(f'{run_dir} finished training but holds no eval at step {outcome.step}; remove that '
                           'folder to train the run again.')
    account = accounting.account(run.config.model, run.config.data.seq_len)
    result = {
        'variant': run.variant, 'model': run.config.model.variant_name, 'seed': run.seed, 'step': outcome.step,
        # the final eval (also when the training had finished in an earlier, interrupted invocation)
        'eval_loss': eval_curve[outcome.step], 'params': account.params,
        'kv_cache_bytes_per_token': account.kv_cache_bytes_per_token,
        'tokens_per_sec': float(np.median(speeds)) if speeds else float('nan'),
        'train_loss': {step: r['loss'] for step, r in records.items() if 'loss' in r},
        'eval_curve': eval_curve,
        'analysis': analysis,
    }
    return result


def _metrics(path: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged twice (re-run after a resume) keeps its last record."""
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record['step'], {}).update(record)
    return by_step


def moving_average(values: list[float], window: int) -> np.ndarray:
    """Trailing mean over the last `window` values (fewer at the start), same length as values."""
    cumulative = np.concatenate([[0.0], np.cumsum(np.asarray(values, np.float64))])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def relative_loss(curve: dict[int, float], baseline: dict[int, float], window: int) -> tuple[list[int], np.ndarray]:
    """(steps, moving-average(curve) - moving-average(baseline)) over the steps both have."""
    steps = sorted(set(curve) & set(baseline))
    return steps, (moving_average([curve[s] for s in steps], window)
                   - moving_average([baseline[s] for s in steps], window))


def _mean_and_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def summarize(results: list[dict], variants: list[str]) -> list[dict]:
    """One row per variant; deltas pair each seed with vanilla's run of the same seed."""
    by_variant = {v: [r for r in results if r['variant'] == v] for v in variants}
    baseline = {r['seed']: r['eval_loss'] for r in by_variant.get(BASELINE, [])}
    rows = []
    for variant, runs in by_variant.items():
        loss, loss_spread = _mean_and_spread([r['eval_loss'] for r in runs])
        deltas = [r['eval_loss'] - baseline[r['seed']] for r in runs if r['seed'] in baseline]
        delta, delta_spread = _mean_and_spread(deltas) if deltas else (math.nan, math.nan)
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


def _mean_curve(curves: list[dict[str, float]]) -> dict[int, float]:
    steps = set.intersection(*(set(c) for c in curves))
    return {int(s): float(np.mean([c[s] for c in curves])) for s in sorted(steps, key=int)}


def write_plots(results: list[dict], variants: list[str], workdir: Path) -> list[Path]:
    by_variant = {v: [r for r in results if r['variant'] == v] for v in variants}
    eval_lines, relative_lines = [], []
    train_curves = {v: _mean_curve([r['train_loss'] for r in runs]) for v, runs in by_variant.items()}
    for color, (variant, runs) in enumerate(by_variant.items()):
        curve = _mean_curve([r['eval_curve'] for r in runs])
        eval_lines.append(plots.Line(variant, list(curve), list(curve.values()), '-', color))
        if BASELINE in train_curves:
            steps, relative = relative_loss(train_curves[variant], train_curves[BASELINE], MOVING_AVERAGE_STEPS)
            relative_lines.append(plots.Line(variant, steps, relative, '-', color))
    written = [plots.line_plot(workdir / 'eval_loss.png', 'Validation loss', 'step', 'eval loss (mean over seeds)',
                               eval_lines)]
    if relative_lines:
        written.append(plots.line_plot(
            workdir / 'relative_train_loss.png',
            f'Training loss minus vanilla\'s ({MOVING_AVERAGE_STEPS}-step moving average)',
            'step', 'relative training loss (mean over seeds)', relative_lines, markers=False))
    mean_analysis = {}
    for variant, runs in by_variant.items():
        analyses = [r['analysis'] for r in runs]
        mean_analysis[variant] = {'variant': runs[0]['model'], **{
            k: np.mean([a[k] for a in analyses], axis=0).tolist() for k in analyze.STATISTICS}}
    return written + analyze.plot(mean_analysis, workdir)


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
        delta = '—' if math.isnan(r['delta_vs_vanilla']) else f'{r["delta_vs_vanilla"]:+.4f} ± {r["delta_spread"]:.4f}'
        lines.append(f'| {r["variant"]} | {r["model"]} | {r["eval_loss"]:.4f} ± {r["eval_loss_spread"]:.4f} | '
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
    check_same_base(workdir, base)
    if downstream:
        downstream.index()  # an unknown task is an error before anything trains
    if BASELINE not in variants:
        logging.warning('no vanilla among --variants: the deltas and relative-loss plot need it')
    workdir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (workdir / 'compare.json').write_text(json.dumps({'base_config': dataclasses.asdict(base)}, indent=2))
    results = [train_or_reuse(run, workdir, analysis_sequences, downstream) for run in runs]
    rows = summarize(results, variants)
    if jax.process_index() == 0:
        figures = write_plots(results, variants, workdir)
        (workdir / 'results.json').write_text(json.dumps({'table': rows, 'runs': results}, indent=1))
        (workdir / 'report.md').write_text(report(rows, figures, base, seeds))
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
                                                   'Validation sequences for vrl.analyze per run.'),
        'tasks': flags.DEFINE_list('tasks', [], 'lm-eval tasks to evaluate every run on (vrl.evaluate).'),
        'task_limit': flags.DEFINE_float('task_limit', None, 'Examples per task (< 1: a fraction).'),
        'include_path': flags.DEFINE_string('include_path', None, 'A folder of lm-eval task YAMLs of your own.'),
    }


def main(argv: list[str], args: dict) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    if args['list_variants'].value:
        print(presets.listing())
        return
    if args['config'].value is None or not args['workdir'].value:
        raise app.UsageError('give --config, --variants and --workdir (or --list_variants)')
    logging.set_verbosity(logging.WARNING)
    try:
        seeds = [int(s) for s in args['seeds'].value]
    except ValueError:
        sys.exit(f'error: --seeds={",".join(args["seeds"].value)} is invalid: allowed integers such as 0,1,2.')
    errors = (CompareError, ConfigError, analyze.AnalysisError, FileNotFoundError, checkpoint.CheckpointMismatchError,
              corpus.DataError, tokenizer.TokenizerError, train.TrainingError, plots.PlotError)
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
        rows = compare(from_configdict(args['config'].value), args['variants'].value, seeds, workdir,
                       args['analysis_sequences'].value, downstream)
    except errors as e:
        sys.exit(f'error: {e}')
    for r in rows:
        print(f'{r["variant"]}: eval loss {r["eval_loss"]:.4f} ± {r["eval_loss_spread"]:.4f}, '
              f'vs vanilla {r["delta_vs_vanilla"]:+.4f}')
    print(f'report: {workdir / "report.md"}')


if __name__ == '__main__':
    _ARGS = _define_flags()
    app.run(lambda argv: main(argv, _ARGS))
