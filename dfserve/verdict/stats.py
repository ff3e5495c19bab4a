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


def percentile_interval(estimate: float, draws: NDArray[np.float64]) -> Interval:
    """The 2.5th and 97.5th percentiles of bootstrap draws around a point estimate (NaN draws dropped)."""
    finite = draws[np.isfinite(draws)]
    if finite.size == 0:
        return Interval(estimate, math.nan, math.nan)
    low, high = np.quantile(finite, [0.025, 0.975])
    return Interval(estimate, float(low), float(high))
