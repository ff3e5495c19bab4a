"""Two drafters scored on the same feature cache, paired by task: each method's τ change with a bootstrap interval,
and PASS / FAIL / INCONCLUSIVE through the gate machinery of `dfserve compare` (`judge.max_worse_rule`).

Tasks are the clusters: one bootstrap draw picks tasks with replacement and both drafters' Σ tokens / Σ rounds
are taken over the same picks, so a prompt's difficulty cancels out of the difference. The default rule asks the
candidate's vanilla τ to be at most 2% below the baseline's with confidence, like `dfserve compare`'s acceptance
rule; a gate file may name any method (`tau_vanilla`, `tau_ddtree8`)::

    judgement = judge_offline("zlab", base_records, "step-4000", cand_records, task_ids, methods, gate)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dfserve.errors import FieldError
from dfserve.eval.metrics import method_totals
from dfserve.eval.records import AnchorRecord, Judgement, metric_of
from dfserve.loadtest import stats
from dfserve.loadtest.judge import MetricResult, max_worse_rule, overall
from dfserve.runs import Provenance


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EvalRule(_Model):
    metric: str = Field(description="tau_vanilla, or tau_ddtreeN for a DDTree budget the run scored")
    max_worse: float = Field(ge=0, description="how much lower (relative) the candidate's τ may be")


class EvalGate(_Model):
    schema_version: Literal[1] = 1
    rules: tuple[EvalRule, ...] = Field(min_length=1)
    bootstrap_draws: int = Field(2000, ge=200)
    seed: int = 0


DEFAULT_EVAL_GATE = EvalGate(rules=(EvalRule(metric=metric_of("vanilla"), max_worse=0.02),))


def check_gate(gate: EvalGate, methods: Sequence[str]) -> None:
    """Every rule must name a method the run scores; checked before any computation."""
    known = [metric_of(m) for m in methods]
    if unknown := [r.metric for r in gate.rules if r.metric not in known]:
        raise FieldError("gate", f"metrics {unknown} are not scored by this run (known: {', '.join(known)})")


def judge_offline(
    baseline: str, base_records: Sequence[AnchorRecord], candidate: str, cand_records: Sequence[AnchorRecord],
    task_ids: Sequence[str], methods: Sequence[str], gate: EvalGate,
) -> Judgement:
    totals = {m: (method_totals(base_records, task_ids, m), method_totals(cand_records, task_ids, m)) for m in methods}
    (_, base_rounds), (_, cand_rounds) = totals[methods[0]]
    paired = (base_rounds > 0) & (cand_rounds > 0)
    tasks = int(paired.sum())
    weights = stats.cluster_weights(max(tasks, 1), gate.bootstrap_draws, np.random.default_rng(gate.seed))
    results = {}
    for method, ((tb, rb), (tc, rc)) in totals.items():
        tb, rb, tc, rc = tb[paired], rb[paired], tc[paired], rc[paired]
        metric = metric_of(method)
        label = f"τ {method} (Σ tokens / Σ rounds)"
        if not tasks:
            results[metric] = MetricResult(metric=metric, label=label, baseline=None, candidate=None, change=None,
                                           change_low=None, change_high=None, relative=True, n_baseline=0,
                                           n_candidate=0, higher_is_better=True)
            continue
        tau_b, tau_c = tb.sum() / rb.sum(), tc.sum() / rc.sum()
        draws = stats.weighted_ratio(weights, tc, rc) / stats.weighted_ratio(weights, tb, rb) - 1
        interval = stats.percentile_interval(float(tau_c / tau_b - 1), draws)
        results[metric] = MetricResult(
            metric=metric, label=label, baseline=float(tau_b), candidate=float(tau_c), change=interval.estimate,
            change_low=interval.low, change_high=interval.high, relative=True, n_baseline=int(rb.sum()),
            n_candidate=int(rc.sum()), higher_is_better=True,
        )
    rules = tuple(max_worse_rule(rule.max_worse, results[rule.metric], tasks) for rule in gate.rules)
    verdict, needed = overall(rules)
    return Judgement(baseline=baseline, candidate=candidate, verdict=verdict, tasks=tasks,
                     metrics=tuple(results.values()), rules=rules, tasks_needed=needed)


class Side(_Model):
    run_id: str
    run_dir: str
    drafter: str
    identity: str


class EvalVerdict(_Model):
    """eval-verdict.json: an offline judgement, in a folder of its own. It never promotes a drafter: only an
    online verdict (`dfserve compare`) does."""

    schema_version: Literal[1] = 1
    kind: Literal["eval-verdict"] = "eval-verdict"
    baseline: Side
    candidate: Side
    features: str
    judgement: Judgement
    gate: EvalGate
    provenance: Provenance
