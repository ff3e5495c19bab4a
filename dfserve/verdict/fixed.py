"""The fixed-n design: every metric with a paired bootstrap interval over tasks, every rule decided on it.

Intervals come from one bootstrap over the tasks the pairs share, so task difficulty cancels out of every
difference. A `max_worse` rule is PASS when its whole 95% interval is on the good side of the limit, FAIL when the
whole interval is on the bad side, and INCONCLUSIVE otherwise, with the number of distinct tasks that would shrink
the interval enough.

    outcome = FixedN().judge(pairs, metrics, gate)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from dfserve.verdict import stats
from dfserve.verdict.design import Outcome
from dfserve.verdict.gate import Gate, Rule
from dfserve.verdict.pairs import MetricSpec, Pairs
from dfserve.verdict.results import Judgement, Lossless, MetricResult, RuleResult, overall, tasks_needed


def _per_task(values: Sequence[float], cluster: NDArray[np.int64], tasks: int) -> NDArray[np.float64]:
    return np.bincount(cluster, weights=np.asarray(values, dtype=float), minlength=tasks).astype(float)


def _empty(name: str, spec: MetricSpec[Any], n_b: int = 0, n_c: int = 0) -> MetricResult:
    return MetricResult(metric=name, label=spec.label, baseline=None, candidate=None, change=None, change_low=None,
                        change_high=None, relative=True, n_baseline=n_b, n_candidate=n_c,
                        higher_is_better=spec.higher_is_better, unit=spec.unit)


def _error_rate(name: str, spec: MetricSpec[Any], pairs: Pairs[Any], weights: NDArray[np.float64]) -> MetricResult:
    n = len(pairs)
    if n == 0:
        return _empty(name, spec)
    totals = _per_task([1.0] * n, pairs.cluster, pairs.tasks)
    err_b = _per_task([0.0 if u.ok else 1.0 for u in pairs.base], pairs.cluster, pairs.tasks)
    err_c = _per_task([0.0 if u.ok else 1.0 for u in pairs.cand], pairs.cluster, pairs.tasks)
    rate_b, rate_c = err_b.sum() / n, err_c.sum() / n
    draws = stats.weighted_ratio(weights, err_c, totals) - stats.weighted_ratio(weights, err_b, totals)
    interval = stats.percentile_interval(rate_c - rate_b, draws)
    return MetricResult(metric=name, label=spec.label, baseline=rate_b, candidate=rate_c, change=interval.estimate,
                        change_low=interval.low, change_high=interval.high, relative=False, n_baseline=n,
                        n_candidate=n, higher_is_better=False, unit=spec.unit)


def _compare(name: str, spec: MetricSpec[Any], pairs: Pairs[Any], weights: NDArray[np.float64]) -> MetricResult:
    if spec.kind == "error_rate":
        return _error_rate(name, spec, pairs, weights)
    both_ok = [i for i, (b, c) in enumerate(zip(pairs.base, pairs.cand, strict=True)) if b.ok and c.ok]
    cluster = pairs.cluster[both_ok]
    if spec.kind == "ratio":
        assert spec.numerator is not None and spec.denominator is not None
        sums = []
        for arm in (pairs.base, pairs.cand):
            rows = [(spec.numerator(arm[i]), spec.denominator(arm[i]), int(c)) for i, c in zip(both_ok, cluster, strict=True)]
            kept = [(num, den, c) for num, den, c in rows if num is not None and den]
            if not kept:
                return _empty(name, spec)
            kept_owners = np.array([c for _, _, c in kept], dtype=np.int64)
            sums.append((_per_task([num for num, _, _ in kept], kept_owners, pairs.tasks),
                         _per_task([den for _, den, _ in kept], kept_owners, pairs.tasks), len(kept)))
        (nb, db, n_b), (nc, dc, n_c) = sums
        value_b, value_c = nb.sum() / db.sum(), nc.sum() / dc.sum()
        with np.errstate(divide="ignore", invalid="ignore"):
            draws = stats.weighted_ratio(weights, nc, dc) / stats.weighted_ratio(weights, nb, db) - 1
    else:
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
        n_b, n_c = len(vb), len(vc)
        value_b, value_c = stats.quantile(vb, spec.q), stats.quantile(vc, spec.q)
        assert value_b is not None and value_c is not None
        with np.errstate(divide="ignore", invalid="ignore"):  # a draw whose baseline quantile is 0 has no ratio
            draws = (stats.clustered_quantiles(weights, vc, oc, spec.q)
                     / stats.clustered_quantiles(weights, vb, ob, spec.q) - 1)
    if not value_b:
        return _empty(name, spec, n_b, n_c).model_copy(update={"baseline": float(value_b), "candidate": float(value_c)})
    interval = stats.percentile_interval(value_c / value_b - 1, draws)
    return MetricResult(metric=name, label=spec.label, baseline=float(value_b), candidate=float(value_c),
                        change=interval.estimate, change_low=interval.low, change_high=interval.high, relative=True,
                        n_baseline=n_b, n_candidate=n_c, higher_is_better=spec.higher_is_better, unit=spec.unit)


def _lossless(spec: MetricSpec[Any], pairs: Pairs[Any]) -> Lossless:
    assert spec.output is not None
    output = spec.output
    both = [(t, b, c) for t, b, c in zip(pairs.task_ids, pairs.base, pairs.cand, strict=True) if b.ok and c.ok]
    differing = sorted({t for t, b, c in both if output(b) != output(c)})
    identical = sum(1 for _, b, c in both if output(b) == output(c))
    interval = stats.wilson(identical, len(both))
    return Lossless(applicable=pairs.deterministic, pairs=len(both), identical=identical,
                    fraction=interval.estimate if interval else None, low=interval.low if interval else None,
                    high=interval.high if interval else None, differing_tasks=differing)


def lossless_rule(rule: Rule, lossless: Lossless, tasks: int) -> RuleResult:
    """At temperature 0 every differing output is a defect, not noise: the observed fraction decides PASS, while
    FAIL needs the whole interval below the limit."""
    limit = rule.limit
    if not lossless.applicable:
        return RuleResult(metric=rule.metric, limit=limit, status="NOT_APPLICABLE",
                          detail="temperature > 0: outputs may differ by design")
    if lossless.fraction is None or lossless.high is None or lossless.low is None:
        return RuleResult(metric=rule.metric, limit=limit, status="INCONCLUSIVE", detail="no pair finished")
    detail = f"{lossless.identical}/{lossless.pairs} identical, interval [{lossless.low:.4f}, {lossless.high:.4f}]"
    if lossless.high < limit:
        return RuleResult(metric=rule.metric, limit=limit, status="FAIL", detail=detail)
    if lossless.fraction >= limit:
        return RuleResult(metric=rule.metric, limit=limit, status="PASS", detail=detail)
    return RuleResult(metric=rule.metric, limit=limit, status="INCONCLUSIVE", detail=detail,
                      tasks_needed=tasks_needed(tasks, (lossless.high - lossless.low) / 2, lossless.high - limit))


def max_worse_rule(max_worse: float, result: MetricResult, tasks: int) -> RuleResult:
    """PASS when the candidate's whole 95% interval is at most `max_worse` worse than the baseline, FAIL when all
    of it is worse than that, INCONCLUSIVE otherwise."""
    if result.change is None or result.change_low is None or result.change_high is None or math.isnan(result.change_low):
        return RuleResult(metric=result.metric, limit=max_worse, status="INCONCLUSIVE", detail="no paired data")
    # Express "worse" as a positive number on both sides so one comparison serves every direction.
    sign = -1.0 if result.higher_is_better else 1.0
    worse_low, worse_high = sorted((sign * result.change_low, sign * result.change_high))
    worse = sign * result.change
    unit = "" if not result.relative else " (relative)"
    detail = f"worse by {worse:+.4f}{unit}, interval [{worse_low:+.4f}, {worse_high:+.4f}], limit {max_worse:.4f}"
    if worse_high <= max_worse:
        return RuleResult(metric=result.metric, limit=max_worse, status="PASS", detail=detail)
    if worse_low > max_worse:
        return RuleResult(metric=result.metric, limit=max_worse, status="FAIL", detail=detail)
    return RuleResult(metric=result.metric, limit=max_worse, status="INCONCLUSIVE", detail=detail,
                      tasks_needed=tasks_needed(tasks, (worse_high - worse_low) / 2, abs(worse - max_worse)))


class FixedN:
    """Judges every pair at once; the intervals are 95% bootstrap intervals over tasks (`gate.bootstrap_draws`
    draws, seeded by `gate.seed`)."""

    def judge(self, pairs: Pairs[Any], metrics: Mapping[str, MetricSpec[Any]], gate: Gate) -> Outcome:
        weights = stats.cluster_weights(max(pairs.tasks, 1), gate.bootstrap_draws, np.random.default_rng(gate.seed))
        results = {name: _compare(name, spec, pairs, weights) for name, spec in metrics.items()
                   if spec.kind != "identical"}
        lossless = {name: _lossless(spec, pairs) for name, spec in metrics.items() if spec.kind == "identical"}
        rules = tuple(lossless_rule(rule, lossless[rule.metric], pairs.tasks) if rule.metric in lossless
                      else max_worse_rule(rule.limit, results[rule.metric], pairs.tasks) for rule in gate.rules)
        verdict, needed = overall(rules)
        return Outcome(Judgement(baseline=pairs.names[0], candidate=pairs.names[1], verdict=verdict, pairs=len(pairs),
                                 tasks=pairs.tasks, metrics=tuple(results.values()), rules=rules,
                                 lossless=next(iter(lossless.values()), None), tasks_needed=needed))
