"""Each metric kind's fixed-n statistic: the change, candidate vs baseline, with its 95% paired bootstrap interval.

The bootstrap draws tasks (`weights`: one row of task weights per draw, `stats.cluster_weights`), so task
difficulty cancels out of every difference. Ratios and quantiles change relatively, rates absolutely; identical
outputs are a fraction of finished pairs with a Wilson interval, not a change. `kinds.KINDS` names which is which.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from dfserve.verdict import stats
from dfserve.verdict.pairs import MetricSpec, Pairs, known_outputs
from dfserve.verdict.results import Lossless, MetricResult


def _per_task(values: Sequence[float], cluster: NDArray[np.int64], tasks: int) -> NDArray[np.float64]:
    return np.bincount(cluster, weights=np.asarray(values, dtype=float), minlength=tasks).astype(float)


def _empty(name: str, spec: MetricSpec[Any], n_b: int = 0, n_c: int = 0) -> MetricResult:
    return MetricResult(metric=name, label=spec.label, baseline=None, candidate=None, change=None, change_low=None,
                        change_high=None, relative=True, n_baseline=n_b, n_candidate=n_c,
                        higher_is_better=spec.higher_is_better, unit=spec.unit)


def _finished(pairs: Pairs[Any]) -> tuple[list[int], NDArray[np.int64]]:
    """The pairs both of whose sides finished, and their tasks."""
    both_ok = [i for i, (b, c) in enumerate(zip(pairs.base, pairs.cand, strict=True)) if b.ok and c.ok]
    return both_ok, pairs.cluster[both_ok]


def _relative(name: str, spec: MetricSpec[Any], values: tuple[float, float], draws: NDArray[np.float64],
              counts: tuple[int, int], clusters: int) -> MetricResult:
    (value_b, value_c), (n_b, n_c) = values, counts
    if not value_b:
        return _empty(name, spec, n_b, n_c).model_copy(update={"baseline": float(value_b), "candidate": float(value_c)})
    interval = stats.decisive_interval(value_c / value_b - 1, draws, clusters)
    return MetricResult(metric=name, label=spec.label, baseline=float(value_b), candidate=float(value_c),
                        change=interval.estimate, change_low=interval.low, change_high=interval.high, relative=True,
                        n_baseline=n_b, n_candidate=n_c, higher_is_better=spec.higher_is_better, unit=spec.unit)


def error_rate(name: str, spec: MetricSpec[Any], pairs: Pairs[Any], weights: NDArray[np.float64]) -> MetricResult:
    """The absolute change in the share of units that did not finish, with the wider of two intervals: the task
    bootstrap, which holds errors that come by task, and Newcombe's from the counts, which holds rare ones (a
    bootstrap of no error seen is [0, 0], a PASS of an error rate it cannot have measured); no interval over fewer
    tasks than the bootstrap's minimum (`stats.MIN_CLUSTERS`), whatever the counts: errors come by task."""
    n = len(pairs)
    if n == 0:
        return _empty(name, spec)
    totals = _per_task([1.0] * n, pairs.cluster, pairs.tasks)
    err_b = _per_task([0.0 if u.ok else 1.0 for u in pairs.base], pairs.cluster, pairs.tasks)
    err_c = _per_task([0.0 if u.ok else 1.0 for u in pairs.cand], pairs.cluster, pairs.tasks)
    rate_b, rate_c = err_b.sum() / n, err_c.sum() / n
    draws = stats.weighted_ratio(weights, err_c, totals) - stats.weighted_ratio(weights, err_b, totals)
    interval = stats.decisive_interval(rate_c - rate_b, draws, _clusters(pairs.cluster))
    counted = stats.newcombe(round(err_b.sum()), n, round(err_c.sum()), n) if math.isfinite(interval.low) else interval
    assert counted is not None
    by_counts = counted.high > interval.high  # the side a PASS must clear
    return MetricResult(metric=name, label=spec.label, baseline=rate_b, candidate=rate_c, change=interval.estimate,
                        change_low=min(interval.low, counted.low), change_high=max(interval.high, counted.high),
                        relative=False, n_baseline=n, n_candidate=n, higher_is_better=False, unit=spec.unit,
                        interval_of_counts=by_counts)


def _clusters(owners: NDArray[np.int64]) -> int:
    """How many tasks hold the values resampled (those that gave the metric a value, not every task with a pair):
    the intervals' degrees of freedom."""
    return int(np.unique(owners).size)


def ratio(name: str, spec: MetricSpec[Any], pairs: Pairs[Any], weights: NDArray[np.float64]) -> MetricResult:
    """The relative change in Σ numerator / Σ denominator over finished pairs."""
    assert spec.numerator is not None and spec.denominator is not None
    both_ok, cluster = _finished(pairs)
    sums = []
    for arm in (pairs.base, pairs.cand):
        rows = [(spec.numerator(arm[i]), spec.denominator(arm[i]), int(c)) for i, c in zip(both_ok, cluster, strict=True)]
        kept = [(num, den, c) for num, den, c in rows if num is not None and den]
        if not kept:
            return _empty(name, spec)
        kept_owners = np.array([c for _, _, c in kept], dtype=np.int64)
        sums.append((_per_task([num for num, _, _ in kept], kept_owners, pairs.tasks),
                     _per_task([den for _, den, _ in kept], kept_owners, pairs.tasks), len(kept), kept_owners))
    (nb, db, n_b, ob), (nc, dc, n_c, oc) = sums
    with np.errstate(divide="ignore", invalid="ignore"):
        draws = stats.weighted_ratio(weights, nc, dc) / stats.weighted_ratio(weights, nb, db) - 1
    return _relative(name, spec, (nb.sum() / db.sum(), nc.sum() / dc.sum()), draws, (n_b, n_c),
                     min(_clusters(ob), _clusters(oc)))


def quantile(name: str, spec: MetricSpec[Any], pairs: Pairs[Any], weights: NDArray[np.float64]) -> MetricResult:
    """The relative change in the q-quantile of one value per finished pair (`value`) or of many (`samples`)."""
    both_ok, cluster = _finished(pairs)
    samples = []
    for arm in (pairs.base, pairs.cand):
        values: list[float] = []
        owners: list[int] = []
        for i, c in zip(both_ok, cluster, strict=True):
            if spec.value is not None:
                value = spec.value(arm[i])
                got = [] if value is None else [value]
            else:
                assert spec.samples is not None
                got = spec.samples(arm[i])
            values.extend(got)
            owners.extend([int(c)] * len(got))
        if not values:
            return _empty(name, spec)
        samples.append((np.asarray(values), np.asarray(owners, dtype=np.int64)))
    (vb, ob), (vc, oc) = samples
    value_b, value_c = stats.quantile(vb, spec.q), stats.quantile(vc, spec.q)
    assert value_b is not None and value_c is not None
    with np.errstate(divide="ignore", invalid="ignore"):  # a draw whose baseline quantile is 0 has no ratio
        draws = (stats.clustered_quantiles(weights, vc, oc, spec.q)
                 / stats.clustered_quantiles(weights, vb, ob, spec.q) - 1)
    return _relative(name, spec, (value_b, value_c), draws, (len(vb), len(vc)), min(_clusters(ob), _clusters(oc)))


def identical(spec: MetricSpec[Any], pairs: Pairs[Any]) -> Lossless:
    """The share of finished pairs whose outputs must agree (`Pairs.must_agree`) that do, and the tasks where they
    differ; where no pair must agree, of every pair, for reading only (not applicable)."""
    agree = pairs.must_agree
    counted = agree if any(agree) else (True,) * len(pairs)
    compared = ((t, known_outputs(spec, b, c))
                for t, b, c, must in zip(pairs.task_ids, pairs.base, pairs.cand, counted, strict=True) if must)
    both = [(t, outputs) for t, outputs in compared if outputs is not None]
    differing = sorted({t for t, (b, c) in both if b != c})
    same = sum(1 for _, (b, c) in both if b == c)
    interval = stats.wilson(same, len(both))
    return Lossless(applicable=any(agree), pairs=len(both), identical=same,
                    fraction=interval.estimate if interval else None, low=interval.low if interval else None,
                    high=interval.high if interval else None, differing_tasks=differing,
                    greedy_of=len(pairs) if any(agree) and not all(agree) else None, tasks=len({t for t, _ in both}))
