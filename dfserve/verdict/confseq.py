"""Confidence sequences: intervals that hold at every look at once, so a run may stop the moment one clears a limit.

A fixed-n 95% interval misses the truth 5% of the time at the one n chosen in advance; recomputed after every batch
and acted on the first time it clears a limit, it misses far more often, since each look is another chance. A
confidence sequence covers the truth at all looks simultaneously with probability 1 - alpha: it is the set of values
that a mixture likelihood ratio, a nonnegative martingale under the truth, has not pushed past 1/alpha, and by
Ville's inequality such a martingale ever gets there with probability at most alpha. Three are used:

- `mixture_radius`: Robbins' normal mixture for an estimate that is asymptotically normal with standard error `se`
  (the mixture SPRT of Johari, Koomen, Pekelis and Walsh, "Always valid inference", Operations Research 2022; the
  asymptotic confidence sequence of Waudby-Smith, Arbour, Sinha, Kennedy and Ramdas, Annals of Statistics 2024).
  It holds as far as the normal approximation does; `scale`, the spread of the mixture over effects, is where the
  radius is tightest relative to the fixed-n interval.
- `proportion_sequence`: the beta-binomial mixture for a count of successes (Robbins 1970; Howard, Ramdas,
  McAuliffe and Sekhon, Annals of Statistics 2021): exact for independent trials at every n, zero successes included.
- `quantile_sequence`: the order statistics whose ranks that mixture allows (Howard and Ramdas, "Sequential
  estimation of quantiles with applications to A/B-testing and best-arm identification", Bernoulli 2022): exact for
  independent draws from any continuous distribution.

    radius = mixture_radius(se=0.004, scale=0.02, alpha=0.05)   # estimate ± radius, valid at every look
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

JEFFREYS = 0.5
"""Both parameters of the beta mixing distribution: Beta(1/2, 1/2) puts weight near 0 and 1, where error rates and
identical-output fractions live, and on the tails a p95 or p99 is read from."""

_BISECTIONS = 32


def mixture_radius(se: float, scale: float, alpha: float) -> float:
    """Half-width of the normal-mixture confidence sequence around an estimate with standard error `se`.

    Mixing the likelihood ratio of each effect over N(0, scale²) gives sqrt(v/(v+r)) exp(d² r / (2 v (v+r))) for a
    deviation d, with v = se² and r = scale²; the interval is every d for which that stays below 1/alpha."""
    if se <= 0:
        return 0.0
    v, r = se * se, scale * scale
    return math.sqrt(v * (v + r) / r * (math.log1p(r / v) + 2 * math.log(1 / alpha)))


def paired_log_ratio(sums: NDArray[np.float64]) -> tuple[float, float] | None:
    """log((Σc_num / Σc_den) / (Σb_num / Σb_den)) and its delta-method standard error over clusters (tasks).

    `sums` is 4 x clusters: baseline numerator, baseline denominator, candidate numerator, candidate denominator,
    each summed over a task's requests. A cluster's influence on the log change is its share of each sum, candidate
    minus baseline, so tasks that are hard for both arms cancel; the standard error is the root of the summed squared
    influences over the number of clusters. None without data on both sides."""
    sums = sums[:, (sums[1] > 0) & (sums[3] > 0)]
    clusters = sums.shape[1]
    totals = sums.sum(axis=1)
    if clusters == 0 or totals[0] <= 0 or totals[2] <= 0:
        return None
    log_change = math.log(totals[2] / totals[3]) - math.log(totals[0] / totals[1])
    shares = sums / totals[:, None]
    influence = clusters * ((shares[2] - shares[3]) - (shares[0] - shares[1]))
    return log_change, math.sqrt(float(influence @ influence)) / clusters


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def _log_mixture(successes: int, n: int) -> float:
    """log of the beta-binomial mixture's likelihood of `successes` in `n` trials (in a given order)."""
    return _log_beta(JEFFREYS + successes, JEFFREYS + n - successes) - _log_beta(JEFFREYS, JEFFREYS)


def _log_likelihood(successes: int, n: int, p: float) -> float:
    return (successes * math.log(p) if successes else 0.0) + ((n - successes) * math.log1p(-p) if n - successes else 0.0)


def _bisect(inside: Callable[[float], bool], inner: float, outer: float) -> float:
    """The boundary between `inner` (inside) and `outer` (outside), to 2**-32 of their distance."""
    for _ in range(_BISECTIONS):
        middle = (inner + outer) / 2
        inner, outer = (middle, outer) if inside(middle) else (inner, middle)
    return inner


def proportion_sequence(successes: int, n: int, alpha: float) -> tuple[float, float]:
    """Every success probability the beta-binomial mixture has not rejected after `successes` of `n` trials."""
    if n == 0:
        return 0.0, 1.0
    floor = _log_mixture(successes, n) - math.log(1 / alpha)
    estimate = successes / n

    def inside(p: float) -> bool:
        return _log_likelihood(successes, n, p) > floor

    low = 0.0 if successes == 0 else _bisect(inside, estimate, 0.0)
    high = 1.0 if successes == n else _bisect(inside, estimate, 1.0)
    return low, high


def rank_band(n: int, q: float, alpha: float) -> tuple[int, int]:
    """The counts of draws at or below the q-quantile that the mixture allows after n draws, [low, high].

    The count is Binomial(n, q) at the true quantile; the mixture's log evidence is convex in it, smallest near nq,
    so each end is found by bisection over integers."""
    threshold = math.log(1 / alpha)

    def allowed(count: int) -> bool:
        return _log_mixture(count, n) - _log_likelihood(count, n, q) < threshold

    centre = min(n, max(0, round(n * q)))
    if not allowed(centre):  # too few draws for this quantile to be bounded at all
        return 0, n
    low_out, low_in = -1, centre
    while low_in - low_out > 1:
        middle = (low_in + low_out) // 2
        low_out, low_in = (low_out, middle) if allowed(middle) else (middle, low_in)
    high_in, high_out = centre, n + 1
    while high_out - high_in > 1:
        middle = (high_in + high_out) // 2
        high_in, high_out = (middle, high_out) if allowed(middle) else (high_in, middle)
    return low_in, high_in


def quantile_sequence(ordered: NDArray[np.float64], q: float, alpha: float) -> tuple[float, float]:
    """Bounds on the q-quantile from sorted independent draws: [X_(low), X_(high + 1)] for the allowed counts.

    A bound the ranks cannot reach is infinite: a p99 from 50 draws has no upper bound yet."""
    n = len(ordered)
    low_count, high_count = rank_band(n, q, alpha)
    low = float(ordered[low_count - 1]) if low_count >= 1 else -math.inf
    high = float(ordered[high_count]) if high_count < n else math.inf
    return low, high
