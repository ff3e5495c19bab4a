"""The fixed-n design: every metric with a paired bootstrap interval over tasks, every rule decided on it.

Intervals come from one bootstrap over the tasks the pairs share, so task difficulty cancels out of every
difference; each metric's statistic is its kind's (`kinds.py`). A `max_worse` rule is PASS when its whole 95%
interval is on the good side of the limit, FAIL when the whole interval is on the bad side, and INCONCLUSIVE
otherwise, with the number of distinct tasks that would shrink the interval enough.

    outcome = FixedN().judge(pairs, metrics, gate)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from dfserve.verdict import stats, wording
from dfserve.verdict.design import Outcome
from dfserve.verdict.gate import Gate, Rule
from dfserve.verdict.kinds import kind_of
from dfserve.verdict.pairs import MetricSpec, Pairs
from dfserve.verdict.results import (
    NOT_JUDGED,
    Judgement,
    Lossless,
    MetricResult,
    RuleResult,
    overall,
    tasks_needed,
)


def lossless_rule(rule: Rule, lossless: Lossless, tasks: int) -> RuleResult:
    """At temperature 0 every differing output is a defect, not noise: the observed fraction decides PASS, while
    FAIL needs the whole interval below the limit."""
    limit = rule.limit
    if not lossless.applicable:
        return RuleResult(metric=rule.metric, limit=limit, status="NOT_APPLICABLE",
                          detail=NOT_JUDGED)
    if lossless.fraction is None or lossless.high is None or lossless.low is None:
        return RuleResult(metric=rule.metric, limit=limit, status="INCONCLUSIVE", detail="no pair finished")
    detail = (f"{lossless.identical}/{lossless.pairs} identical{wording.greedy_subset(lossless.greedy_of)}, "
              f"interval [{lossless.low:.4f}, {lossless.high:.4f}]")
    if lossless.high < limit:
        return RuleResult(metric=rule.metric, limit=limit, status="FAIL", detail=detail)
    if lossless.fraction >= limit and lossless.tasks is not None and lossless.tasks < stats.MIN_CLUSTERS:
        return RuleResult(metric=rule.metric, limit=limit, status="INCONCLUSIVE",
                          detail=f"{detail}; from fewer than {stats.MIN_CLUSTERS} distinct tasks ({lossless.tasks}): "
                                 "a repeat of a task repeats its output", tasks_needed=stats.MIN_CLUSTERS)
    if lossless.fraction >= limit:
        return RuleResult(metric=rule.metric, limit=limit, status="PASS", detail=detail + (
            f"; passes on the observed fraction, {lossless.fraction:.4f} ≥ {limit:.4g} (at temperature 0 a differing "
            "output is a defect, not noise: only an interval wholly below the limit fails)"))
    return RuleResult(metric=rule.metric, limit=limit, status="INCONCLUSIVE", detail=detail,
                      tasks_needed=tasks_needed(tasks, (lossless.high - lossless.low) / 2, lossless.high - limit))


def max_worse_rule(max_worse: float, result: MetricResult, tasks: int) -> RuleResult:
    """PASS when the candidate's whole 95% interval is at most `max_worse` worse than the baseline, FAIL when all
    of it is worse than that, INCONCLUSIVE otherwise."""
    if result.change is None or result.change_low is None or result.change_high is None:
        return RuleResult(metric=result.metric, limit=max_worse, status="INCONCLUSIVE", detail="no paired data")
    if math.isnan(result.change_low):
        return RuleResult(metric=result.metric, limit=max_worse, status="INCONCLUSIVE",
                          detail=f"no interval: its paired data come from fewer than {stats.MIN_CLUSTERS} distinct "
                                 "tasks", tasks_needed=stats.MIN_CLUSTERS if tasks < stats.MIN_CLUSTERS else None)
    # Express "worse" as a positive number on both sides so one comparison serves every direction.
    sign = -1.0 if result.higher_is_better else 1.0
    worse_low, worse_high = sorted((sign * result.change_low, sign * result.change_high))
    worse = sign * result.change
    unit = " (relative)" if result.relative else " (absolute)"
    detail = f"worse by {worse:+.4f}{unit}, interval [{worse_low:+.4f}, {worse_high:+.4f}], limit {max_worse:.4f}"
    if worse_high <= max_worse:
        return RuleResult(metric=result.metric, limit=max_worse, status="PASS", detail=detail)
    if worse_low > max_worse:
        return RuleResult(metric=result.metric, limit=max_worse, status="FAIL", detail=detail)
    if result.interval_of_counts and worse < max_worse and result.baseline is not None and result.candidate is not None:
        return RuleResult(metric=result.metric, limit=max_worse, status="INCONCLUSIVE", detail=detail,
                          requests_needed=stats.newcombe_requests_needed(result.baseline, result.candidate,
                                                                         result.n_baseline, max_worse))
    return RuleResult(metric=result.metric, limit=max_worse, status="INCONCLUSIVE", detail=detail,
                      tasks_needed=tasks_needed(tasks, (worse_high - worse_low) / 2, abs(worse - max_worse)))


class FixedN:
    """Judges every pair at once; the intervals are 95% bootstrap intervals over tasks (`gate.bootstrap_draws`
    draws, seeded by `gate.seed`)."""

    def judge(self, pairs: Pairs[Any], metrics: Mapping[str, MetricSpec[Any]], gate: Gate) -> Outcome:
        weights = stats.cluster_weights(max(pairs.tasks, 1), gate.bootstrap_draws, np.random.default_rng(gate.seed))
        read = {name: kind_of(spec).statistic(name, spec, pairs, weights) for name, spec in metrics.items()}
        results = {name: r for name, r in read.items() if isinstance(r, MetricResult)}
        lossless = {name: r for name, r in read.items() if isinstance(r, Lossless)}
        rules = tuple(lossless_rule(rule, lossless[rule.metric], pairs.tasks) if rule.metric in lossless
                      else max_worse_rule(rule.limit, results[rule.metric], pairs.tasks) for rule in gate.rules)
        verdict, needed = overall(rules)
        return Outcome(Judgement(baseline=pairs.names[0], candidate=pairs.names[1], verdict=verdict, pairs=len(pairs),
                                 tasks=pairs.tasks, metrics=tuple(results.values()), rules=rules,
                                 lossless=next(iter(lossless.values()), None), tasks_needed=needed))
