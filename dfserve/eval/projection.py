"""Will the run reach the baseline? τ by step, fitted with a saturating curve, with the fit's uncertainty.

The curve is τ(s) = a − b·exp(−s/c): a the asymptote the run is heading to, c the steps it takes to close about
two thirds of the remaining gap. Distillation losses, and so acceptance, approach their floor about geometrically
once the learning rate settles, and this form has a finite asymptote that a handful of checkpoints can bound. A
power law (a − b·s^−k) fits the same early points as well but approaches its asymptote so slowly that it
extrapolates crossings far beyond anything observed; the exponential is the more cautious promise, and a run still
rising in a straight line is reported as such (the best c lies beyond the grid: no bend seen, asymptote unbounded).

c is searched on a log grid (for each c, a and b are a linear least-squares fit). The uncertainty comes from a
bootstrap over checkpoints: each draw refits a resample of them (each point moved by its own standard error, when
given), so a run whose few points happen to bend is not read as levelling off unless most resamples bend there
too; a draw showing no bend has an unbounded asymptote and places no crossing. Outcomes:

- `too_few_checkpoints`: under `min_checkpoints` points, nothing is said;
- `reached`: the latest checkpoint's τ is at or above the baseline's (a measurement, no fit needed);
- `will_reach`: the asymptote's interval lies above the baseline and the crossing's whole interval falls within
  `horizon` times the last step scored;
- `plateau_below`: the asymptote's interval lies below the baseline;
- `undetermined`: anything else (the interval holds the baseline, or the crossing is too far to see)::

    projection = project([500, 1000, 1500, 2000, 2500], [4.1, 5.6, 6.4, 6.9, 7.1], baseline_tau=9.0)
    projection.outcome   # 'plateau_below'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

MIN_CHECKPOINTS = 5
HORIZON = 4.0
DRAWS = 400
_GRID = np.geomspace(0.03, 10.0, 90)
"""c in units of the last step scored; the top of the grid means no bend seen."""
_UNBOUNDED = 1e18

Outcome = Literal["too_few_checkpoints", "reached", "will_reach", "plateau_below", "undetermined"]


class Projection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    outcome: Outcome
    checkpoints: int
    baseline_tau: float
    asymptote: float | None = Field(description="the fitted a; None when the curve shows no bend (unbounded)")
    asymptote_low: float | None = Field(description="95% interval of a; None when unbounded")
    asymptote_high: float | None = Field(description="None when the interval is unbounded above")
    crossing_step: float | None = Field(description="where the fit reaches the baseline's τ (reached: the first "
                                        "checkpoint at or above it)")
    crossing_low: float | None
    crossing_high: float | None = Field(description="None when some fits never reach it")
    detail: str


@dataclass(frozen=True)
class _Fits:
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    bent: np.ndarray
    """False where the best c is the top of the grid (no bend seen) or the draw held under 3 distinct steps."""


def _fit(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> _Fits:
    """Weighted least squares over the c grid for every column at once: y and weights are [points, fits] (x in
    units of the last step; a case-bootstrap draw is the counts of each checkpoint as weights)."""
    fits = y.shape[1]
    best_sse = np.full(fits, np.inf)
    a, b, c = np.zeros(fits), np.zeros(fits), np.zeros(fits)
    index = np.zeros(fits, dtype=int)
    sw, sy = weights.sum(axis=0), (weights * y).sum(axis=0)
    for i, scale in enumerate(_GRID):
        f = -np.exp(-x / scale)[:, None]
        sf, sff, sfy = (weights * f).sum(axis=0), (weights * f * f).sum(axis=0), (weights * f * y).sum(axis=0)
        det = sw * sff - sf * sf
        with np.errstate(divide="ignore", invalid="ignore"):
            a_i, b_i = (sff * sy - sf * sfy) / det, (sw * sfy - sf * sy) / det
        sse = (weights * (y - a_i - b_i * f) ** 2).sum(axis=0)
        better = np.isfinite(sse) & (sse < best_sse - 1e-12)
        best_sse = np.where(better, sse, best_sse)
        a, b = np.where(better, a_i, a), np.where(better, b_i, b)
        c, index = np.where(better, scale, c), np.where(better, i, index)
    distinct = (weights > 0).sum(axis=0) >= 3
    return _Fits(a, b, c, distinct & (index < len(_GRID) - 1))


def _crossing(fits: _Fits, target: float) -> np.ndarray:
    """Where each fit reaches `target` (units of the last step); +inf where it never does."""
    gap = fits.a - target
    with np.errstate(divide="ignore", invalid="ignore"):
        at = fits.c * np.log(fits.b / gap)
    never = (gap <= 0) | ~np.isfinite(at)
    already = (gap > 0) & (fits.b <= 0)
    return np.where(already, 0.0, np.where(never, np.inf, np.maximum(at, 0.0)))


def _interval(values: np.ndarray) -> tuple[float, float]:
    low, high = np.percentile(np.minimum(values, _UNBOUNDED), [2.5, 97.5])
    return float(low), float(high)


def _bounded(value: float) -> float | None:
    return None if value >= _UNBOUNDED / 10 else value


def project(steps: Sequence[float], taus: Sequence[float], baseline_tau: float,
            tau_se: Sequence[float] | None = None, rng: np.random.Generator | None = None,
            min_checkpoints: int = MIN_CHECKPOINTS, draws: int = DRAWS, horizon: float = HORIZON) -> Projection:
    """The projection of τ by step against `baseline_tau`; `tau_se`: each point's standard error (its eval's
    interval), a floor on the noise the bootstrap assumes."""
    order = np.argsort(np.asarray(steps, dtype=float))
    s = np.asarray(steps, dtype=float)[order]
    y = np.asarray(taus, dtype=float)[order]
    n = len(s)
    empty = {"asymptote": None, "asymptote_low": None, "asymptote_high": None, "crossing_low": None,
             "crossing_high": None}
    if n and y[-1] >= baseline_tau:
        first = float(s[np.argmax(y >= baseline_tau)])
        return Projection(outcome="reached", checkpoints=n, baseline_tau=baseline_tau, **empty, crossing_step=first,
                          detail=f"τ {y[-1]:.3f} at step {s[-1]:.0f} is at or above the baseline's {baseline_tau:.3f}")
    if n < min_checkpoints or s[-1] <= 0:
        return Projection(outcome="too_few_checkpoints", checkpoints=n, baseline_tau=baseline_tau, **empty,
                          crossing_step=None, detail=f"{n} checkpoints scored; a projection needs {min_checkpoints}")
    x = s / s[-1]
    point = _fit(x, y[:, None], np.ones((n, 1)))
    se = np.zeros(n) if tau_se is None else np.asarray(tau_se, dtype=float)[order]
    rng = rng or np.random.default_rng(0)
    counts = rng.multinomial(n, np.full(n, 1 / n), size=draws).T.astype(float)
    boot = _fit(x, y[:, None] + rng.normal(size=(n, draws)) * se[:, None], counts)
    asymptotes = np.where(boot.bent, boot.a, np.inf)
    a_low, a_high = _interval(asymptotes)
    crossings = np.where(boot.bent, _crossing(boot, baseline_tau) * s[-1], np.inf)  # no bend: no crossing seen
    c_low, c_high = _interval(crossings)
    estimate = float(_crossing(point, baseline_tau)[0] * s[-1])
    fields = {
        "checkpoints": n, "baseline_tau": baseline_tau,
        "asymptote": float(point.a[0]) if point.bent[0] else None,
        "asymptote_low": _bounded(a_low), "asymptote_high": _bounded(a_high),
        "crossing_step": estimate if np.isfinite(estimate) else None,
        "crossing_low": _bounded(c_low), "crossing_high": _bounded(c_high),
    }
    shown = f"[{a_low:.3f}, {'∞' if _bounded(a_high) is None else f'{a_high:.3f}'}]"
    if a_high < baseline_tau:
        return Projection(outcome="plateau_below", **fields,
                          detail=f"τ is levelling off at {shown}, below the baseline's {baseline_tau:.3f}")
    if a_low > baseline_tau and c_high <= horizon * s[-1]:
        return Projection(outcome="will_reach", **fields,
                          detail=f"the baseline's τ {baseline_tau:.3f} is reached at about step {estimate:.0f} "
                          f"[{c_low:.0f}, {c_high:.0f}]")
    if a_low > baseline_tau:
        detail = f"the crossing may lie beyond {horizon:g}× the last step ({s[-1]:.0f}); too far to see"
    else:
        detail = f"the asymptote's interval {shown} holds the baseline's τ {baseline_tau:.3f}"
    return Projection(outcome="undetermined", **fields, detail=detail)
