"""Sequential verdicts: the gate decided after every batch of paired requests, and the run stopped once it is.

`SequentialMonitor` observes records as the runner writes them, pairs the two arms by schedule index, and every
`look_every` pairs puts an always-valid interval (`confseq`) on each gate rule. Looks are taken on the schedule's
complete prefix (pairs 0..k, whatever finished first): fast requests finish first, and a look at them would favour
short outputs, while the prefix is a random sample of the task set in the seeded order. Looks are therefore a pure
function of the pairs in index order, and `judge_sequential` replays them from requests.jsonl exactly.
Each rule's interval is the intersection of its intervals at every look so far (from `min_tasks` tasks on): valid
for the same reason, and a rule once decided stays decided when the requests in flight at the stop finish.

Each rule's metric and what its interval assumes (tasks are the independent units: the schedule draws them in a
seeded random order, one pass over the set before any repeats):

- ratios (`accept_length`, `output_tokens_per_s`): normal mixture on the log of the change, with a delta-method
  standard error over tasks (all of a task's requests are one cluster, as in the fixed-n bootstrap). Per-request
  acceptance lies between 1 and the block size, so every moment is finite and the normal approximation holds;
  it is asymptotic, hence `min_tasks` before any decision (the calibration in bench/RESULTS.md measures the
  error rates with a look after every batch). The mixture's scale is the rule's `max_worse` (at least 1%).
- quantiles of one value per request (TTFT, TPOT, E2E): each arm's quantile sequence at alpha/2, combined; exact for
  independent requests (a load that drifts during the run breaks that, for this design as for the fixed one).
- `error_rate`: each arm's beta-binomial sequence at alpha/2, combined; exact for independent requests, and valid
  with no error at all (where a normal approximation would claim certainty).
- `lossless_fraction`: beta-binomial over distinct tasks; at temperature 0 a task's output is fixed, so the observed
  fraction also decides PASS once every task of the set has been seen, as the fixed-n rule does.
- quantiles of per-token or per-chunk samples (ITL) are refused: their samples are many per request and dependent.

At temperature 0 a repeated task repeats its output and its verify rounds, so repeats add nothing to acceptance or
losslessness: once every task has been seen, a rule left undecided on those is limited by the task set, and the run
stops when every undecided rule is.

    monitor = SequentialMonitor(design, "zlab", "inhouse", temperature=0.0, task_count=164, warmup=8)
    runner observers: [monitor.observe]; stop sending when monitor.stopped
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dfserve.errors import UserError
from dfserve.loadtest import confseq, stats
from dfserve.loadtest.config import RunConfig, SequentialDesign
from dfserve.loadtest.judge import (
    LOSSLESS,
    METRICS,
    Gate,
    Judgement,
    MetricSpec,
    Rule,
    RuleResult,
    RuleStatus,
    Status,
    judge,
)
from dfserve.loadtest.records import RequestRecord

METHOD = ("always-valid confidence sequences: normal mixture (mSPRT) on the log change of ratio metrics, scale = "
          "the rule's max_worse (at least 0.01), delta-method standard error over tasks; beta-binomial mixture "
          "(Jeffreys) for error rates, identical-output fractions and quantile ranks")
SCALE_FLOOR = 0.01
StopReason = Literal["decided", "task_set"]


def check_gate(gate: Gate) -> None:
    """Refuse, before anything is sent, a rule the sequential design cannot decide."""
    for rule in gate.rules:
        spec = METRICS.get(rule.metric)
        if spec is not None and spec.per_sample is not None:
            raise UserError(f"--gate: rule {rule.metric}: --until-decided needs one value per request, and "
                            f"{spec.label} has many dependent samples per request")


@dataclass(frozen=True)
class RuleState:
    """One rule at one look. `low`/`high` are in the rule's terms: how much worse (relative or absolute), or the
    identical fraction for lossless_fraction. `units` counts distinct tasks when repeats add nothing (`per_task`),
    paired requests otherwise."""

    metric: str
    limit: float
    status: RuleStatus
    detail: str
    estimate: float | None = None
    low: float | None = None
    high: float | None = None
    units: int = 0
    per_task: bool = False
    task_set_limited: bool = False
    status_at: Callable[[float], RuleStatus] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Look:
    number: int
    pairs: int
    tasks: int
    rules: tuple[RuleState, ...]
    verdict: Status
    stop: StopReason | None


def units_to_decide(state: RuleState, max_growth: float = 1e4) -> int | None:
    """Units (distinct tasks or paired requests, as `state.units`) at which the rule would be decided if the data
    went on as so far; None when decided, when the estimate sits on the limit, or beyond `max_growth` times more."""
    if state.status != "INCONCLUSIVE" or state.status_at is None or state.units == 0:
        return None
    decided = state.status_at
    growth = 1.0
    while decided(growth) == "INCONCLUSIVE":
        growth *= 2
        if growth > max_growth:
            return None
    low = growth / 2
    for _ in range(10):
        middle = math.sqrt(low * growth)
        low, growth = (low, middle) if decided(middle) != "INCONCLUSIVE" else (middle, growth)
    return max(state.units + 1, math.ceil(state.units * growth))


def _status(low: float, high: float, limit: float) -> RuleStatus:
    """How much worse, as an interval: PASS when all of it is within the limit, FAIL when all of it is beyond."""
    if high <= limit:
        return "PASS"
    if low > limit:
        return "FAIL"
    return "INCONCLUSIVE"


@dataclass(frozen=True)
class _Reading:
    """A metric's change (candidate vs baseline) with its always-valid interval, and the interval at `growth`
    times the data if the data went on as so far."""

    change: float
    low: float
    high: float
    interval_at: Callable[[float], tuple[float, float]]


class _Track(Protocol):
    @property
    def tasks(self) -> int: ...

    def add(self, task: int, base: RequestRecord, cand: RequestRecord) -> None: ...

    def read(self, alpha: float) -> _Reading | None: ...


class _RatioTrack:
    """Σ numerator / Σ denominator per arm, summed per task as pairs arrive; the change is read on the log scale,
    where the normal mixture applies."""

    def __init__(self, spec: MetricSpec, scale: float, task_count: int) -> None:
        assert spec.numerator is not None and spec.denominator is not None
        self.numerator, self.denominator = spec.numerator, spec.denominator
        self.scale = scale
        self.sums = np.zeros((4, max(1, task_count)))  # per task: baseline num, den; candidate num, den
        self.seen: set[int] = set()

    @property
    def tasks(self) -> int:
        return len(self.seen)

    def add(self, task: int, base: RequestRecord, cand: RequestRecord) -> None:
        if not (base.ok and cand.ok):
            return
        nb, db, nc, dc = self.numerator(base), self.denominator(base), self.numerator(cand), self.denominator(cand)
        if nb is None or nc is None or not db or not dc:
            return
        if task >= self.sums.shape[1]:
            self.sums = np.concatenate([self.sums, np.zeros_like(self.sums)], axis=1)
        self.sums[:, task] += (nb, db, nc, dc)
        self.seen.add(task)

    def read(self, alpha: float) -> _Reading | None:
        estimate = confseq.paired_log_ratio(self.sums)
        if estimate is None:
            return None
        log_change, se = estimate

        def interval_at(growth: float) -> tuple[float, float]:
            radius = confseq.mixture_radius(se / math.sqrt(growth), self.scale, alpha)
            return math.expm1(log_change - radius), math.expm1(log_change + radius)

        low, high = interval_at(1.0)
        return _Reading(math.expm1(log_change), low, high, interval_at)


class _QuantileTrack:
    """The q-quantile of one value per request in each arm, from lists kept sorted as pairs arrive; the relative
    change is bounded by both arms' sequences."""

    def __init__(self, spec: MetricSpec) -> None:
        assert spec.per_request is not None
        self.value, self.q = spec.per_request, spec.q
        self.base: list[float] = []
        self.cand: list[float] = []
        self.seen: set[int] = set()

    @property
    def tasks(self) -> int:
        return len(self.seen)

    def add(self, task: int, base: RequestRecord, cand: RequestRecord) -> None:
        if not (base.ok and cand.ok):
            return
        vb, vc = self.value(base), self.value(cand)
        if vb is not None:
            bisect.insort(self.base, vb)
        if vc is not None:
            bisect.insort(self.cand, vc)
        if vb is not None or vc is not None:
            self.seen.add(task)

    def read(self, alpha: float) -> _Reading | None:
        ordered_b, ordered_c, q = self.base, self.cand, self.q
        if not ordered_b or not ordered_c:
            return None
        value_b = ordered_b[stats.quantile_rank(len(ordered_b), q)]
        value_c = ordered_c[stats.quantile_rank(len(ordered_c), q)]
        if value_b <= 0:
            return None

        def bounds(ordered: list[float], growth: float) -> tuple[float, float]:
            """The arm's bounds had it `growth` times the draws, read off the draws so far at the same ranks."""
            n = len(ordered)
            scaled = max(1, round(n * growth))
            low_count, high_count = confseq.rank_band(scaled, q, alpha / 2)
            low = ordered[math.ceil(low_count / growth) - 1] if low_count >= 1 else 0.0
            high_rank = math.floor(high_count / growth)
            return max(0.0, low), ordered[high_rank] if high_count < scaled and high_rank < n else math.inf

        def interval_at(growth: float) -> tuple[float, float]:
            low_b, high_b = bounds(ordered_b, growth)
            low_c, high_c = bounds(ordered_c, growth)
            return low_c / high_b - 1, (high_c / low_b - 1) if low_b > 0 else math.inf

        low, high = interval_at(1.0)
        return _Reading(value_c / value_b - 1, low, high, interval_at)


class _ErrorTrack:
    """Failed requests per arm; the change in rate (absolute) bounded by both arms' beta-binomial sequences."""

    def __init__(self) -> None:
        self.pairs = self.errors_b = self.errors_c = 0
        self.seen: set[int] = set()

    @property
    def tasks(self) -> int:
        return len(self.seen)

    def add(self, task: int, base: RequestRecord, cand: RequestRecord) -> None:
        self.pairs += 1
        self.errors_b += not base.ok
        self.errors_c += not cand.ok
        self.seen.add(task)

    def read(self, alpha: float) -> _Reading | None:
        if not self.pairs:
            return None
        n, errors_b, errors_c = self.pairs, self.errors_b, self.errors_c

        def interval_at(growth: float) -> tuple[float, float]:
            scaled = max(1, round(n * growth))
            low_b, high_b = confseq.proportion_sequence(round(errors_b * scaled / n), scaled, alpha / 2)
            low_c, high_c = confseq.proportion_sequence(round(errors_c * scaled / n), scaled, alpha / 2)
            return low_c - high_b, high_c - low_b

        low, high = interval_at(1.0)
        return _Reading((errors_c - errors_b) / n, low, high, interval_at)


class _LosslessTrack:
    """Distinct tasks whose outputs were identical in every finished pair; the fraction, not a change."""

    def __init__(self) -> None:
        self.identical: dict[int, bool] = {}
        self.same = 0

    @property
    def tasks(self) -> int:
        return len(self.identical)

    def add(self, task: int, base: RequestRecord, cand: RequestRecord) -> None:
        if not (base.ok and cand.ok):
            return
        before = self.identical.get(task, True)
        now = before and base.output_sha256 == cand.output_sha256
        self.same += int(now) - int(before and task in self.identical)
        self.identical[task] = now

    def read(self, alpha: float) -> _Reading | None:
        n, same = len(self.identical), self.same
        if not n:
            return None

        def interval_at(growth: float) -> tuple[float, float]:
            scaled = max(1, round(n * growth))
            return confseq.proportion_sequence(round(same * scaled / n), scaled, alpha)

        low, high = interval_at(1.0)
        return _Reading(same / n, low, high, interval_at)


def _track(rule: Rule, task_count: int) -> _Track:
    if rule.metric == LOSSLESS:
        return _LosslessTrack()
    spec = METRICS[rule.metric]
    if spec.kind == "error_rate":
        return _ErrorTrack()
    if spec.kind == "ratio":
        assert rule.max_worse is not None
        return _RatioTrack(spec, max(rule.max_worse, SCALE_FLOOR), task_count)
    return _QuantileTrack(spec)


class SequentialMonitor:
    """Pairs records by schedule index as they arrive and looks at the complete prefix every `look_every` pairs.

    `observe` is an O(1) append except at a look; a look costs a few numpy passes over the pairs so far (its cost
    is measured in bench/RESULTS.md). `stopped` turns true at the first look that decides the verdict or finds
    every undecided rule limited by the task set."""

    def __init__(self, design: SequentialDesign, baseline: str, candidate: str, temperature: float, task_count: int,
                 warmup: int = 0) -> None:
        check_gate(design.gate)
        self.design = design
        self.arms = (baseline, candidate)
        self.temperature = temperature
        self.task_count = task_count
        self.tracks = [_track(rule, task_count) for rule in design.gate.rules]
        self.pairs = 0
        self.latest: Look | None = None
        self.decision: Look | None = None
        self._looks = 0
        self._next = warmup
        self._waiting: dict[str, dict[int, RequestRecord]] = {baseline: {}, candidate: {}}
        self._task_index: dict[str, int] = {}
        self._bounds = [(-math.inf, math.inf)] * len(self.tracks)

    @property
    def stopped(self) -> bool:
        return self.decision is not None

    @property
    def tasks(self) -> int:
        return len(self._task_index)

    def observe(self, record: RequestRecord) -> None:
        waiting = self._waiting.get(record.arm)
        if waiting is None or record.warmup:
            return
        waiting[record.index] = record
        base, cand = self._waiting.values()
        while self._next in base and self._next in cand:
            self.add_pair(base.pop(self._next), cand.pop(self._next))
            self._next += 1
            if self.pairs % self.design.look_every == 0:
                self.look()

    def add_pair(self, base: RequestRecord, cand: RequestRecord) -> None:
        if base.task_id != cand.task_id:
            raise UserError(f"request {base.index}: baseline ran task {base.task_id!r}, candidate {cand.task_id!r}; "
                            "the arms did not replay the same schedule")
        task = self._task_index.setdefault(base.task_id, len(self._task_index))
        for track in self.tracks:
            track.add(task, base, cand)
        self.pairs += 1

    def finish(self) -> Look:
        """After the run: pairs beyond the prefix (an index one arm never recorded ends the prefix), then a look."""
        base, cand = self._waiting.values()
        for index in sorted(base.keys() & cand.keys()):
            self.add_pair(base.pop(index), cand.pop(index))
        return self.look()

    def look(self) -> Look:
        """Every rule on the pairs so far."""
        self._looks += 1
        rules = tuple(self._rule(index, rule, track)
                      for index, (rule, track) in enumerate(zip(self.design.gate.rules, self.tracks, strict=True)))
        statuses = {r.status for r in rules}
        verdict: Status = "FAIL" if "FAIL" in statuses else "INCONCLUSIVE" if "INCONCLUSIVE" in statuses else "PASS"
        undecided = [r for r in rules if r.status == "INCONCLUSIVE"]
        stop: StopReason | None = ("decided" if verdict != "INCONCLUSIVE"
                                   else "task_set" if all(r.task_set_limited for r in undecided) else None)
        look = Look(self._looks, self.pairs, self.tasks, rules, verdict, stop)
        self.latest = look
        if stop is not None and self.decision is None:
            self.decision = look
        return look

    def _narrowed(self, index: int, track: _Track, low: float, high: float) -> tuple[float, float]:
        """The interval intersected with every earlier one from `min_tasks` on: the truth lies in all of them at
        once with probability 1 - alpha, so their intersection holds it too, and a rule once decided stays decided
        (the pairs that finish after the stop cannot undo the decision the run stopped on)."""
        if track.tasks < self.design.min_tasks:
            return low, high
        before_low, before_high = self._bounds[index]
        self._bounds[index] = max(low, before_low), min(high, before_high)
        return self._bounds[index]

    def _rule(self, index: int, rule: Rule, track: _Track) -> RuleState:
        alpha = self.design.alpha
        if rule.metric == LOSSLESS:
            assert rule.at_least is not None
            limit = rule.at_least
            if self.temperature != 0:
                return RuleState(rule.metric, limit, "NOT_APPLICABLE", "temperature > 0: outputs may differ by design")
        else:
            assert rule.max_worse is not None
            limit = rule.max_worse
        per_task = self.temperature == 0 and rule.metric in (LOSSLESS, "accept_length")
        units = track.tasks if per_task else self.pairs
        reading = track.read(alpha)
        if reading is None or math.isnan(reading.low) or math.isnan(reading.high):
            return RuleState(rule.metric, limit, "INCONCLUSIVE", "no paired data", units=units, per_task=per_task)
        if rule.metric == LOSSLESS:
            census = track.tasks >= self.task_count

            def in_terms(low: float, high: float) -> tuple[float, float]:
                return low, high

            def decide(low: float, high: float, growth: float) -> RuleStatus:
                if high < limit:
                    return "FAIL"
                if reading.change >= limit and (low >= limit or track.tasks * growth >= self.task_count):
                    return "PASS"
                return "INCONCLUSIVE"

            estimate = reading.change
            low, high = self._narrowed(index, track, reading.low, reading.high)
            detail = (f"{estimate:.4f} identical over {track.tasks} tasks, always-valid interval "
                      f"[{low:.4f}, {high:.4f}]" + (", every task of the set seen" if census else ""))
        else:
            sign = -1.0 if METRICS[rule.metric].higher_is_better else 1.0

            def in_terms(low: float, high: float) -> tuple[float, float]:
                worse_low, worse_high = sorted((sign * low, sign * high))
                return worse_low, worse_high

            def decide(low: float, high: float, growth: float) -> RuleStatus:
                return _status(low, high, limit)

            estimate = sign * reading.change
            low, high = self._narrowed(index, track, *in_terms(reading.low, reading.high))
            unit = " (relative)" if rule.metric != "error_rate" else ""
            detail = (f"worse by {estimate:+.4f}{unit}, always-valid interval [{low:+.4f}, {high:+.4f}], "
                      f"limit {limit:.4f}")

        def status_at(growth: float) -> RuleStatus:
            return decide(*in_terms(*reading.interval_at(growth)), growth)

        status = decide(low, high, 1.0)
        if track.tasks < self.design.min_tasks and status != "INCONCLUSIVE":
            status = "INCONCLUSIVE"
            detail += f"; {track.tasks} of the {self.design.min_tasks} tasks before a decision"
        limited = status == "INCONCLUSIVE" and per_task and self.tasks >= self.task_count
        if limited:
            detail += (f"; all {self.task_count} tasks seen, and at temperature 0 a repeated task repeats its output "
                       "and rounds: more distinct tasks, not more requests, would decide it")
        return RuleState(rule.metric, limit, status, detail, estimate, low, high, units, per_task, limited, status_at)


def rule_result(state: RuleState, task_count: int) -> RuleResult:
    """A rule's state as the verdict records it, with how much more data would decide it; a rule that would need
    more distinct tasks than the set holds is limited by the task set even before every task has been seen."""
    needed = units_to_decide(state)
    detail, limited = state.detail, state.task_set_limited
    if state.per_task and needed is not None and needed > task_count and not limited:
        detail += (f"; about {needed} distinct tasks would decide it and the set has {task_count}: the task set, not "
                   "the request count, keeps it undecided")
        limited = True
    return RuleResult(metric=state.metric, limit=state.limit, status=state.status, detail=detail,
                      tasks_needed=needed if state.per_task else None,
                      requests_needed=needed if not state.per_task else None,
                      low=state.low, high=state.high, task_set_limited=limited)


class SequentialReport(BaseModel):
    """How a sequential run was decided; restated in its verdict."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = METHOD
    design: SequentialDesign
    looks: int = Field(description="looks up to and including the one the run stopped on (or its last)")
    stopped: Literal["decided", "task_set", "end"] = Field(
        description="decided: the verdict was decided; task_set: every undecided rule was limited by the task set; "
                    "end: the run ended first (its maximum, --duration or an interrupt)")
    stopped_after_pairs: int = Field(description="paired requests at that look")
    verdict_when_stopped: Status
    pairs: int = Field(description="paired requests judged: requests in flight at the stop finished and count too")


def replay(records: Iterable[RequestRecord], design: SequentialDesign, baseline: str, candidate: str,
           config: RunConfig) -> SequentialMonitor:
    """The monitor as it was during the run: records in the order the run wrote them."""
    monitor = SequentialMonitor(design, baseline, candidate, config.sampling.temperature, config.tasks.size,
                                config.warmup)
    for record in records:
        monitor.observe(record)
    return monitor


def judge_sequential(records: Sequence[RequestRecord], baseline: str, candidate: str, gate: Gate,
                     config: RunConfig) -> tuple[Judgement, SequentialReport]:
    """The verdict of a sequential run under `gate`: the fixed-n table of every metric for reading, the rules
    decided on always-valid intervals over every pair (valid at any stopping time, the run's own included)."""
    design = config.sequential
    if design is None:
        raise UserError(f"run {config.run_id} was not run with --until-decided")
    run = replay(records, design, baseline, candidate, config)
    stop = run.decision
    end = run.finish()
    final = end if gate == design.gate else replay(
        records, design.model_copy(update={"gate": gate}), baseline, candidate, config).finish()
    at_stop = stop or end
    fixed = judge([r for r in records if r.arm == baseline], [r for r in records if r.arm == candidate], gate,
                  config.sampling.temperature)
    rules = tuple(rule_result(state, config.tasks.size) for state in final.rules)
    needed = [r.tasks_needed for r in rules if r.status == "INCONCLUSIVE" and r.tasks_needed is not None]
    judgement = fixed.model_copy(update={"verdict": final.verdict, "rules": rules,
                                         "tasks_needed": max(needed) if needed else None})
    report = SequentialReport(design=design, looks=at_stop.number, stopped=stop.stop if stop and stop.stop else "end",
                              stopped_after_pairs=at_stop.pairs, verdict_when_stopped=at_stop.verdict,
                              pairs=final.pairs)
    return judgement, report
