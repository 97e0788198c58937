"""What a study's results say (vrl.experiments.study): the best LR per point, loss-vs-parameters fits, parameters
and data saved against vanilla, the critical step; written as study.md and PNGs.

A result is a finished run's result.json (vrl/experiments/grid.py): its variant, coordinates['size'], seq_len,
peak_lr, seed, final eval_loss, eval_curve and train_loss by step, non_embedding_params, and
tokens_per_step. Every statistic pairs each variant at its own best LR with vanilla at vanilla's.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from typing import Any

import numpy as np
from etils import epath

from vrl.experiments import compare_report, curves, plots, scaling
from vrl.experiments.grid import BASELINE, GridError
from vrl.model.config import ModelConfig

_STYLES = ('-', '--', ':', '-.')


@dataclasses.dataclass(frozen=True)
class Axes:
    """A study's grid, as the user gave it (sizes by name)."""

    variants: list[str]
    sizes: list[str]
    lrs: list[float]
    seeds: list[int]
    seq_lens: list[int]
    budget: str = 'steps'
    fit_metric: str = 'eval_loss'  # or 'TASK/METRIC', a score of train.downstream_tasks at the final step


class Points:
    """The results by (variant, size, seq_len, lr), and which LR is best at each (variant, size, seq_len)."""

    def __init__(self, results: list[dict], axes: Axes):
        self.axes = axes
        self._runs: dict[tuple, list[dict]] = defaultdict(list)
        for r in results:
            self._runs[(r['variant'], r['coordinates']['size'], r['seq_len'], r['peak_lr'])].append(r)
        self.lr_rows = {}
        for variant, size, seq_len in itertools.product(axes.variants, axes.sizes, axes.seq_lens):
            losses = {
                lr: curves.mean_and_spread([r['eval_loss'] for r in self._runs[(variant, size, seq_len, lr)]])
                for lr in sorted(axes.lrs)
            }
            best = min(losses, key=lambda lr: losses[lr][0])
            self.lr_rows[(variant, size, seq_len)] = {
                'variant': variant,
                'size': size,
                'seq_len': seq_len,
                'lr': best,
                'losses': losses,
                'at_edge': len(losses) > 1 and best in (min(losses), max(losses)),
            }

    def at_best(self, variant: str, size: str, seq_len: int) -> list[dict]:
        """The seeds' runs of the point at its best LR."""
        return self._runs[(variant, size, seq_len, self.lr_rows[(variant, size, seq_len)]['lr'])]

    def mean_curve(self, name: str, variant: str, size: str, seq_len: int) -> dict[int, float]:
        """'eval_curve' or 'train_loss' at the best LR, mean over seeds."""
        return curves.mean_curve([r[name] for r in self.at_best(variant, size, seq_len)])

    def others(self) -> list[str]:
        return [v for v in self.axes.variants if v != BASELINE]

    def fitted(self, run: dict) -> float:
        """What the size fits are of, for one run: its final eval loss, or for a downstream score
        (axes.fit_metric 'TASK/METRIC') the score where lower is better, else its error 1 - score."""
        if self.axes.fit_metric == 'eval_loss':
            return run['eval_loss']
        task, metric = self.axes.fit_metric.split('/', 1)
        score = run.get('downstream', {}).get(task, {}).get(metric)
        if score is None:
            raise GridError(
                f'--fit_metric={self.axes.fit_metric}: run {run["variant"]} {run["coordinates"]} seed '
                f'{run["seed"]} has no such final score (it has: {", ".join(_scores(run)) or "none"}); '
                'score the task while training with --config.train.downstream_tasks.'
            )
        return score if lower_is_better(metric) else 1.0 - score

    def fitted_label(self) -> str:
        if self.axes.fit_metric == 'eval_loss':
            return 'eval loss'
        metric = self.axes.fit_metric.split('/', 1)[1]
        return self.axes.fit_metric if lower_is_better(metric) else f'1 - {self.axes.fit_metric}'


def _scores(run: dict) -> list[str]:
    return [f'{task}/{metric}' for task, metrics in run.get('downstream', {}).items() for metric in metrics]


def lower_is_better(metric: str) -> bool:
    """lm-eval's registry's word on a metric ('acc_norm'; of 'subtask/acc', the part after the '/'; of
    'acc_FILTER', 'acc'); GridError for a metric the registry does not know."""
    import lm_eval.api.metrics  # noqa: F401 - registers lm-eval's metrics (requirements-extra.txt)
    from lm_eval.api.registry import HIGHER_IS_BETTER_REGISTRY

    name = metric.rsplit('/', 1)[-1]
    for known in (name, name.rsplit('_', 1)[0]):
        if known in HIGHER_IS_BETTER_REGISTRY:
            return not HIGHER_IS_BETTER_REGISTRY[known]
    raise GridError(
        f'--fit_metric: lm-eval does not say whether a higher {name!r} is better; fit one of its '
        f'metrics ({", ".join(sorted(HIGHER_IS_BETTER_REGISTRY))}).'
    )


def fits(points: Points, seq_len: int) -> dict[str, Any]:
    """Per variant, the power law over sizes at each size's best LR, and the parameters each variant
    saves against vanilla at equal loss at every vanilla size, with a bootstrap interval over seeds."""
    per_seed, params = {}, {}
    out = {'seq_len': seq_len, 'of': points.fitted_label(), 'variants': {}, 'params_saved': {}}
    for variant in points.axes.variants:
        runs = [points.at_best(variant, size, seq_len) for size in points.axes.sizes]
        params[variant] = [r[0]['non_embedding_params'] for r in runs]
        per_seed[variant] = [[points.fitted(x) for x in r] for r in runs]
        points_of = {'params': params[variant], 'values': [float(np.mean(s)) for s in per_seed[variant]]}
        try:
            law = scaling.fit_power_law(points_of['params'], points_of['values'])
            out['variants'][variant] = {'a': law.a, 'alpha': law.alpha, **points_of, 'residuals': law.residuals}
        except scaling.FitError as e:
            out['variants'][variant] = {'error': str(e), **points_of}
    laws = {v: scaling.PowerLaw(f['a'], f['alpha'], ()) for v, f in out['variants'].items() if 'a' in f}
    if BASELINE not in laws:
        return out
    for variant in [v for v in points.others() if v in laws]:
        rows = []
        for at in params[BASELINE]:
            try:
                interval = scaling.bootstrap_params_saved(
                    per_seed[variant], per_seed[BASELINE], params[variant], params[BASELINE], at
                )
            except scaling.FitError:
                interval = (math.nan, math.nan)
            saved = scaling.params_saved(laws[variant], laws[BASELINE], at)
            needed = at * (1 - saved)  # the variant's parameters at vanilla's loss
            rows.append(
                {
                    'vanilla_params': at,
                    'saved': saved,
                    'interval': interval,
                    'extrapolated': not min(params[variant]) <= needed <= max(params[variant]),
                }
            )
        out['params_saved'][variant] = rows
    return out


def data_saved(points: Points, seq_len: int) -> dict[str, dict[str, Any]]:
    """Per size and variant: the tokens it needs to reach vanilla's final eval loss, interpolated
    between evals, as a fraction saved, for the mean curves and seed by seed (each against vanilla's
    same seed). None where it does not get there within the budget."""
    out: dict[str, dict[str, Any]] = {}
    for size in points.axes.sizes if BASELINE in points.axes.variants else []:
        baseline = {r['seed']: r for r in points.at_best(BASELINE, size, seq_len)}
        steps = max(r['step'] for r in baseline.values())
        target = float(np.mean([r['eval_loss'] for r in baseline.values()]))
        out[size] = {}
        for variant in points.others():
            runs = points.at_best(variant, size, seq_len)
            mean = curves.step_to_reach(points.mean_curve('eval_curve', variant, size, seq_len), target)
            per_seed = [
                curves.step_to_reach({int(k): v for k, v in r['eval_curve'].items()}, baseline[r['seed']]['eval_loss'])
                for r in runs
                if r['seed'] in baseline
            ]
            out[size][variant] = {
                'target': target,
                'vanilla_tokens': steps * runs[0]['tokens_per_step'],
                'tokens': None if mean is None else mean * runs[0]['tokens_per_step'],
                'saved': None if mean is None else 1 - mean / steps,
                'saved_per_seed': [None if s is None else 1 - s / steps for s in per_seed],
            }
    return out


def critical_steps(points: Points) -> dict[str, dict[str, dict[str, Any]]]:
    """Per size, seq_len and variant: where vanilla's smoothed training loss overtakes the variant's for
    good (curves.critical_step), on the mean curves over seeds."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    if BASELINE not in points.axes.variants:
        return out
    for size, seq_len in itertools.product(points.axes.sizes, points.axes.seq_lens):
        first = points.at_best(BASELINE, size, seq_len)[0]
        window = curves.smoothing_window(first['step'])
        baseline = points.mean_curve('train_loss', BASELINE, size, seq_len)
        row = {}
        for variant in points.others():
            crossing = curves.critical_step(points.mean_curve('train_loss', variant, size, seq_len), baseline, window)
            row[variant] = {
                'step': crossing.step,
                'variant_led': crossing.variant_led,
                'window': window,
                'describe': crossing.describe(),
                'tokens': None if crossing.step is None else crossing.step * first['tokens_per_step'],
            }
        out.setdefault(size, {})[str(seq_len)] = row
    return out


def summarize(points: Points, fit_seq_len: int) -> dict[str, Any]:
    """Everything study.md reports, as results.json stores it."""
    return {
        'best_lr': list(points.lr_rows.values()),
        'fits': fits(points, fit_seq_len),
        'data_saved': data_saved(points, fit_seq_len),
        'critical_steps': critical_steps(points),
    }


# --- figures ---


def write_plots(points: Points, summary: dict, folder: epath.Path) -> list[epath.Path]:
    axes, fit = points.axes, summary['fits']
    color = {v: i for i, v in enumerate(axes.variants)}
    written = []
    lines = []
    for variant, f in fit['variants'].items():
        lines.append(plots.Line(variant, f['params'], f['values'], 'o', color[variant]))
        if 'a' in f:
            n = np.geomspace(min(f['params']), max(f['params']), 32)
            lines.append(plots.Line(None, n, scaling.PowerLaw(f['a'], f['alpha'], ()).loss(n), '-', color[variant]))
    written.append(
        plots.line_plot(
            folder / 'loss_vs_params.png',
            f"Final {fit['of']} at each size's best LR (lines: power-law fits)",
            'non-embedding parameters',
            fit['of'],
            lines,
            markers=False,
            log='xy',
        )
    )
    lines = []
    for row in (r for r in summary['best_lr'] if r['seq_len'] == fit['seq_len']):
        lrs = sorted(row['losses'])
        lines.append(
            plots.Line(
                f'{row["variant"]} {row["size"]}',
                lrs,
                [row['losses'][lr][0] for lr in lrs],
                _STYLES[axes.sizes.index(row['size']) % len(_STYLES)],
                color[row['variant']],
            )
        )
    written.append(
        plots.line_plot(
            folder / 'loss_vs_lr.png',
            'Final eval loss vs peak LR (mean over seeds)',
            'peak LR',
            'eval loss',
            lines,
            log='x',
        )
    )
    for size in axes.sizes if BASELINE in axes.variants else []:
        written.append(_tokens_to_target(points, size, fit['seq_len'], color, folder))
        written.append(_relative_train_loss(points, size, color, folder))
    for size in axes.sizes:  # each variant at its best LR
        at_best = {variant: points.at_best(variant, size, fit['seq_len']) for variant in axes.variants}
        written += compare_report.diagnostics_plots(at_best, folder, f'_{size}')
        written += compare_report.downstream_plots(at_best, folder, f'_{size}')
    return written


def _tokens_to_target(points: Points, size: str, seq_len: int, color: dict[str, int], folder: epath.Path) -> epath.Path:
    lines = []
    for variant in points.axes.variants:
        curve = points.mean_curve('eval_curve', variant, size, seq_len)
        tokens = [s * points.at_best(variant, size, seq_len)[0]['tokens_per_step'] for s in curve]
        lines.append(plots.Line(variant, tokens, list(curve.values()), '-', color[variant]))
    target = float(np.mean([r['eval_loss'] for r in points.at_best(BASELINE, size, seq_len)]))
    lines.append(
        plots.Line("vanilla's final loss", [lines[0].x[0], lines[0].x[-1]], [target, target], ':', color[BASELINE])
    )
    return plots.line_plot(
        folder / f'tokens_to_target_{size}.png',
        f'Eval loss vs tokens, {size} (each variant at its best LR)',
        'training tokens',
        'eval loss (mean over seeds)',
        lines,
    )


def _relative_train_loss(points: Points, size: str, color: dict[str, int], folder: epath.Path) -> epath.Path:
    lines, windows = [], set()
    for i, seq_len in enumerate(points.axes.seq_lens):
        window = curves.smoothing_window(points.at_best(BASELINE, size, seq_len)[0]['step'])
        windows.add(window)
        baseline = points.mean_curve('train_loss', BASELINE, size, seq_len)
        for variant in points.others():
            steps, relative = curves.relative_loss(
                points.mean_curve('train_loss', variant, size, seq_len), baseline, window
            )
            lines.append(
                plots.Line(f'{variant} L={seq_len}', steps, relative, _STYLES[i % len(_STYLES)], color[variant])
            )
    return plots.line_plot(
        folder / f'relative_train_loss_{size}.png',
        f"Training loss minus vanilla's, {size} ({'/'.join(map(str, sorted(windows)))}-step moving average)",
        'step',
        'relative training loss (mean over seeds)',
        lines,
        markers=False,
    )


# --- study.md ---


def _loss(mean: float, spread: float) -> str:
    return f'{mean:.4f}' if math.isnan(spread) else curves.plus_minus(mean, spread)


def _percent(value: float | None) -> str:
    return '—' if value is None or math.isnan(value) else f'{100 * value:+.1f}%'


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)] + ['| ' + ' | '.join(r) + ' |' for r in rows]


def report(points: Points, summary: dict, shapes: dict[str, ModelConfig], intro: str, figures: list[epath.Path]) -> str:
    """study.md: `intro` (what was run), then one section per claim; `shapes` maps each size to its model."""
    axes = points.axes
    seeds = len(axes.seeds)
    lines = [
        '# Study',
        '',
        intro
        + ' Losses are final eval losses, '
        + ('mean ± standard deviation over seeds.' if seeds > 1 else 'of one seed (no spread, no interval).'),
        '',
    ]
    lines += ['## Sizes', ''] + _table(
        ['size', 'layers', 'd_model', 'heads', 'd_ff', 'steps'] + [f'{v} non-emb params' for v in axes.variants],
        [
            [
                size,
                str(shapes[size].n_layers),
                str(shapes[size].d_model),
                str(shapes[size].n_heads),
                str(shapes[size].d_ff),
                str(points.at_best(axes.variants[0], size, axes.seq_lens[0])[0]['step']),
            ]
            + [f'{points.at_best(v, size, axes.seq_lens[0])[0]["non_embedding_params"]:,}' for v in axes.variants]
            for size in axes.sizes
        ],
    )
    lines += ['', '## Learning rate', '']
    for seq_len in axes.seq_lens:
        rows = []
        for row in (r for r in summary['best_lr'] if r['seq_len'] == seq_len):
            cells = [
                f'**{_loss(*row["losses"][lr])}**' if lr == row['lr'] else _loss(*row['losses'][lr])
                for lr in sorted(row['losses'])
            ]
            edge = ' ⚠ at the edge of the sweep: the optimum is not bracketed' if row['at_edge'] else ''
            rows.append([row['variant'], row['size'], *cells, f'{row["lr"]:g}{edge}'])
        lines += (
            [f'seq_len {seq_len}:', '']
            + _table(['variant', 'size'] + [f'LR {lr:g}' for lr in sorted(axes.lrs)] + ['best LR'], rows)
            + ['']
        )
    lines += _against_baseline_section(points)
    lines += _fit_section(summary['fits'], axes)
    lines += _downstream_section(points, summary['fits']['seq_len'])
    lines += ['', '## Data saved', '']
    if summary['data_saved']:
        lines += [
            "Tokens each variant needs to reach vanilla's final eval loss, interpolated between evals; "
            "saved = 1 - tokens / vanilla's tokens (seed by seed in brackets).",
            '',
        ] + _table(
            ['size', 'variant', "vanilla's final loss", 'tokens', 'saved'],
            [
                [
                    size,
                    variant,
                    f'{d["target"]:.4f}',
                    'not within the budget' if d['tokens'] is None else f'{d["tokens"]:,.0f}',
                    f'{_percent(d["saved"])} [' + ', '.join(_percent(s) for s in d['saved_per_seed']) + ']',
                ]
                for size, row in summary['data_saved'].items()
                for variant, d in row.items()
            ],
        )
    else:
        lines.append('Needs vanilla among --variants.')
    lines += ['', '## The critical step', '']
    if summary['critical_steps']:
        lines += [
            "The first step after which vanilla's smoothed training loss stays below the variant's (mean "
            'curves over seeds; window: the moving average, in steps).',
            '',
        ] + _table(
            ['size', 'seq_len', 'variant', 'critical step', 'tokens', 'window'],
            [
                [
                    size,
                    seq_len,
                    variant,
                    c['describe'],
                    '—' if c['tokens'] is None else f'{c["tokens"]:,}',
                    str(c['window']),
                ]
                for size, by_len in summary['critical_steps'].items()
                for seq_len, row in by_len.items()
                for variant, c in row.items()
            ],
        )
    else:
        lines.append('Needs vanilla among --variants.')
    lines += ['', '## Figures', ''] + [f'![{f.stem}]({f.name})' for f in figures]
    return '\n'.join(lines) + '\n'


def _against_baseline_section(points: Points) -> list[str]:
    """Each variant's final eval loss minus vanilla's, each at its best LR, paired by seed, and whether the
    difference is a finding (curves.judge); [] without vanilla among the variants."""
    axes = points.axes
    if BASELINE not in axes.variants or not points.others():
        return []
    rows = []
    for size, seq_len, variant in itertools.product(axes.sizes, axes.seq_lens, points.others()):
        mine = {r['seed']: r['eval_loss'] for r in points.at_best(variant, size, seq_len)}
        theirs = {r['seed']: r['eval_loss'] for r in points.at_best(BASELINE, size, seq_len)}
        deltas = [mine[seed] - theirs[seed] for seed in sorted(mine) if seed in theirs]
        if deltas:
            mean, spread = curves.mean_and_spread(deltas)
            judged = curves.judge(list(mine.values()), list(theirs.values()), deltas)
            rows.append(
                [
                    size,
                    str(seq_len),
                    variant,
                    f'{mean:+.4f}' + ('' if math.isnan(spread) else f' ± {spread:.4f}'),
                    judged,
                ]
            )
    return (
        [
            '## Against vanilla',
            '',
            f"Final eval loss minus vanilla's, each at its best LR, paired by seed. {curves.JUDGEMENT_RULE}",
            '',
        ]
        + _table(['size', 'seq_len', 'variant', 'Δ eval loss', 'judgement'], rows)
        + ['']
    )


def _fit_section(fit: dict, axes: Axes) -> list[str]:
    note = (
        ' With two sizes the line passes through both points, so the residuals say nothing.'
        if len(axes.sizes) == 2
        else ''
    )
    lines = [
        '## Loss vs parameters' if fit['of'] == 'eval loss' else f'## {fit["of"]} vs parameters',
        '',
        f'L(N) = a · N^(-alpha) of the final {fit["of"]} over the sizes, N = non-embedding parameters, each size '
        f'at its best LR by eval loss (seq_len {fit["seq_len"]}); residual = measured minus fitted.{note}',
        '',
    ]
    lines += _table(
        ['variant', 'a', 'alpha', 'residuals'],
        [
            [variant, '—', '—', f'no fit: {f["error"]}']
            if 'error' in f
            else [variant, f'{f["a"]:.4g}', f'{f["alpha"]:.4f}', ', '.join(f'{x:+.4f}' for x in f['residuals'])]
            for variant, f in fit['variants'].items()
        ],
    )
    if fit['params_saved']:
        at = [r['vanilla_params'] for r in next(iter(fit['params_saved'].values()))]
        interval = len(axes.seeds) > 1
        lines += [
            '',
            f'Parameters saved at equal {fit["of"]} against vanilla: 1 - N_variant / N_vanilla, where the '
            f"variant's fit reaches the {fit['of']} vanilla's fit has at N_vanilla"
            + ('; 95% bootstrap interval over seeds in brackets.' if interval else '.'),
            '',
        ]
        lines += _table(
            ['variant'] + [f'at N_vanilla = {n:,}' for n in at],
            [
                [variant]
                + [
                    _percent(r['saved'])
                    + (f' [{_percent(r["interval"][0])}, {_percent(r["interval"][1])}]' if interval else '')
                    + (' †' if r['extrapolated'] else '')
                    for r in rows
                ]
                for variant, rows in fit['params_saved'].items()
            ],
        )
        if any(r['extrapolated'] for rows in fit['params_saved'].values() for r in rows):
            lines += [
                '',
                "† The equal-loss size lies outside the variant's measured sizes: the fit is extrapolated "
                'there, and the figure is not a measurement.',
            ]
    elif BASELINE not in axes.variants:
        lines += ['', 'Parameters saved: needs vanilla among --variants.']
    return lines


def _downstream_section(points: Points, seq_len: int) -> list[str]:
    """The downstream scores at the final step (train.downstream_tasks, or compare's --tasks), each
    variant at its best LR, mean ± standard deviation over seeds; nothing when no run has any."""
    axes = points.axes
    names = sorted(
        {
            name
            for variant, size in itertools.product(axes.variants, axes.sizes)
            for r in points.at_best(variant, size, seq_len)
            for name in _scores(r)
        }
    )
    if not names:
        return []
    rows = []
    for size, variant in itertools.product(axes.sizes, axes.variants):
        runs = points.at_best(variant, size, seq_len)
        cells = []
        for name in names:
            task, metric = name.split('/', 1)
            values = [r['downstream'][task][metric] for r in runs if metric in r.get('downstream', {}).get(task, {})]
            cells.append(_loss(*curves.mean_and_spread(values)) if values else '—')
        rows.append([size, variant, *cells])
    return [
        '',
        '## Downstream tasks',
        '',
        f'lm-eval scores at the final step, each variant at its best LR (seq_len '
        f'{seq_len}); the curves over training are the downstream_*.png figures.',
        '',
    ] + _table(['size', 'variant', *names], rows)
