"""Loss-vs-parameters fits and the parameters a variant saves at equal loss (docs/scaling.md).

The fit is a power law, L(N) = A * N^(-alpha), least squares in log-log space, N = non-embedding
parameters. Why not L(N) = E + A * N^(-alpha): over the two to four sizes that a sweep affords,
spanning well under a decade of N, the irreducible loss E is not identifiable (three sizes fit
three parameters exactly, with no residual to judge them by), while the local log-log slope is
well determined; equal-loss comparisons between sizes inside the ladder need only that slope.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from vrl.core.errors import VrlError


class FitError(VrlError, ValueError):
    """Too few or unusable points for a fit; the message says what is missing."""


@dataclasses.dataclass(frozen=True)
class PowerLaw:
    """L(N) = a * N^(-alpha), fitted to (N, L) points."""

    a: float
    alpha: float
    residuals: tuple[float, ...]  # measured minus fitted loss, per point, in the order given

    def loss(self, n: float | np.ndarray) -> float | np.ndarray:
        return self.a * np.asarray(n, np.float64) ** -self.alpha

    def params_for(self, loss: float) -> float:
        """The N at which the fit reaches `loss`."""
        return (loss / self.a) ** (-1.0 / self.alpha)


def fit_power_law(n: Sequence[float], loss: Sequence[float]) -> PowerLaw:
    """Least squares of log L = log a - alpha log N; needs two or more distinct N and a falling loss."""
    n, loss = np.asarray(n, np.float64), np.asarray(loss, np.float64)
    if len(set(n.tolist())) < 2:
        raise FitError(f'a fit of loss against parameters needs two or more sizes; got {len(set(n.tolist()))}')
    if np.any(n <= 0) or np.any(loss <= 0):
        raise FitError('parameters and losses must be positive to fit a power law')
    slope, intercept = np.polyfit(np.log(n), np.log(loss), 1)
    if slope >= 0:
        raise FitError(f'the loss does not fall with size (log-log slope {slope:+.3f}): no power law to fit')
    law = PowerLaw(float(np.exp(intercept)), float(-slope), ())
    return dataclasses.replace(law, residuals=tuple((loss - law.loss(n)).tolist()))


def params_saved(variant: PowerLaw, baseline: PowerLaw, n_baseline: float) -> float:
    """The fraction of parameters the variant saves at the loss the baseline's fit has at n_baseline:
    1 - N_variant / n_baseline (negative when the variant needs more)."""
    return 1.0 - variant.params_for(float(baseline.loss(n_baseline))) / n_baseline


def bootstrap_params_saved(
    variant_seeds: Sequence[Sequence[float]],
    baseline_seeds: Sequence[Sequence[float]],
    n_variant: Sequence[float],
    n_baseline: Sequence[float],
    at: float,
    resamples: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """A 95% interval of params_saved(at) from the seeds: each resample draws, per size, the seeds'
    losses with replacement (variant_seeds[i] holds size i's per-seed losses), refits both laws on
    the means, and recomputes. Resamples whose loss does not fall with size are dropped."""
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        means = [
            [float(np.mean(rng.choice(seeds, len(seeds)))) for seeds in group]
            for group in (variant_seeds, baseline_seeds)
        ]
        try:
            values.append(params_saved(fit_power_law(n_variant, means[0]), fit_power_law(n_baseline, means[1]), at))
        except FitError:
            continue
    if not values:
        raise FitError('no bootstrap resample gave a loss that falls with size')
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)
