"""The sequential design: the gate decided after every batch of pairs, so a run can stop once it is.

`Monitor` takes each side's units as they finish, pairs them by schedule index, and every `look_every` pairs puts
an always-valid interval (`confseq`) on each gate rule. Looks are taken on the schedule's
complete prefix (pairs 0..k, whatever finished first): fast requests finish first, and a look at them would favour
short outputs, while the prefix is a random sample of the task set in the seeded order. Looks are therefore a pure
function of the pairs in index order, and `Sequential.judge` replays them from the pairs exactly.
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
  with no error at all (where a normal approximation would claim certainty); widened, where errors come by task, to
  the normal mixture over tasks (as the ratios', scale the rule's `max_worse`).
- `lossless_fraction`: beta-binomial over distinct tasks; at temperature 0 a task's output is fixed, so the observed
  fraction also decides PASS once every task of the set has been seen, as the fixed-n rule does.
- quantiles of per-token or per-chunk samples (ITL) are refused: their samples are many per request and dependent.

At temperature 0 a repeated task repeats its output and its verify rounds, so repeats add nothing to acceptance or
losslessness: once every task has been seen, a rule left undecided on those is limited by the task set, and the run
stops when every undecided rule is.

    monitor = Monitor(design, metrics, deterministic=True, task_count=164, first_index=8)
    monitor.offer(0, index, task_id, unit) as each side's unit finishes; stop sending when monitor.stopped
    outcome = Sequential(design, task_count=164, first_index=8).judge(pairs, metrics, gate)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal

from dfserve.errors import FieldError
from dfserve.verdict import wording
from dfserve.verdict.design import Outcome, SequentialDesign, SequentialReport
from dfserve.verdict.fixed import FixedN
from dfserve.verdict.gate import Gate, Rule, check_rules
from dfserve.verdict.kinds import kind_of
from dfserve.verdict.pairs import MetricSpec, Pairs, U, check_same_task
from dfserve.verdict.results import NOT_JUDGED, RuleResult, RuleStatus, Status, fold, overall
from dfserve.verdict.tracks import Track

StopReason = Literal["decided", "task_set"]


def check_sequential_gate(gate: Gate, metrics: Mapping[str, MetricSpec[Any]]) -> None:
    """`check_rules`, and refuse, before anything is sent, a rule the sequential design cannot decide."""
    check_rules(gate, metrics)
    for rule in gate.rules:
        spec = metrics[rule.metric]
        if spec.samples is not None:
            raise FieldError("gate", f"rule {rule.metric}: deciding as the run goes needs one value per request, "
                             f"and {spec.label} has many dependent samples per request")


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


class Monitor(Generic[U]):
    """Pairs units by schedule index as they arrive and looks at the complete prefix every `look_every` pairs.

    `offer` is an O(1) append except at a look; a look costs a few numpy passes over the pairs so far (its cost
    is measured in bench/RESULTS.md). `stopped` turns true at the first look that decides the verdict or finds
    every undecided rule limited by the task set. `deterministic`: a repeated task repeats its outcome
    (temperature 0). `deterministic_pair`, where the pairs mix greedy and sampled requests (live traffic): whether
    one pair is deterministic. The identical-output fraction is then judged on those pairs alone, and the first
    pair before the decision that is not makes the rest of the run non-deterministic for every other metric (whose
    repeated tasks then add evidence), so the looks stay a function of the pairs in order. `awaits_greedy`: greedy
    pairs may still come where none has yet (live traffic; a replayed capture mixing temperatures), so until the
    first the identical-output rule is undecided, not inapplicable, and nothing passes before losslessness has been
    judged; only a run that ended without one (`finish`) leaves it not applicable."""

    def __init__(self, design: SequentialDesign, metrics: Mapping[str, MetricSpec[U]], deterministic: bool,
                 task_count: int, first_index: int = 0,
                 deterministic_pair: Callable[[U, U], bool] | None = None, awaits_greedy: bool = False) -> None:
        check_sequential_gate(design.gate, metrics)
        self.design = design
        self.specs = [metrics[rule.metric] for rule in design.gate.rules]
        self.deterministic = deterministic
        self.deterministic_pair = deterministic_pair
        self.awaits_greedy = awaits_greedy
        self.task_count = task_count
        self.tracks = [kind_of(spec).track(spec, rule.limit, task_count)
                       for rule, spec in zip(design.gate.rules, self.specs, strict=True)]
        self.pairs = 0
        self.greedy_pairs = 0
        """Pairs whose outputs must agree: every pair while `deterministic` (without `deterministic_pair`)."""
        self.latest: Look | None = None
        self.decision: Look | None = None
        self._looks = 0
        self._next = first_index
        self._waiting: tuple[dict[int, tuple[str, U]], dict[int, tuple[str, U]]] = ({}, {})
        self._task_index: dict[str, int] = {}
        self._bounds = [(-math.inf, math.inf)] * len(self.tracks)

    @property
    def stopped(self) -> bool:
        return self.decision is not None

    @property
    def tasks(self) -> int:
        return len(self._task_index)

    def offer(self, side: int, index: int, task_id: str, unit: U) -> None:
        """One side's unit (0: baseline, 1: candidate) at its place in the schedule."""
        self._waiting[side][index] = (task_id, unit)
        base, cand = self._waiting
        while self._next in base and self._next in cand:
            self._add(self._next, base.pop(self._next), cand.pop(self._next))
            self._next += 1
            if self.pairs % self.design.look_every == 0:
                self.look()

    def _add(self, index: int, base: tuple[str, U], cand: tuple[str, U]) -> None:
        check_same_task(index, base[0], cand[0])
        greedy = (self.deterministic_pair(base[1], cand[1]) if self.deterministic_pair is not None
                  else self.deterministic)
        if self.deterministic and not greedy and self.decision is None:
            self.deterministic = False
        task = self._task_index.setdefault(base[0], len(self._task_index))
        for rule, track in zip(self.design.gate.rules, self.tracks, strict=True):
            if greedy or rule.at_least is None:  # outputs are compared only where they must agree
                track.add(task, base[1], cand[1])
        self.greedy_pairs += greedy
        self.pairs += 1

    def finish(self) -> Look:
        """After the run: pairs beyond the prefix (an index one side never recorded ends the prefix), then a look."""
        base, cand = self._waiting
        for index in sorted(base.keys() & cand.keys()):
            self._add(index, base.pop(index), cand.pop(index))
        self.awaits_greedy = False  # the run is over: none will come
        return self.look()

    def look(self) -> Look:
        """Every rule on the pairs so far."""
        self._looks += 1
        rules = tuple(self._rule(index, rule, spec, track) for index, (rule, spec, track)
                      in enumerate(zip(self.design.gate.rules, self.specs, self.tracks, strict=True)))
        verdict = fold(r.status for r in rules)
        undecided = [r for r in rules if r.status == "INCONCLUSIVE"]
        stop: StopReason | None = ("decided" if verdict != "INCONCLUSIVE"
                                   else "task_set" if all(r.task_set_limited for r in undecided) else None)
        look = Look(self._looks, self.pairs, self.tasks, rules, verdict, stop)
        self.latest = look
        if stop is not None and self.decision is None:
            self.decision = look
        return look

    def _narrowed(self, index: int, track: Track[U], low: float, high: float) -> tuple[float, float]:
        """The interval intersected with every earlier one from `min_tasks` on: the truth lies in all of them at
        once with probability 1 - alpha, so their intersection holds it too, and a rule once decided stays decided
        (the pairs that finish after the stop cannot undo the decision the run stopped on)."""
        if track.tasks < self.design.min_tasks:
            return low, high
        before_low, before_high = self._bounds[index]
        self._bounds[index] = max(low, before_low), min(high, before_high)
        return self._bounds[index]

    def _rule(self, index: int, rule: Rule, spec: MetricSpec[U], track: Track[U]) -> RuleState:
        alpha = self.design.alpha
        limit = rule.limit
        identical = rule.at_least is not None
        if identical and not self.deterministic and not self.greedy_pairs:
            if self.awaits_greedy:
                return RuleState(rule.metric, limit, "INCONCLUSIVE", f"no greedy pair yet in {self.pairs} pairs: "
                                 "outputs are compared on greedy requests (not applicable if none comes)")
            return RuleState(rule.metric, limit, "NOT_APPLICABLE", NOT_JUDGED)
        per_task = self.deterministic and spec.fixed_by_task
        units = track.tasks if per_task else self.pairs
        reading = track.read(alpha)
        if reading is None or math.isnan(reading.low) or math.isnan(reading.high):
            return RuleState(rule.metric, limit, "INCONCLUSIVE", "no paired data", units=units, per_task=per_task)
        if identical:
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
            detail = (f"{estimate:.4f} identical over {track.tasks} tasks"
                      + wording.greedy_subset(self.pairs if self.greedy_pairs < self.pairs else None)
                      + f", always-valid interval [{low:.4f}, {high:.4f}]"
                      + (", every task of the set seen" if census else ""))
        else:
            sign = -1.0 if spec.higher_is_better else 1.0

            def in_terms(low: float, high: float) -> tuple[float, float]:
                worse_low, worse_high = sorted((sign * low, sign * high))
                return worse_low, worse_high

            def decide(low: float, high: float, growth: float) -> RuleStatus:
                return _status(low, high, limit)

            estimate = sign * reading.change
            low, high = self._narrowed(index, track, *in_terms(reading.low, reading.high))
            unit = " (relative)" if kind_of(spec).relative else ""
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


@dataclass(frozen=True)
class Sequential:
    """Judges the pairs of a run that looked at them as they came (`design`): the fixed-n table of every metric for
    reading, the rules decided on always-valid intervals over every pair (valid at any stopping time, the run's
    own included). `task_count`: the task set's size; `first_index`: where the schedule's measured pairs start;
    `deterministic_pair`: as the monitor's, when determinism was read pair by pair (`pairs.deterministic` is then
    for the fixed-n table only)."""

    design: SequentialDesign
    task_count: int
    first_index: int = 0
    deterministic_pair: Callable[[Any, Any], bool] | None = None
    started_deterministic: bool | None = None
    """Whether the run's monitor started deterministic, where it read determinism pair by pair without knowing it
    up front (live traffic); None: `pairs.deterministic`, the run's own."""
    awaits_greedy: bool = False
    """As the run's monitor: greedy pairs could come while none had (`Monitor`)."""

    def replay(self, pairs: Pairs[U], metrics: Mapping[str, MetricSpec[U]], gate: Gate) -> Monitor[U]:
        """The monitor as it was during the run: the looks depend only on the pairs in schedule order."""
        started = pairs.deterministic if self.started_deterministic is None else self.started_deterministic
        monitor = Monitor(self.design.model_copy(update={"gate": gate}), metrics, started, self.task_count,
                          self.first_index, self.deterministic_pair, self.awaits_greedy)
        for index, task, base, cand in zip(pairs.index, pairs.task_ids, pairs.base, pairs.cand, strict=True):
            monitor.offer(0, index, task, base)
            monitor.offer(1, index, task, cand)
        return monitor

    def judge(self, pairs: Pairs[Any], metrics: Mapping[str, MetricSpec[Any]], gate: Gate) -> Outcome:
        run = self.replay(pairs, metrics, self.design.gate)
        stop = run.decision
        end = run.finish()
        final = end if gate == self.design.gate else self.replay(pairs, metrics, gate).finish()
        at_stop = stop or end
        fixed = FixedN().judge(pairs, metrics, gate).judgement
        rules = tuple(rule_result(state, self.task_count) for state in final.rules)
        judgement = fixed.model_copy(update={"verdict": final.verdict, "rules": rules,
                                             "tasks_needed": overall(rules)[1]})  # none for a decided verdict
        report = SequentialReport(design=self.design, looks=at_stop.number,
                                  stopped=stop.stop if stop and stop.stop else "end",
                                  stopped_after_pairs=at_stop.pairs, verdict_when_stopped=at_stop.verdict,
                                  pairs=final.pairs)
        return Outcome(judgement, report)
