"""What a comparison's results say (vrl.experiments.compare): per variant, the final eval loss over seeds and its
paired difference from vanilla's; the differences between every pair of variants (or against a chosen
baseline) with an interval from the seeds; the downstream metrics; the plots and report.md.

A result is a finished run's result.json (vrl/experiments/grid.py).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from etils import epath

from vrl.experiments import analyze, curves, plots
from vrl.experiments.grid import BASELINE
from vrl.train.config import Config


def summarize(results: list[dict], variants: list[str]) -> list[dict]:
    """One row per variant; deltas pair each seed with vanilla's run of the same seed."""
    by_variant = {v: [r for r in results if r['variant'] == v] for v in variants}
    baseline = {r['seed']: r['eval_loss'] for r in by_variant.get(BASELINE, [])}
    rows = []
    for variant, runs in by_variant.items():
        loss, loss_spread = curves.mean_and_spread([r['eval_loss'] for r in runs])
        deltas = [r['eval_loss'] - baseline[r['seed']] for r in runs if r['seed'] in baseline]
        delta, delta_spread = curves.mean_and_spread(deltas) if deltas else (math.nan, math.nan)
        judgement = (
            curves.judge([r['eval_loss'] for r in runs], list(baseline.values()), deltas)
            if deltas and variant != BASELINE
            else ''
        )
        rows.append(
            {
                'variant': variant,
                'model': runs[0]['model'],
                'seeds': [r['seed'] for r in runs],
                'eval_loss': loss,
                'eval_loss_spread': loss_spread,
                'delta_vs_vanilla': delta,
                'delta_spread': delta_spread,
                'judgement': judgement,
                'params': runs[0]['params'],
                'kv_cache_bytes_per_token': runs[0]['kv_cache_bytes_per_token'],
                'tokens_per_sec': float(np.mean([r['tokens_per_sec'] for r in runs])),
                'downstream': _mean_downstream([r.get('downstream', {}) for r in runs]),
            }
        )
    return rows


def differences(results: list[dict], variants: list[str], baseline: str = '') -> list[dict]:
    """Final eval loss differences paired by seed (curves.Difference's fields, with 'a' and 'b' for a - b):
    every variant against `baseline`, or without one, every pair (a later variant minus an earlier one)."""
    losses = {v: {r['seed']: r['eval_loss'] for r in results if r['variant'] == v} for v in variants}
    if baseline:
        pairs = [(v, baseline) for v in variants if v != baseline]
    else:
        pairs = [(a, b) for i, b in enumerate(variants) for a in variants[i + 1 :]]
    rows = []
    for a, b in pairs:
        difference = curves.paired_difference(losses[a], losses[b])
        rows.append({'a': a, 'b': b, **dataclasses.asdict(difference), 'resolved': difference.resolved()})
    return rows


def shown(row: dict) -> str:
    """What a `differences` row shows, in words."""
    if row['seeds'] < 2:
        return 'not resolved (1 seed)'
    if not row['resolved']:
        return 'not resolved: the interval holds 0'
    return f'resolved: {row["a"] if row["mean"] < 0 else row["b"]} lower'


def _mean_downstream(per_run: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, tuple[float, float]]]:
    """{task: {metric: (mean, standard deviation) over the runs}} for the metrics every run has."""
    tasks = set.intersection(*(set(d) for d in per_run)) if per_run else set()
    return {
        task: {
            metric: curves.mean_and_spread([d[task][metric] for d in per_run])
            for metric in set.intersection(*(set(d[task]) for d in per_run))
        }
        for task in sorted(tasks)
    }


def _with_seed_band(variant: str, seeds: list[dict], color: int) -> plots.Line:
    """The mean of the seeds' curves ({step: value}) over the steps all have, labelled with the seed count,
    ± one standard deviation over seeds shaded (no band for one seed)."""
    steps = sorted(set.intersection(*(set(c) for c in seeds)), key=int)
    spread = [curves.mean_and_spread([c[s] for c in seeds]) for s in steps]
    mean = [m for m, _ in spread]
    band = ([m - d for m, d in spread], [m + d for m, d in spread]) if len(seeds) > 1 else None
    label = f'{variant} ({len(seeds)} seed{"s" * (len(seeds) > 1)})'
    return plots.Line(label, [int(s) for s in steps], mean, '-', color, band)


def write_plots(results: list[dict], variants: list[str], workdir: epath.Path) -> list[epath.Path]:
    by_variant = {v: [r for r in results if r['variant'] == v] for v in variants}
    eval_lines, relative_lines = [], []
    train_curves = {v: curves.mean_curve([r['train_loss'] for r in runs]) for v, runs in by_variant.items()}
    window = curves.smoothing_window(max(r['step'] for r in results))
    for color, (variant, runs) in enumerate(by_variant.items()):
        eval_lines.append(_with_seed_band(variant, [r['eval_curve'] for r in runs], color))
        if BASELINE in train_curves:
            steps, relative = curves.relative_loss(train_curves[variant], train_curves[BASELINE], window)
            relative_lines.append(plots.Line(variant, steps, relative, '-', color))
    written = [
        plots.line_plot(
            workdir / 'eval_loss.png',
            'Validation loss',
            'step',
            'eval loss (mean; shaded: ±1 s.d. of seeds)',
            eval_lines,
        )
    ]
    if relative_lines:
        written.append(
            plots.line_plot(
                workdir / 'relative_train_loss.png',
                f"Training loss minus vanilla's ({window}-step moving average)",
                'step',
                'relative training loss (mean over seeds)',
                relative_lines,
                markers=False,
            )
        )
    analysed = {v: [r['analysis'] for r in runs if r['analysis']] for v, runs in by_variant.items()}
    mean_analysis = {
        variant: {
            'variant': by_variant[variant][0]['model'],
            **{k: np.mean([a[k] for a in analyses], axis=0).tolist() for k in analyze.PLOTTED},
        }
        for variant, analyses in analysed.items()
        if analyses
    }
    figures = written + diagnostics_plots(by_variant, workdir) + downstream_plots(by_variant, workdir)
    return figures + (analyze.plot(mean_analysis, workdir) if mean_analysis else [])


_DIAGNOSTICS_PLOTS = {  # statistic -> (title, y label)
    'first_token_attention': ('Attention on the first token', 'mass (mean over seeds)'),
    'entropy': ('Attention entropy', 'entropy of key importance, nats (mean over seeds)'),
}


def diagnostics_plots(by_variant: dict[str, list[dict]], workdir: epath.Path, where: str = '') -> list[epath.Path]:
    """Training's diagnostics (train.diagnostics_every) of the middle layer over the steps, a chart
    per statistic with a line per variant (mean over its runs), in diagnostics_<statistic><where>.png;
    none when no run logged them."""
    logs = {v: [r['diagnostics'] for r in runs if r.get('diagnostics')] for v, runs in by_variant.items()}
    if not any(logs.values()):
        return []
    written = []
    for name, (title, ylabel) in _DIAGNOSTICS_PLOTS.items():
        lines = []
        for color, (variant, runs) in enumerate(logs.items()):
            if runs:
                middle = len(next(iter(runs[0].values()))[name]) // 2  # index i is layer i + 1
                curve = curves.mean_curve([{step: d[name][middle] for step, d in run.items()} for run in runs])
                lines.append(
                    plots.Line(f'{variant} (layer {middle + 1})', list(curve), list(curve.values()), '-', color)
                )
        written.append(
            plots.line_plot(
                workdir / f'diagnostics_{name}{where}.png',
                f'{title}, middle layer, over training{where.replace("_", ", ")}',
                'step',
                ylabel,
                lines,
            )
        )
    return written


def downstream_plots(by_variant: dict[str, list[dict]], workdir: epath.Path, where: str = '') -> list[epath.Path]:
    """Each downstream task's metric scored while training (train.downstream_tasks) over the steps, a
    chart per TASK/METRIC with a line per variant (mean over its runs, the seeds' spread shaded), in
    downstream_<task>_<metric><where>.png; none when no run scored any."""
    names = sorted({name for runs in by_variant.values() for r in runs for name in r.get('downstream_curves', {})})
    written = []
    for name in names:
        lines = []
        for color, (variant, runs) in enumerate(by_variant.items()):
            seeds = [r['downstream_curves'][name] for r in runs if name in r.get('downstream_curves', {})]
            if not seeds:
                continue
            lines.append(_with_seed_band(variant, seeds, color))
        file = 'downstream_' + ''.join(c if c.isalnum() or c in '-.' else '_' for c in name) + where + '.png'
        written.append(
            plots.line_plot(
                workdir / file,
                f'{name} while training{where.replace("_", ", ")}',
                'step',
                f'{name} (mean; shaded: ± one standard deviation over seeds)',
                lines,
            )
        )
    return written


def report(
    rows: list[dict], figures: list[epath.Path], base: Config, seeds: list[int], pairs: list[dict] | None = None
) -> str:
    """report.md: the table per variant, the `pairs` (`differences`) with what the seeds can show, the
    downstream table and the figures."""
    tokens = base.train.steps * base.data.batch_size * base.data.seq_len
    lines = [
        '# Variant comparison',
        '',
        f'{base.train.steps} steps x {base.data.batch_size} x {base.data.seq_len} tokens ({tokens:,} tokens) on '
        f'`{base.data.mixture or base.data.name}`, seeds {", ".join(map(str, seeds))}; {base.model.n_layers} '
        'layers, d_model '
        f'{base.model.d_model}; optimizer {base.optimizer.name} (peak LR {base.optimizer.peak_lr:g}, '
        f'{base.optimizer.schedule} schedule). Eval loss: mean ± standard deviation over seeds; the delta '
        'pairs each seed with '
        f"vanilla's run of the same seed. {curves.JUDGEMENT_RULE} Train tokens/s: the median of the logged "
        'rates on this machine as it was while the run trained (shared with whatever else ran), not a measure '
        "of the variant's speed; "
        '`python bench/train_throughput.py` measures that.',
        '',
        '| variant | model | final eval loss | Δ vs vanilla | judgement | params | KV cache B/token | train tokens/s |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for r in rows:
        delta = (
            '—'
            if math.isnan(r['delta_vs_vanilla'])
            else '+' * (r['delta_vs_vanilla'] >= 0) + curves.plus_minus(r['delta_vs_vanilla'], r['delta_spread'])
        )
        lines.append(
            f'| {r["variant"]} | {r["model"]} | {curves.plus_minus(r["eval_loss"], r["eval_loss_spread"])} | '
            f'{delta} | {r["judgement"] or "—"} | {r["params"]:,} | {r["kv_cache_bytes_per_token"]:,} | '
            f'{r["tokens_per_sec"]:,.0f} |'
        )
    if pairs:
        lines += [
            '',
            '## Differences between variants (final eval loss, paired by seed)',
            '',
            curves.what_seeds_show(min(p['seeds'] for p in pairs)),
            '',
            f'| difference | mean | s.d. of the per-seed differences | {curves.CONFIDENCE:.0%} interval | seeds | '
            'what it shows |',
            '|---|---|---|---|---|---|',
        ]
        for p in pairs:
            interval = '—' if p['seeds'] < 2 else f'[{p["low"]:+.4f}, {p["high"]:+.4f}]'
            spread = '—' if p['seeds'] < 2 else f'{p["spread"]:.4f}'
            lines.append(
                f'| {p["a"]} − {p["b"]} | {p["mean"]:+.4f} | {spread} | {interval} | {p["seeds"]} | {shown(p)} |'
            )
    columns = sorted({(task, metric) for r in rows for task, metrics in r['downstream'].items() for metric in metrics})
    if columns:
        lines += [
            '',
            '## Downstream tasks (lm-eval at the final step, mean ± standard deviation over seeds)',
            '',
            '| variant | ' + ' | '.join(f'{task} {metric}' for task, metric in columns) + ' |',
            '|---|' + '---|' * len(columns),
        ]
        for r in rows:
            lines.append(
                f'| {r["variant"]} | '
                + ' | '.join(
                    curves.plus_minus(*r['downstream'][t][m]) if m in r['downstream'].get(t, {}) else '—'
                    for t, m in columns
                )
                + ' |'
            )
    lines += ['', '## Figures', ''] + [f'![{f.stem}]({f.name})' for f in figures]
    return '\n'.join(lines) + '\n'
