"""Statistics of a run, pure and seeded: quantiles with distribution-free intervals, a cluster bootstrap, Wilson.

Requests of one task are correlated (the same prompt is easy or hard for every drafter), so resampling is over
tasks, not requests: each bootstrap draw picks tasks with replacement and weighs every request of a picked task by
how often it was picked. A draw is a weight vector, which makes sum-over-sum ratios a matrix product and quantiles a
weighted cumulative sum, with no Python loop over draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Z95 = 1.959963984540054
_CELLS_PER_BLOCK = 2_000_000  # draws x samples held at once by weighted quantiles


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def quantile(values: Sequence[float] | NDArray[np.float64], q: float) -> float | None:
    """The q-quantile (inverted CDF: an observed value); None without data, never a made-up 0."""
    if len(values) == 0:
        return None
    return float(np.quantile(np.asarray(values, dtype=float), q, method="inverted_cdf"))


def quantile_rank(n: int, q: float) -> int:
    """Index of the q-quantile among n sorted values, the one `quantile` returns (numpy's inverted CDF), so a
    sorted list kept as data arrives gives the same figure without a pass over it."""
    return min(n - 1, max(0, math.ceil(n * q) - 1))


def quantile_interval(values: Sequence[float] | NDArray[np.float64], q: float) -> Interval | None:
    """95% interval of a quantile from order statistics (binomial ranks): no resampling, no assumed shape."""
    n = len(values)
    if n == 0:
        return None
    ordered = np.sort(np.asarray(values, dtype=float))
    spread = Z95 * math.sqrt(n * q * (1 - q))
    low = max(0, math.floor(n * q - spread) - 1)
    high = min(n - 1, math.ceil(n * q + spread))
    estimate = quantile(ordered, q)
    assert estimate is not None
    return Interval(estimate, float(ordered[low]), float(ordered[high]))


def wilson(successes: int, n: int) -> Interval | None:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return None
    p = successes / n
    denom = 1 + Z95**2 / n
    centre = (p + Z95**2 / (2 * n)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / denom
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half))


def cluster_weights(clusters: int, draws: int, rng: np.random.Generator) -> NDArray[np.float64]:
    """`draws` x `clusters` matrix: how often each cluster (task) was picked in each bootstrap draw."""
    picks = rng.integers(0, clusters, size=(draws, clusters))
    weights = np.zeros((draws, clusters))
    np.add.at(weights, (np.arange(draws)[:, None], picks), 1.0)
    return weights


def weighted_ratio(weights: NDArray[np.float64], numerator: NDArray[np.float64], denominator: NDArray[np.float64]) -> NDArray[np.float64]:
    """Σ w·num / Σ w·den for each draw (row of `weights`); NaN where a draw's denominator is 0."""
    num = weights @ numerator
    den = weights @ denominator
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def weighted_quantiles(weights: NDArray[np.float64], values: NDArray[np.float64], q: float) -> NDArray[np.float64]:
    """The q-quantile of `values` under each row of per-value `weights` (inverted CDF, like `quantile`)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    result = np.empty(weights.shape[0])
    block = max(1, _CELLS_PER_BLOCK // max(1, len(values)))
    for start in range(0, weights.shape[0], block):
        cumulative = np.cumsum(weights[start : start + block, order], axis=1)
        totals = cumulative[:, -1:]
        index = np.argmax(cumulative >= q * totals - 1e-9, axis=1)
        result[start : start + block] = np.where(totals[:, 0] > 0, ordered[index], np.nan)
    return result


def clustered_quantiles(
    weights: NDArray[np.float64], values: NDArray[np.float64], owners: NDArray[np.int64], q: float, grid: int = 512
) -> NDArray[np.float64]:
    """The q-quantile under each bootstrap draw of clusters (`weights`: draws x clusters; `owners`: each value's
    cluster). Few values: exact. Many (per-token ITL): on a grid of `grid` points over the ranks where a draw's
    quantile can plausibly fall, from per-cluster counts, so the cost does not grow with the number of values."""
    n = len(values)
    if n * weights.shape[0] <= _CELLS_PER_BLOCK * 4:
        return weighted_quantiles(weights[:, owners], values, q)
    ordered = np.sort(values)
    spread = max(8 * math.sqrt(n * q * (1 - q)), 0.05 * n)
    low, high = ordered[max(0, int(n * q - spread))], ordered[min(n - 1, int(n * q + spread))]
    points = np.linspace(low, high, grid)
    counts = np.zeros((weights.shape[1], grid))
    np.add.at(counts, (owners, np.searchsorted(points, values, side="left").clip(max=grid - 1)),
              (values <= high).astype(float))
    below = weights @ np.cumsum(counts, axis=1)
    totals = weights @ np.bincount(owners, minlength=weights.shape[1]).astype(float)
    reached = below >= q * totals[:, None] - 1e-9
    index = np.where(reached.any(axis=1), np.argmax(reached, axis=1), grid - 1)
    return np.where(totals > 0, points[index], np.nan)


def t95(df: int) -> float:
    """Student's t 97.5th percentile with `df` degrees of freedom (df 1 and 2 exact; after them Hill's expansion,
    0.004 under at df 3, 3e-4 at df 5, exact to 4 digits from df 10)."""
    if df == 1:
        return math.tan(math.pi * 0.475)
    if df == 2:
        return 0.95 / math.sqrt(2 * 0.975 * 0.025)
    z = Z95
    terms = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96, (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
             (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160)
    return z + sum(term / df ** (k + 1) for k, term in enumerate(terms))


def expanded_tail(clusters: int) -> float:
    """The tail each side of a 95% percentile interval over `clusters` resampled clusters, expanded for few of
    them (Hesterberg's expanded percentile interval: z of the tail = sqrt(n / (n - 1)) * t(n - 1)): the plain
    2.5% percentiles of a bootstrap over 20 tasks cover a ratio about 90% of the time, not 95%."""
    return 0.5 * math.erfc(math.sqrt(clusters / (clusters - 1)) * t95(clusters - 1) / math.sqrt(2))


MIN_CLUSTERS = 5
"""Tasks below which a verdict's bootstrap gives no interval: one task's draws all agree (an interval of no width),
and the percentiles of two to four can reach no further than their range, however far the truth is (expanded, they
cover 51% of the time at two tasks, 86% at four, 91% at five)."""


def percentile_interval(estimate: float, draws: NDArray[np.float64], clusters: int) -> Interval:
    """The 95% percentile interval of bootstrap draws over `clusters` clusters around a point estimate (NaN draws
    dropped), expanded for few clusters (`expanded_tail`; the draws of one cluster all agree)."""
    finite = draws[np.isfinite(draws)]
    if finite.size == 0:
        return Interval(estimate, math.nan, math.nan)
    tail = expanded_tail(clusters) if clusters >= 2 else 0.025
    low, high = np.quantile(finite, [tail, 1 - tail])
    return Interval(estimate, float(low), float(high))


def decisive_interval(estimate: float, draws: NDArray[np.float64], clusters: int) -> Interval:
    """`percentile_interval` for a verdict to be decided on: NaN bounds (undecided) below `MIN_CLUSTERS`."""
    if clusters < MIN_CLUSTERS:
        return Interval(estimate, math.nan, math.nan)
    return percentile_interval(estimate, draws, clusters)


def newcombe(events_a: int, n_a: int, events_b: int, n_b: int) -> Interval | None:
    """95% interval of the difference of two proportions, b minus a, from their Wilson intervals (Newcombe's method
    10): it never claims more than the counts allow, where a bootstrap of rare events collapses (no event seen in
    any draw: [0, 0])."""
    a, b = wilson(events_a, n_a), wilson(events_b, n_b)
    if a is None or b is None:
        return None
    change = b.estimate - a.estimate
    return Interval(change, change - math.hypot(b.estimate - b.low, a.high - a.estimate),
                    change + math.hypot(b.high - b.estimate, a.estimate - a.low))


def newcombe_requests_needed(rate_a: float, rate_b: float, n: int, limit: float) -> int | None:
    """Requests per side at which Newcombe's interval of these two rates (b minus a) would lie wholly on one side of
    `limit`, if they held: its width shrinks as 1/n where no event is seen and as 1/sqrt(n) otherwise, so it is
    searched for, not scaled. None where the change is at the limit, or no count up to a billion decides it."""
    def decided(k: int) -> bool:
        interval = newcombe(round(rate_a * k), k, round(rate_b * k), k)
        return interval is not None and (interval.high <= limit or interval.low > limit)

    if rate_b - rate_a == limit:
        return None
    low, high = n, max(2 * n, n + 1)
    while not decided(high):
        low, high = high, 2 * high
        if high > 10**9:
            return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if decided(middle) else (middle, high)
    return high
