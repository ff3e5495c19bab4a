"""Paired comparison of a candidate arm against a baseline arm, comparability checks, losslessness, and the gate.

Requests are paired by schedule index (the same task at the same place in the run for both arms); intervals come
from one bootstrap over tasks shared by both arms, so task difficulty cancels out of every difference. Each gate
rule is PASS when its whole 95% interval is on the good side of the limit, FAIL when the whole interval is on the
bad side, and INCONCLUSIVE otherwise, with the number of distinct tasks that would shrink the interval enough.

    verdict = judge(baseline_records, candidate_records, load_gate(None), temperature=0.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import yaml
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dfserve.errors import UserError, describe_invalid, describe_yaml
from dfserve.loadtest import records as rec
from dfserve.loadtest import stats
from dfserve.loadtest.records import RequestRecord
from dfserve.sglang import parse_server_info

if TYPE_CHECKING:  # config.py records a sequential run's gate, so it imports this module
    from dfserve.loadtest.config import RunConfig

Status = Literal["PASS", "FAIL", "INCONCLUSIVE"]
G = TypeVar("G", bound=BaseModel)
RuleStatus = Literal["PASS", "FAIL", "INCONCLUSIVE", "NOT_APPLICABLE"]


@dataclass(frozen=True)
class MetricSpec:
    label: str
    kind: Literal["ratio", "quantile", "error_rate"]
    higher_is_better: bool
    q: float = 0.5
    per_request: Callable[[RequestRecord], float | None] | None = None
    per_sample: Callable[[RequestRecord], list[float]] | None = None
    numerator: Callable[[RequestRecord], float | None] | None = None
    denominator: Callable[[RequestRecord], float | None] | None = None


def _quantiles(name: str, label: str, **how: Any) -> dict[str, MetricSpec]:
    return {f"{name}_p{p}": MetricSpec(f"{label} p{p}", "quantile", False, q=p / 100, **how) for p in (50, 95, 99)}


METRICS: dict[str, MetricSpec] = {
    "accept_length": MetricSpec("acceptance length (Σ tokens / Σ verify rounds)", "ratio", True,
                                numerator=lambda r: r.completion_tokens, denominator=rec.verify_rounds),
    "output_tokens_per_s": MetricSpec("output tokens/s per stream (Σ tokens / Σ E2E)", "ratio", True,
                                      numerator=lambda r: r.completion_tokens, denominator=rec.e2e_s),
    **_quantiles("ttft", "TTFT", per_request=rec.ttft_s),
    **_quantiles("tpot", "TPOT", per_request=rec.tpot_s),
    **_quantiles("itl_per_token", "ITL per token", per_sample=rec.itl_per_token_s),
    **_quantiles("itl_per_chunk", "ITL per chunk", per_sample=rec.itl_per_chunk_s),
    **_quantiles("e2e", "E2E", per_request=rec.e2e_s),
    "error_rate": MetricSpec("error rate", "error_rate", False),
}
LOSSLESS = "lossless_fraction"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Rule(_Model):
    """`max_worse`: how much worse the candidate may be (relative for ratios and quantiles, absolute for the error
    rate); `at_least`: the smallest identical-output fraction (losslessness)."""

    metric: str
    max_worse: float | None = Field(None, ge=0)
    at_least: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _check(self) -> Rule:
        if self.metric == LOSSLESS:
            if self.at_least is None or self.max_worse is not None:
                raise ValueError(f"{LOSSLESS} takes 'at_least' only")
        elif self.metric in METRICS:
            if self.max_worse is None or self.at_least is not None:
                raise ValueError(f"{self.metric} takes 'max_worse' only")
        else:
            raise ValueError(f"unknown metric {self.metric!r}; known: {', '.join([*METRICS, LOSSLESS])}")
        return self


class Gate(_Model):
    schema_version: Literal[1] = 1
    rules: tuple[Rule, ...]
    bootstrap_draws: int = Field(2000, ge=200)
    seed: int = 0


DEFAULT_GATE = Gate(rules=(
    Rule(metric="accept_length", max_worse=0.02),
    Rule(metric="tpot_p95", max_worse=0.05),
    Rule(metric="error_rate", max_worse=0.01),
    Rule(metric=LOSSLESS, at_least=0.99),
))


def load_gate(path: Path | None) -> Gate:
    """The gate in a YAML file (`rules: [{metric, max_worse | at_least}]`), or the defaults."""
    return read_gate(path, DEFAULT_GATE)


def read_gate(path: Path | None, default: G) -> G:
    """A gate of `default`'s type from a YAML file (the offline evaluation's has its own metrics), or `default`."""
    if path is None:
        return default
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise UserError(f"--gate: cannot read {path} ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise UserError(describe_yaml(exc, f"--gate: {path}")) from None
    try:
        return type(default).model_validate(raw)
    except ValidationError as exc:
        raise UserError(describe_invalid(exc, f"--gate: {path}")) from None


class MetricResult(_Model):
    metric: str
    label: str
    baseline: float | None
    candidate: float | None
    change: float | None = Field(description="candidate vs baseline: relative (c/b - 1), absolute for error_rate")
    change_low: float | None
    change_high: float | None
    relative: bool
    n_baseline: int
    n_candidate: int
    higher_is_better: bool


class RuleResult(_Model):
    metric: str
    limit: float
    status: RuleStatus
    detail: str
    tasks_needed: int | None = None
    low: float | None = Field(None, description="the interval the rule was decided on: how much worse the candidate "
                              "is (relative or absolute), or the identical fraction for lossless_fraction; "
                              "set by sequential judgements")
    high: float | None = None
    requests_needed: int | None = Field(None, description="paired requests that would decide the rule if the data "
                                        "went on as so far (sequential judgements)")
    task_set_limited: bool = Field(False, description="undecided, and more requests cannot decide it: every task was "
                                   "seen, or more distinct tasks than the set holds are needed, and repeating one "
                                   "adds nothing (temperature 0: same output, same verify rounds)")


class Lossless(_Model):
    applicable: bool
    pairs: int
    identical: int
    fraction: float | None
    low: float | None
    high: float | None
    differing_tasks: list[str]


class Judgement(_Model):
    verdict: Status
    paired_requests: int
    tasks: int
    metrics: tuple[MetricResult, ...]
    rules: tuple[RuleResult, ...]
    lossless: Lossless
    tasks_needed: int | None


@dataclass(frozen=True)
class _Pairs:
    base: list[RequestRecord]
    cand: list[RequestRecord]
    cluster: NDArray[np.int64]
    tasks: int


def _pair(baseline: Sequence[RequestRecord], candidate: Sequence[RequestRecord]) -> _Pairs:
    by_index = {r.index: r for r in rec.measured_records(baseline)}
    pairs = [(by_index[r.index], r) for r in rec.measured_records(candidate) if r.index in by_index]
    for b, c in pairs:
        if b.task_id != c.task_id:
            raise UserError(f"request {b.index}: baseline ran task {b.task_id!r}, candidate {c.task_id!r}; "
                            "the runs did not replay the same schedule")
    pairs.sort(key=lambda p: p[0].index)
    ids = sorted({b.task_id for b, _ in pairs})
    position = {t: i for i, t in enumerate(ids)}
    return _Pairs([b for b, _ in pairs], [c for _, c in pairs],
                  np.array([position[b.task_id] for b, _ in pairs], dtype=np.int64), len(ids))


def _per_task(values: Sequence[float], cluster: NDArray[np.int64], tasks: int) -> NDArray[np.float64]:
    return np.bincount(cluster, weights=np.asarray(values, dtype=float), minlength=tasks).astype(float)


def _compare(name: str, spec: MetricSpec, pairs: _Pairs, weights: NDArray[np.float64]) -> MetricResult:
    both_ok = [i for i, (b, c) in enumerate(zip(pairs.base, pairs.cand, strict=True)) if b.ok and c.ok]

    def empty(n_b: int = 0, n_c: int = 0) -> MetricResult:
        return MetricResult(metric=name, label=spec.label, baseline=None, candidate=None, change=None,
                            change_low=None, change_high=None, relative=True, n_baseline=n_b, n_candidate=n_c,
                            higher_is_better=spec.higher_is_better)

    if spec.kind == "error_rate":
        n = len(pairs.base)
        if n == 0:
            return empty()
        totals = _per_task([1.0] * n, pairs.cluster, pairs.tasks)
        err_b = _per_task([0.0 if r.ok else 1.0 for r in pairs.base], pairs.cluster, pairs.tasks)
        err_c = _per_task([0.0 if r.ok else 1.0 for r in pairs.cand], pairs.cluster, pairs.tasks)
        rate_b, rate_c = err_b.sum() / n, err_c.sum() / n
        draws = stats.weighted_ratio(weights, err_c, totals) - stats.weighted_ratio(weights, err_b, totals)
        interval = stats.percentile_interval(rate_c - rate_b, draws)
        return MetricResult(metric=name, label=spec.label, baseline=rate_b, candidate=rate_c, change=interval.estimate,
                            change_low=interval.low, change_high=interval.high, relative=False, n_baseline=n,
                            n_candidate=n, higher_is_better=False)
    cluster = pairs.cluster[both_ok]
    if spec.kind == "ratio":
        assert spec.numerator is not None and spec.denominator is not None
        sums = []
        for arm in (pairs.base, pairs.cand):
            rows = [(spec.numerator(arm[i]), spec.denominator(arm[i]), int(c)) for i, c in zip(both_ok, cluster, strict=True)]
            kept = [(num, den, c) for num, den, c in rows if num is not None and den]
            if not kept:
                return empty()
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
                if spec.per_request is not None:
                    value = spec.per_request(arm[i])
                    got = [] if value is None else [value]
                else:
                    assert spec.per_sample is not None
                    got = spec.per_sample(arm[i])
                values.extend(got)
                owners.extend([int(c)] * len(got))
            if not values:
                return empty()
            samples.append((np.asarray(values), np.asarray(owners, dtype=np.int64)))
        (vb, ob), (vc, oc) = samples
        n_b, n_c = len(vb), len(vc)
        value_b, value_c = stats.quantile(vb, spec.q), stats.quantile(vc, spec.q)
        assert value_b is not None and value_c is not None
        with np.errstate(divide="ignore", invalid="ignore"):  # a draw whose baseline quantile is 0 has no ratio
            draws = (stats.clustered_quantiles(weights, vc, oc, spec.q)
                     / stats.clustered_quantiles(weights, vb, ob, spec.q) - 1)
    if not value_b:
        return empty(n_b, n_c).model_copy(update={"baseline": float(value_b), "candidate": float(value_c)})
    interval = stats.percentile_interval(value_c / value_b - 1, draws)
    return MetricResult(metric=name, label=spec.label, baseline=float(value_b), candidate=float(value_c),
                        change=interval.estimate, change_low=interval.low, change_high=interval.high, relative=True,
                        n_baseline=n_b, n_candidate=n_c, higher_is_better=spec.higher_is_better)


def _lossless(pairs: _Pairs, temperature: float) -> Lossless:
    both = [(b, c) for b, c in zip(pairs.base, pairs.cand, strict=True) if b.ok and c.ok]
    differing = sorted({b.task_id for b, c in both if b.output_sha256 != c.output_sha256})
    identical = sum(1 for b, c in both if b.output_sha256 == c.output_sha256)
    interval = stats.wilson(identical, len(both))
    return Lossless(applicable=temperature == 0, pairs=len(both), identical=identical,
                    fraction=interval.estimate if interval else None, low=interval.low if interval else None,
                    high=interval.high if interval else None, differing_tasks=differing)


def tasks_needed(n: int, half_width: float, margin: float) -> int | None:
    """Distinct tasks for an interval of this spread to clear the limit: its width shrinks as 1/sqrt(tasks). Not
    requests: at temperature 0 a repeated task repeats its output and its rounds, so repeats add no evidence."""
    if n == 0 or margin <= 0 or not math.isfinite(half_width):
        return None
    return max(n + 1, math.ceil(n * (half_width / margin) ** 2))


def _rule(rule: Rule, metrics: dict[str, MetricResult], lossless: Lossless, tasks: int) -> RuleResult:
    if rule.metric == LOSSLESS:
        assert rule.at_least is not None
        limit = rule.at_least
        if not lossless.applicable:
            return RuleResult(metric=rule.metric, limit=limit, status="NOT_APPLICABLE",
                              detail="temperature > 0: outputs may differ by design")
        if lossless.fraction is None or lossless.high is None or lossless.low is None:
            return RuleResult(metric=rule.metric, limit=limit, status="INCONCLUSIVE", detail="no pair finished")
        detail = f"{lossless.identical}/{lossless.pairs} identical, interval [{lossless.low:.4f}, {lossless.high:.4f}]"
        # At temperature 0 every differing output is a defect, not noise: the observed fraction decides PASS,
        # while FAIL needs the whole interval below the limit.
        if lossless.high < limit:
            return RuleResult(metric=rule.metric, limit=limit, status="FAIL", detail=detail)
        if lossless.fraction >= limit:
            return RuleResult(metric=rule.metric, limit=limit, status="PASS", detail=detail)
        return RuleResult(metric=rule.metric, limit=limit, status="INCONCLUSIVE", detail=detail,
                          tasks_needed=tasks_needed(tasks, (lossless.high - lossless.low) / 2,
                                                    lossless.high - limit))
    assert rule.max_worse is not None
    return max_worse_rule(rule.max_worse, metrics[rule.metric], tasks)


def max_worse_rule(max_worse: float, result: MetricResult, tasks: int) -> RuleResult:
    """PASS when the candidate's whole 95% interval is at most `max_worse` worse than the baseline, FAIL when all
    of it is worse than that, INCONCLUSIVE otherwise: a gate rule on one paired metric, whoever paired it (the
    offline evaluation pairs drafters by task on cached features)."""
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


def overall(rules: Sequence[RuleResult]) -> tuple[Status, int | None]:
    """The verdict of a set of rule results (any FAIL fails; any INCONCLUSIVE leaves it open) and the distinct
    tasks the undecided rules would need."""
    statuses = {r.status for r in rules}
    verdict: Status = "FAIL" if "FAIL" in statuses else "INCONCLUSIVE" if "INCONCLUSIVE" in statuses else "PASS"
    needed = [r.tasks_needed for r in rules if r.status == "INCONCLUSIVE" and r.tasks_needed is not None]
    return verdict, max(needed) if needed else None


def judge(baseline: Sequence[RequestRecord], candidate: Sequence[RequestRecord], gate: Gate, temperature: float) -> Judgement:
    """Every metric with its paired interval, every gate rule's status, and the verdict."""
    pairs = _pair(baseline, candidate)
    if not pairs.base:
        raise UserError("no request index appears in both arms: nothing to compare")
    weights = stats.cluster_weights(pairs.tasks, gate.bootstrap_draws, np.random.default_rng(gate.seed))
    metrics = {name: _compare(name, spec, pairs, weights) for name, spec in METRICS.items()}
    lossless = _lossless(pairs, temperature)
    rules = tuple(_rule(rule, metrics, lossless, pairs.tasks) for rule in gate.rules)
    verdict, needed = overall(rules)
    return Judgement(verdict=verdict, paired_requests=len(pairs.base), tasks=pairs.tasks,
                     metrics=tuple(metrics.values()), rules=rules, lossless=lossless, tasks_needed=needed)


def comparability(baseline: RunConfig, base_arm: str, candidate: RunConfig, cand_arm: str) -> list[str]:
    """What differs between the two sides beyond the drafter under test; empty when they are comparable."""
    problems: list[str] = []
    if baseline.run_id != candidate.run_id:
        a, b = baseline.shape(), candidate.shape()
        problems.extend(f"{key}: {a[key]!r} vs {b[key]!r}" for key in a if a[key] != b[key])
    infos = [baseline.arm(base_arm), candidate.arm(cand_arm)]
    servers = [parse_server_info(i.server_info) if i.server_info is not None else None for i in infos]
    if servers[0] and servers[1]:
        for field in ("model_path", "max_running_requests"):
            x, y = getattr(servers[0], field), getattr(servers[1], field)
            if x != y:
                problems.append(f"server {field}: {x!r} vs {y!r}")
    if infos[0].simulated != infos[1].simulated:
        problems.append(f"simulated: {infos[0].simulated} vs {infos[1].simulated} (one arm is a real engine)")
    return problems
