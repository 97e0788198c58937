"""The docs' result tables, made from ledgers (vrl/experiments/ledger.py): tables are code, results are data.

    python -m vrl.experiments.tables [--pages=README.md,docs/*.md] [--check]

A table in a Markdown page is the text between a marker naming its ledger (relative to the directory
the command runs in: the repository's root) and an end marker:

    <!-- table lr_sweep: docs/scaling/family.results.jsonl cost=docs/scaling/family.cost.jsonl -->
    ...
    <!-- end table -->

The command rewrites every such table from its ledger; `--check` changes nothing and exits 1 naming
each table that differs from what its ledger makes (tests/test_docs.py runs it on the docs).

`lr_sweep`: a row per variant (in the ledger's order, vanilla first), the final eval loss at each peak
LR as mean ± standard deviation over seeds (the best LR in bold), the gap to vanilla at each one's best
LR with the larger of the two spreads (a variant whose sweep is not whole yet: which LRs are still to run,
and no best), and the tokens each needs to reach vanilla's final loss (saved, with
each seed's against vanilla's same seed), as study.md computes them (vrl/experiments/study_report.py);
with `cost=FILE` (the rows `bench/train_throughput.py --json FILE` wrote), each variant's step time against
vanilla's and its memory at that benchmark's shape, and a line saying where and when it ran.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from absl import flags

from vrl.core import cli
from vrl.core.errors import VrlError
from vrl.experiments import curves, ledger, study_report
from vrl.experiments.grid import BASELINE

MARKER = re.compile(r'<!-- table (\w+): (\S+?)(?: cost=(\S+))? -->\n(.*?)<!-- end table -->', re.S)


class TableError(VrlError, ValueError):
    """A table marker that names no kind or no ledger; the message says which."""


def lr_sweep(rows: list[dict], cost: list[dict] | None = None) -> str:
    """The `lr_sweep` table of ledger rows, with the step cost of bench/train_throughput.py's rows (module
    docstring)."""
    variants = sorted(dict.fromkeys(r['variant'] for r in rows), key=lambda v: v != BASELINE)
    axes = study_report.Axes(
        variants,
        sorted({r['coordinates']['size'] for r in rows}),
        sorted({r['peak_lr'] for r in rows}),
        sorted({r['seed'] for r in rows}),
        sorted({r['seq_len'] for r in rows}),
    )
    if len(axes.sizes) > 1 or len(axes.seq_lens) > 1:
        raise TableError(f'lr_sweep is of one size and one seq_len; the ledger has {axes.sizes} x {axes.seq_lens}')
    size, seq_len = axes.sizes[0], axes.seq_lens[0]
    points = study_report.Points(rows, axes)
    saved = study_report.data_saved(points, seq_len).get(size, {})
    best = {v: points.lr_rows[(v, size, seq_len)] for v in variants}
    present = {(r['variant'], r['peak_lr']) for r in rows}
    header = ['variant', *(f'LR {lr:g}' for lr in axes.lrs), 'gap to vanilla at its best LR', 'tokens saved']
    costs = {row['variant']: row for row in cost or []}
    if cost:
        header += [f'{cost[0]["config"]} step vs vanilla', 'GiB']
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    for variant in variants:
        point = best[variant]
        cells, missing = [], [lr for lr in axes.lrs if (variant, lr) not in present]
        for lr in axes.lrs:
            text = '—' if lr in missing else curves.plus_minus(*point['losses'][lr])
            cells.append(f'**{text}**' if lr == point['lr'] and not missing else text)
        gap, tokens = '—', '—'
        if missing:  # a grid still running: no best LR until the sweep is whole
            gap = f'not yet: LR {", ".join(f"{lr:g}" for lr in missing)} to run'
        elif variant != BASELINE and BASELINE in best:
            mine, theirs = point['losses'][point['lr']], best[BASELINE]['losses'][best[BASELINE]['lr']]
            gap = f'{mine[0] - theirs[0]:+.3f} (spread {max(mine[1], theirs[1]):.3f})'
            found = saved.get(variant, {})
            if found.get('saved') is not None:
                seeds = ', '.join('—' if s is None else f'{s:+.1%}' for s in found['saved_per_seed'])
                tokens = f'{found["saved"]:+.1%} [{seeds}]'
            elif found:
                tokens = 'does not reach it'
        row = [variant, *cells, gap, tokens]
        if cost:
            measured = costs.get(variant)
            row += [measured['vs_vanilla'], f'{measured["gib"]:.2f}'] if measured else ['—', '—']
        lines.append('| ' + ' | '.join(row) + ' |')
    seeds = ', '.join(map(str, axes.seeds))
    run = f'{len(rows)} runs; {rows[0]["step"]} steps at {size}, seq_len {seq_len}'
    text = '\n'.join(lines) + f'\n\nSeeds {seeds}; {run}.'
    if cost:
        first, vanilla = cost[0], costs.get(BASELINE)
        text += (
            f' Step cost: bench/train_throughput.py at {first["config"]}, {first["batch"]} x {first["seq_len"]} '
            f'tokens, {first["dtype"]}, on {first["machine"]}, {first["date"]}'
            + (f' (vanilla {vanilla["step_seconds"]:.3f} s a step)' if vanilla else '')
            + '.'
        )
    return text + '\n'


KINDS = {'lr_sweep': lr_sweep}


def remade(page: str, root: Path) -> tuple[str, list[str]]:
    """`page` with every marked table made again from its ledger (paths from `root`), and the ledgers of
    the tables that changed."""
    changed: list[str] = []

    def make(match: re.Match) -> str:
        kind, path, cost_path, old = match.groups()
        if kind not in KINDS:
            raise TableError(f'table kind {kind!r} is unknown: allowed {", ".join(KINDS)}')
        rows = list(ledger.read(root / path).values())
        if not rows:
            raise TableError(f'the ledger {root / path} of a table is missing or empty')
        cost = None
        if cost_path:
            if not (root / cost_path).is_file():
                raise TableError(
                    f'the step costs {root / cost_path} of a table are missing: make them with '
                    f'python bench/train_throughput.py --json {cost_path}'
                )
            cost = [json.loads(line) for line in (root / cost_path).read_text().splitlines() if line.strip()]
        new = KINDS[kind](rows, cost)
        if new != old:
            changed.append(path)
        marker = f'{path} cost={cost_path}' if cost_path else path
        return f'<!-- table {kind}: {marker} -->\n{new}<!-- end table -->'

    return MARKER.sub(make, page), changed


def _define_flags() -> dict:
    return {
        'pages': flags.DEFINE_list(
            'pages', ['README.md', 'docs/*.md'], 'The Markdown pages (globs) whose tables to remake.'
        ),
        'check': flags.DEFINE_bool('check', False, 'Change nothing: exit 1 naming each table its ledger changes.'),
    }


def main(args: cli.Args) -> None:
    root, stale = Path.cwd(), []
    pages = sorted({page for pattern in args['pages'].value for page in root.glob(pattern)})
    for page in pages:
        text, changed = remade(page.read_text(), root)
        if args['check'].value:
            stale += [f'{page}: the table of {path} differs from what its ledger makes' for path in changed]
        elif changed:
            page.write_text(text)
            print(f'{page}: {len(changed)} table(s) remade from {", ".join(changed)}')
    if stale:
        sys.exit('\n'.join(stale) + '\nRemake them: python -m vrl.experiments.tables')


def cli_main() -> None:
    """`python -m vrl.experiments.tables`: the docs' tables from their ledgers."""
    cli.run(main, _define_flags)


if __name__ == '__main__':
    cli_main()
