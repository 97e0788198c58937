"""Statistics of loss curves that the comparison and the study report.

A curve is {step: loss}. Training-loss curves are compared after a trailing moving average (the
paper's "relative training loss"); eval curves are read by linear interpolation between evals.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

MAX_SMOOTHING_STEPS = 100  # the paper's moving average


def smoothing_window(steps: int) -> int:
    """The moving-average window for a run of `steps`: the paper's 100 steps, at most a tenth of the run."""
    return max(1, min(MAX_SMOOTHING_STEPS, steps // 10))


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over the last `window` values (fewer at the start), same length as values."""
    cumulative = np.concatenate([[0.0], np.cumsum(np.asarray(values, np.float64))])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def relative_loss(curve: dict[int, float], baseline: dict[int, float], window: int) -> tuple[list[int], np.ndarray]:
    """(steps, moving-average(curve) - moving-average(baseline)) over the steps both have."""
    steps = sorted(set(curve) & set(baseline))
    return steps, (
        moving_average([curve[s] for s in steps], window) - moving_average([baseline[s] for s in steps], window)
    )


def mean_and_spread(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN for one value: no spread is known; both NaN for none, a grid
    point not run yet)."""
    if not len(values):
        return math.nan, math.nan
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else math.nan


def plus_minus(mean: float, spread: float, digits: int = 4) -> str:
    """'3.1234 ± 0.0100', or '3.1234 (1 seed)' where no spread is known."""
    return f'{mean:.{digits}f} (1 seed)' if math.isnan(spread) else f'{mean:.{digits}f} ± {spread:.{digits}f}'


JUDGEMENT_RULE = (
    'A difference counts as a finding only where it exceeds the seed-to-seed spread: the larger of the '
    "two variants' standard deviations of the final loss over seeds and the standard deviation of the "
    'seed-paired differences; with one seed no spread is known, and nothing is a finding.'
)


def judge(variant_losses: Sequence[float], baseline_losses: Sequence[float], deltas: Sequence[float]) -> str:
    """Whether the mean of `deltas` (a variant's loss minus the baseline's, paired by seed) is a finding
    by JUDGEMENT_RULE, and how many seeds it rests on: e.g. 'exceeds the spread 0.0123 (3 seeds)'."""
    seeds = f'{len(deltas)} seed{"s" * (len(deltas) != 1)}'
    if len(deltas) < 2 or len(variant_losses) < 2 or len(baseline_losses) < 2:
        return f'no spread known ({seeds}): not a finding'
    spread = max(mean_and_spread(v)[1] for v in (variant_losses, baseline_losses, deltas))
    size = abs(float(np.mean(deltas)))
    verdict = 'exceeds' if size > spread else 'within'
    return f'{verdict} the spread {spread:.4f} ({seeds})' + ('' if size > spread else ': not a finding')


CONFIDENCE = 0.95  # of the intervals on paired differences


@dataclasses.dataclass(frozen=True)
class Difference:
    """One variant's final loss minus another's, paired by seed: the mean over the seeds both have, the
    standard deviation of the per-seed differences, and the CONFIDENCE interval of the mean (Student's t
    with seeds - 1 degrees of freedom; none from one seed)."""

    mean: float
    spread: float
    seeds: int
    low: float
    high: float

    def resolved(self) -> bool:
        """Whether the interval excludes 0: the sign of the difference is shown at this confidence."""
        return self.seeds > 1 and (self.low > 0 or self.high < 0)

    def describe(self) -> str:
        if self.seeds < 2:
            return f'{self.mean:+.4f} (1 seed: no interval)'
        return f'{self.mean:+.4f}, {CONFIDENCE:.0%} interval [{self.low:+.4f}, {self.high:+.4f}] ({self.seeds} seeds)'


def paired_difference(losses: dict[int, float], baseline: dict[int, float]) -> Difference:
    """`losses` minus `baseline` ({seed: final loss} each) over the seeds both have (Difference)."""
    deltas = [losses[s] - baseline[s] for s in sorted(set(losses) & set(baseline))]
    if not deltas:
        return Difference(math.nan, math.nan, 0, math.nan, math.nan)
    mean, spread = mean_and_spread(deltas)
    if len(deltas) < 2:
        return Difference(mean, spread, 1, math.nan, math.nan)
    half = interval_factor(len(deltas)) * spread
    return Difference(mean, spread, len(deltas), mean - half, mean + half)


def interval_factor(seeds: int) -> float:
    """The CONFIDENCE interval's half-width over `seeds` paired differences, in units of their standard
    deviation: t_{(1 + CONFIDENCE) / 2, seeds - 1} / sqrt(seeds) (8.98 at 2 seeds, 2.48 at 3, 1.24 at 5)."""
    import scipy.stats  # jax's own dependency

    return float(scipy.stats.t.ppf((1 + CONFIDENCE) / 2, seeds - 1) / math.sqrt(seeds))


def what_seeds_show(seeds: int) -> str:
    """Plainly, what `seeds` paired seeds can and cannot show."""
    if seeds < 2:
        return (
            'With one seed there is no spread to measure: no difference can be told from seed-to-seed noise, '
            'however large. Train more seeds (--seeds=0,1,2) before reading anything into the table.'
        )
    factor = interval_factor(seeds)
    more = (
        f' Three seeds narrow it to ± {interval_factor(3):.2f}, five to ± {interval_factor(5):.2f}.'
        if seeds < 3
        else ''
    )
    return (
        f'With {seeds} seeds, the {CONFIDENCE:.0%} interval of a paired difference is its mean ± {factor:.2f} '
        'standard deviations of the per-seed differences: a difference is resolved (its sign shown) only where it '
        f'is larger than {factor:.2f} times that spread. An unresolved difference is not evidence that the '
        f'variants are equal: the seeds cannot tell either way.{more}'
    )


def mean_curve(curves: Sequence[dict]) -> dict[int, float]:
    """The mean of several curves over the steps all of them have (keys may be ints or strings)."""
    steps = set.intersection(*(set(c) for c in curves))
    return {int(s): float(np.mean([c[s] for c in curves])) for s in sorted(steps, key=int)}


def step_to_reach(curve: dict[int, float], target: float) -> float | None:
    """The first step at which `curve` is at or below `target`, interpolated linearly between its
    points (the first point, if it is already there); None if the curve never gets there."""
    steps = sorted(curve)
    for i, step in enumerate(steps):
        if curve[step] <= target:
            if i == 0:
                return float(step)
            before = steps[i - 1]
            fraction = (curve[before] - target) / (curve[before] - curve[step])
            return before + fraction * (step - before)
    return None


@dataclasses.dataclass(frozen=True)
class Crossing:
    """Where a baseline overtakes a variant for good (the paper's critical step)."""

    step: int | None  # the first step after which the baseline stays below; None: not within the budget
    variant_led: bool  # whether the variant was ahead at some step before that

    def describe(self) -> str:
        if self.step is None:
            return 'not within the budget' if self.variant_led else 'no lead, no crossing'
        return f'step {self.step}' if self.variant_led else f'behind from step {self.step} on (never led)'


def critical_step(variant: dict[int, float], baseline: dict[int, float], window: int) -> Crossing:
    """The first step after which the baseline's smoothed training loss stays below the variant's."""
    steps, relative = relative_loss(variant, baseline, window)
    behind = relative > 0
    if not len(steps) or not behind[-1]:
        return Crossing(None, bool(np.any(relative < 0)))
    first = len(behind) - int(np.argmin(behind[::-1])) if not behind.all() else 0
    return Crossing(steps[first], bool(np.any(relative[:first] < 0)))
