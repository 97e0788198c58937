"""Line plots for the analysis and comparison commands (matplotlib, from requirements-extra.txt)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import NamedTuple, Sequence

from vrl.core.errors import VrlError


class PlotError(VrlError, RuntimeError):
    """matplotlib is missing; the message says which requirements file brings it."""


class Line(NamedTuple):
    label: str | None  # legend entry; None = no entry (e.g. the dashed twin of a solid line)
    x: Sequence[float]
    y: Sequence[float]
    style: str  # '-' solid, '--' dashed
    color: int  # index into the colour cycle: one colour per run or variant
    band: tuple[Sequence[float], Sequence[float]] | None = None  # (low, high) at each x, shaded: e.g. the seeds' spread


def line_plot(
    path: Path, title: str, xlabel: str, ylabel: str, lines: list[Line], markers: bool = True, log: str = ''
) -> Path:
    """Writes a PNG of `lines` to path and returns path; `log` names the axes on a log scale ('x', 'y', 'xy')."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError('plots need matplotlib: pip install -r requirements-extra.txt') from None
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for line in lines:  # a style with its own marker ('o': points only) keeps it
        ax.plot(
            line.x,
            line.y,
            line.style,
            color=colors[line.color % len(colors)],
            label=line.label,
            markersize=3,
            **({'marker': 'o'} if markers else {}),
        )
        if line.band is not None:
            ax.fill_between(line.x, *line.band, color=colors[line.color % len(colors)], alpha=0.2, linewidth=0)
    ax.set(
        title=title,
        xlabel=xlabel,
        ylabel=ylabel,
        xscale='log' if 'x' in log else 'linear',
        yscale='log' if 'y' in log else 'linear',
    )
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f'{value:g}')
    for axis in [a for name, a in (('x', ax.xaxis), ('y', ax.yaxis)) if name in log]:
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain)
    ax.grid(alpha=0.3)
    if any(line.label for line in lines):
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format='png', dpi=120)
    plt.close(fig)
    path.write_bytes(png.getvalue())  # a local path or an object-store one (vrl/core/storage.py)
    return path
