"""Sequential verdicts of a load test: the monitor on synthetic paired records (pairing, looks, stopping, the
task-set limit, the verdict of a run). The confidence sequences on their own are in test_confseq.py."""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from rich.console import Console

from dfserve.errors import FieldError, UserError
from dfserve.loadtest.config import SequentialDesign
from dfserve.loadtest.judge import DEFAULT_GATE
from dfserve.loadtest.progress import Progress
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.runner import RunPlan
from dfserve.loadtest.sequential import SequentialMonitor, judge_sequential
from dfserve.tasks import TaskSet
from dfserve.verdict import bootstrap
from dfserve.verdict.gate import Gate, Rule
from dfserve.verdict.pairs import MetricSpec, Pairs
from dfserve.verdict.sequential import rule_result, units_to_decide
from dfserve.verdict.tracks import ErrorTrack, LosslessTrack
from tests.synthetic import run_config, synthetic

ACCEPT = Gate(rules=(Rule(metric="accept_length", max_worse=0.02),))


def pair_up(base: list[RequestRecord], cand: list[RequestRecord]) -> list[RequestRecord]:
    return [r for pair in zip(base, cand, strict=True) for r in pair]


def monitor(gate: Gate = DEFAULT_GATE, tasks: int = 164, temperature: float = 0.0, **design: int) -> SequentialMonitor:
    return SequentialMonitor(SequentialDesign(gate=gate, **design), "a", "b", temperature, tasks)


def feed(m: SequentialMonitor, records: list[RequestRecord]) -> SequentialMonitor:
    for r in records:
        m.observe(r)
        if m.stopped:
            break
    return m


def test_an_undertrained_drafter_fails_early_and_the_decision_is_the_first_look_that_decides() -> None:
    m = feed(monitor(), pair_up(synthetic("a", 400, 9.0, seed=1, tasks=164), synthetic("b", 400, 6.0, seed=2, tasks=164)))
    assert m.decision is not None and m.decision.verdict == "FAIL" and m.decision.stop == "decided"
    assert m.decision.pairs <= 48 and m.pairs == m.decision.pairs
    accept = next(r for r in m.decision.rules if r.metric == "accept_length")
    assert accept.status == "FAIL" and accept.low is not None and accept.low > 0.1


def test_no_rule_is_decided_before_the_minimum_number_of_tasks() -> None:
    m = feed(monitor(min_tasks=40, look_every=8), pair_up(synthetic("a", 400, 9.0, seed=1, tasks=164),
                                                            synthetic("b", 400, 6.0, seed=2, tasks=164)))
    assert m.decision is not None and m.decision.pairs == 40
    early = monitor(min_tasks=40, look_every=8)
    feed(early, pair_up(synthetic("a", 32, 9.0, seed=1, tasks=164), synthetic("b", 32, 6.0, seed=2, tasks=164)))
    assert early.latest is not None and early.latest.verdict == "INCONCLUSIVE" and not early.stopped
    assert "32 of the 40 tasks" in early.latest.rules[0].detail


def test_looks_see_the_schedule_prefix_whatever_order_records_arrive_in() -> None:
    records = pair_up(synthetic("a", 200, 9.0, seed=1, tasks=164), synthetic("b", 200, 8.6, seed=2, tasks=164))
    mixed = records[:]
    random.Random(4).shuffle(mixed)
    in_order, shuffled = monitor(ACCEPT), monitor(ACCEPT)
    for r, s in zip(records, mixed, strict=True):
        in_order.observe(r)
        shuffled.observe(s)
    assert in_order.decision is not None and shuffled.decision is not None
    assert in_order.decision.pairs == shuffled.decision.pairs == 176  # the first look after all 164 tasks
    assert in_order.decision.rules == shuffled.decision.rules
    assert in_order.latest is not None and shuffled.latest is not None
    assert in_order.latest.pairs == shuffled.latest.pairs == 192 and in_order.latest.rules == shuffled.latest.rules
    first_half = monitor(ACCEPT)
    for r in mixed[:200]:
        first_half.observe(r)
    arrived = {(r.arm, r.index) for r in mixed[:200]}
    complete = [i for i in range(200) if ("a", i) in arrived and ("b", i) in arrived]
    prefix = next(i for i in range(200) if i not in complete)
    assert first_half.pairs == prefix < len(complete)  # a gap in the schedule holds back the pairs after it


def test_pairs_of_different_tasks_are_refused() -> None:
    base = synthetic("a", 4, 9.0, seed=1)
    cand = [r.model_copy(update={"arm": "b", "task_id": "other"}) for r in base]
    with pytest.raises(UserError, match="same schedule"):
        feed(monitor(), pair_up(base, cand))


def test_warmup_records_and_other_arms_are_ignored() -> None:
    m = monitor(ACCEPT, look_every=4)
    warm = [r.model_copy(update={"warmup": True}) for r in synthetic("a", 4, 9.0, seed=1)]
    other = [r.model_copy(update={"arm": "c"}) for r in synthetic("a", 4, 9.0, seed=1)]
    feed(m, warm + other)
    assert m.pairs == 0 and m.latest is None


def test_at_temperature_zero_an_exhausted_task_set_stops_a_run_repeats_cannot_decide() -> None:
    base = synthetic("a", 200, 9.0, seed=1, tasks=20, noise=0.3)
    cand = synthetic("b", 200, 9.0, seed=2, tasks=20, noise=0.3)
    m = feed(monitor(ACCEPT, tasks=20, look_every=4), pair_up(base, cand))
    assert m.decision is not None and m.decision.stop == "task_set" and m.decision.verdict == "INCONCLUSIVE"
    assert m.decision.pairs == 20
    rule = m.decision.rules[0]
    assert rule.task_set_limited and "more distinct tasks, not more requests" in rule.detail
    needed = units_to_decide(rule)
    assert needed is not None and needed > 20
    hot = feed(monitor(ACCEPT, tasks=20, temperature=0.7, look_every=4), pair_up(base, cand))
    assert not hot.stopped and hot.pairs == 200  # above temperature 0 every request is new evidence
    with_latency = feed(monitor(Gate(rules=(*ACCEPT.rules, Rule(metric="tpot_p95", max_worse=0.001))), tasks=20,
                                look_every=4), pair_up(base, cand))
    assert not with_latency.stopped  # TPOT still gains from repeats


def test_losslessness_passes_on_the_whole_task_set_and_a_lossy_candidate_fails() -> None:
    gate = Gate(rules=(Rule(metric="lossless_fraction", at_least=0.99),))
    base = synthetic("a", 60, 9.0, seed=1, tasks=40)
    same = feed(monitor(gate, tasks=40, look_every=4), pair_up(base, synthetic("b", 60, 9.0, seed=1, tasks=40)))
    assert same.decision is not None and same.decision.verdict == "PASS" and same.decision.pairs == 40
    lossy = feed(monitor(gate, tasks=164, look_every=4), pair_up(base, synthetic("b", 60, 9.0, seed=1, tasks=40,
                                                                               lossy=0.5)))
    assert lossy.decision is not None and lossy.decision.verdict == "FAIL"
    hot = monitor(gate, temperature=0.7)
    feed(hot, pair_up(base, synthetic("b", 60, 9.0, seed=1, tasks=40, lossy=0.5)))
    assert hot.latest is not None and hot.latest.rules[0].status == "NOT_APPLICABLE"


def test_a_replayed_captures_greedy_requests_decide_losslessness_among_sampled_ones() -> None:
    """The run's temperature is the loosest replayed; the requests that were greedy still decide losslessness, live
    and when the run is replayed from its records."""
    gate = Gate(rules=(Rule(metric="lossless_fraction", at_least=0.99),))

    def mixed(records: list[RequestRecord]) -> list[RequestRecord]:
        return [r.model_copy(update={"temperature": 0.0 if r.index % 3 == 0 else 0.7}) for r in records]

    records = pair_up(mixed(synthetic("a", 200, 9.0, seed=1, tasks=200)),
                      mixed(synthetic("b", 200, 9.0, seed=1, tasks=200, lossy=0.5)))
    lossy = feed(monitor(gate, temperature=0.7, look_every=4), records)
    assert lossy.decision is not None and lossy.decision.verdict == "FAIL"
    config = run_config("mixed").model_copy(update={
        "sequential": SequentialDesign(gate=gate, look_every=4),
        "sampling": run_config("mixed").sampling.model_copy(update={"temperature": 0.7})})
    replayed = judge_sequential(records[: 2 * lossy.decision.pairs], "a", "b", gate, config)
    assert replayed.judgement.verdict == "FAIL" and replayed.sequential is not None
    assert replayed.sequential.stopped_after_pairs == lossy.decision.pairs


def test_a_run_mixing_temperatures_passes_only_once_its_greedy_pairs_are_judged() -> None:
    """Sampled requests first, greedy ones later: acceptance alone would pass before the first greedy pair, on a
    candidate that changes greedy outputs. A run that mixes them awaits the greedy pairs (live and replayed), and
    one that ended without any leaves losslessness not applicable."""
    gate = Gate(rules=(*ACCEPT.rules, Rule(metric="lossless_fraction", at_least=0.99)))

    def mixed(records: list[RequestRecord]) -> list[RequestRecord]:
        return [r.model_copy(update={"temperature": 0.7 if r.index < 120 else 0.0}) for r in records]

    records = pair_up(mixed(synthetic("a", 200, 9.0, seed=1, tasks=200)),
                      mixed(synthetic("b", 200, 9.0, seed=1, tasks=200, lossy=0.5)))
    blind = feed(SequentialMonitor(SequentialDesign(gate=gate, look_every=4), "a", "b", 0.7, 200), records)
    assert blind.decision is not None and blind.decision.verdict == "PASS" and blind.decision.pairs <= 120
    awaiting = feed(SequentialMonitor(SequentialDesign(gate=gate, look_every=4), "a", "b", 0.7, 200,
                                      mixes_greedy=True), records)
    assert awaiting.decision is not None and awaiting.decision.verdict == "FAIL" and awaiting.decision.pairs > 120
    early = SequentialMonitor(SequentialDesign(gate=gate, look_every=4), "a", "b", 0.7, 200, mixes_greedy=True)
    feed(early, records[:200])
    lossless = early.look().rules[1]
    assert lossless.status == "INCONCLUSIVE" and "no greedy pair yet in 100 pairs" in lossless.detail
    assert early.finish().rules[1].status == "NOT_APPLICABLE"
    sampling = run_config("mixed").sampling.model_copy(update={"temperature": 0.7, "min_temperature": 0.0})
    assert sampling.mixes_greedy and "temperature 0 to 0.7" in sampling.describe()
    config = run_config("mixed").model_copy(update={"sequential": SequentialDesign(gate=gate, look_every=4),
                                                    "sampling": sampling})
    replayed = judge_sequential(records[: 2 * awaiting.decision.pairs], "a", "b", gate, config)
    assert replayed.judgement.verdict == "FAIL" and replayed.sequential is not None
    assert replayed.sequential.stopped_after_pairs == awaiting.decision.pairs


def test_a_replayed_capture_run_is_judged_from_its_records_as_it_was_live() -> None:
    """The run's monitor started as the run's temperature says (the loosest replayed); its verdict replayed from
    the records starts the same, so a rule's needs read the same: requests, not tasks, where sampled tasks exist
    even if only greedy ones were sent."""
    def mixed(records: list[RequestRecord]) -> list[RequestRecord]:
        return [r.model_copy(update={"temperature": 0.0 if int(r.task_id[1:]) < 30 else 0.7}) for r in records]

    base, cand = mixed(synthetic("a", 30, 9.0, seed=1)), mixed(synthetic("b", 30, 9.0, seed=2))
    design = SequentialDesign(gate=DEFAULT_GATE, look_every=4)
    live = monitor(temperature=0.7, tasks=40, look_every=4)
    feed(live, pair_up(base, cand))
    config = run_config("mixed").model_copy(update={
        "sequential": design, "sampling": run_config("mixed").sampling.model_copy(update={"temperature": 0.7})})
    config = config.model_copy(update={"tasks": config.tasks.model_copy(update={"size": 40})})
    replayed = judge_sequential(pair_up(base, cand), "a", "b", DEFAULT_GATE, config).judgement
    ended = [rule_result(state, 40) for state in live.finish().rules]
    assert [(r.status, r.tasks_needed, r.requests_needed, r.task_set_limited) for r in replayed.rules] == [
        (r.status, r.tasks_needed, r.requests_needed, r.task_set_limited) for r in ended]
    assert all(r.tasks_needed is None for r in ended)


def test_error_rates_fail_on_errors_and_need_many_requests_to_pass() -> None:
    gate = Gate(rules=(Rule(metric="error_rate", max_worse=0.01),))
    base = synthetic("a", 400, 9.0, seed=1)
    failing = feed(monitor(gate), pair_up(base, synthetic("b", 400, 9.0, seed=1, errors=0.3)))
    assert failing.decision is not None and failing.decision.verdict == "FAIL"
    clean = feed(monitor(gate), pair_up(base, synthetic("b", 400, 9.0, seed=1)))
    assert clean.latest is not None and clean.latest.verdict == "INCONCLUSIVE"  # 400 clean pairs bound it by 1.8%
    needed = units_to_decide(clean.latest.rules[0])
    assert needed is not None and 600 < needed < 1200


def test_tpot_regression_fails_on_quantile_sequences() -> None:
    gate = Gate(rules=(Rule(metric="tpot_p95", max_worse=0.05),))
    m = feed(monitor(gate), pair_up(synthetic("a", 400, 9.0, seed=1), synthetic("b", 400, 9.0, seed=1, tpot=0.014)))
    assert m.decision is not None and m.decision.verdict == "FAIL"


def test_a_gate_on_per_token_samples_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(FieldError, match="gate: rule itl_per_token_p95: deciding as the run goes needs one value"):
        monitor(Gate(rules=(Rule(metric="itl_per_token_p95", max_worse=0.05),)))


def test_a_sequential_plan_needs_exactly_two_arms() -> None:
    design = SequentialDesign(gate=DEFAULT_GATE)
    with pytest.raises(UserError, match="exactly two arms"):
        RunPlan(arms=(("a", "http://x"), ("b", "http://y"), ("c", "http://z")), api="native",
                task_set=TaskSet("t", ()), num_requests=10, warmup=0, sampling=run_config("r").sampling,
                load=run_config("r").load, out=Path("."), sequential=design)


@pytest.mark.parametrize(("field", "value"), [("duration_s", float("nan")), ("duration_s", 0.0),
                                            ("request_timeout_s", 0.0), ("request_timeout_s", float("nan")),
                                            ("request_timeout_s", float("inf"))])
def test_a_plan_refuses_times_that_are_not_finite_and_positive(field: str, value: float) -> None:
    with pytest.raises(FieldError, match="must be a finite number > 0") as caught:
        RunPlan(arms=(("a", "http://x"), ("b", "http://y")), api="native", task_set=TaskSet("t", ()), num_requests=10,
                warmup=0, sampling=run_config("r").sampling, load=run_config("r").load, out=Path("."),
                **{field: value})  # type: ignore[arg-type]
    assert caught.value.field == field


def test_the_verdict_of_a_sequential_run_replays_its_looks_and_judges_every_pair() -> None:
    config = run_config("seq").model_copy(update={"sequential": SequentialDesign(gate=DEFAULT_GATE)})
    base = synthetic("zlab", 70, 9.0, seed=1, tasks=164)
    cand = synthetic("inhouse", 70, 6.0, seed=2, tasks=164)
    records = pair_up(base, cand)
    outcome = judge_sequential(records, "zlab", "inhouse", DEFAULT_GATE, config)
    judgement, report = outcome.judgement, outcome.sequential
    assert report is not None and judgement.verdict == "FAIL" and report.stopped == "decided" and report.verdict_when_stopped == "FAIL"
    assert judgement.tasks_needed is None  # decided: no count of tasks that would decide it
    assert report.stopped_after_pairs <= 48 and report.pairs == 70 and report.design.look_every == 16
    accept = next(r for r in judgement.rules if r.metric == "accept_length")
    assert accept.low is not None and accept.low > 0.2 and "always-valid" in accept.detail
    assert {m.metric for m in judgement.metrics} >= {"accept_length", "ttft_p50"}  # the fixed-n table, for reading
    lenient = Gate(rules=(Rule(metric="accept_length", max_worse=0.5),))
    outcome = judge_sequential(records, "zlab", "inhouse", lenient, config)
    judgement, report = outcome.judgement, outcome.sequential
    assert report is not None and judgement.verdict == "PASS" and report.stopped == "decided" and report.verdict_when_stopped == "FAIL"
    with pytest.raises(FieldError, match=r"^sequential: run fixed has no sequential design") as fixed:
        judge_sequential(records, "zlab", "inhouse", DEFAULT_GATE, run_config("fixed"))
    assert fixed.value.render({"sequential": "--until-decided"}).startswith("--until-decided: run fixed has no")


def test_the_verdict_says_when_more_distinct_tasks_than_the_set_holds_would_decide_a_rule() -> None:
    config = run_config("seq").model_copy(update={"sequential": SequentialDesign(gate=ACCEPT)})
    records = pair_up(synthetic("zlab", 48, 9.0, seed=1, tasks=48, noise=0.3),
                      synthetic("inhouse", 48, 9.0, seed=2, tasks=48, noise=0.3))
    outcome = judge_sequential(records, "zlab", "inhouse", ACCEPT, config)
    rule = outcome.judgement.rules[0]
    assert outcome.sequential is not None and outcome.sequential.stopped == "end" and rule.status == "INCONCLUSIVE"
    assert rule.tasks_needed is not None and rule.tasks_needed > config.tasks.size and rule.requests_needed is None
    assert rule.task_set_limited and "the task set, not the request count, keeps it undecided" in rule.detail
    roomy = config.model_copy(update={"tasks": config.tasks.model_copy(update={"size": 100_000})})
    rule = judge_sequential(records, "zlab", "inhouse", ACCEPT, roomy).judgement.rules[0]
    assert not rule.task_set_limited and "task set" not in rule.detail


def test_the_live_view_shows_each_rule_interval_and_the_requests_to_a_decision() -> None:
    out = io.StringIO()
    m = monitor(Gate(rules=(*ACCEPT.rules, Rule(metric="error_rate", max_worse=0.01))))
    with Progress(["a", "b"], 400, Console(file=out, force_terminal=True, width=160), m) as progress:
        for r in pair_up(synthetic("a", 64, 9.0, seed=1, tasks=164), synthetic("b", 64, 8.8, seed=2, tasks=164)):
            progress.observe(r)
            m.observe(r)
        text = "".join(segment.text for segment in Console(width=160).render(progress._render()))
    assert "gate at look 4: 64 pairs over 64 tasks" in text
    assert "accept_length" in text and "error_rate" in text and "more requests" in text
    error_rule = next(r for r in m.latest.rules if r.metric == "error_rate")  # type: ignore[union-attr]
    assert f"{error_rule.estimate:+.3f} [{error_rule.low:+.3f}, {error_rule.high:+.3f}]" in text


@dataclass(frozen=True)
class Unit:
    ok: bool
    output: str | None


def test_pairs_whose_outputs_are_not_known_are_never_counted_identical() -> None:
    """Both designs count only finished pairs whose two outputs are known: two unknowns are not two equal outputs."""
    spec: MetricSpec[Unit] = MetricSpec("identical outputs", "identical", output=lambda u: u.output)
    rows = [(Unit(True, "a"), Unit(True, "a")), (Unit(True, None), Unit(True, None)), (Unit(True, "b"), Unit(True, None)),
            (Unit(False, "c"), Unit(True, "c")), (Unit(True, "d"), Unit(True, "e"))]
    pairs = Pairs.match(("base", "cand"), ((i, f"t{i}", b) for i, (b, _) in enumerate(rows)),
                        ((i, f"t{i}", c) for i, (_, c) in enumerate(rows)), deterministic=True)
    lossless = bootstrap.identical(spec, pairs)
    assert (lossless.pairs, lossless.identical, lossless.differing_tasks) == (2, 1, ["t4"])
    track = LosslessTrack(spec)
    for i, (b, c) in enumerate(rows):
        track.add(i, b, c)
    assert (track.tasks, track.same) == (2, 1)


def test_a_design_that_would_decide_on_fewer_than_five_tasks_is_refused() -> None:
    """A fixed-n verdict over fewer than 5 tasks decides nothing: a sequential one may not either."""
    with pytest.raises(ValidationError, match="min_tasks"):
        SequentialDesign(gate=DEFAULT_GATE, min_tasks=4)
    assert SequentialDesign(gate=DEFAULT_GATE, min_tasks=5).min_tasks == 5


def test_errors_that_come_by_task_are_fewer_events_than_their_count() -> None:
    """Six candidate failures in 2,144 pairs of 16 tasks: spread over six tasks they bound the rise within the
    1-point rule; all in one task (a prompt it always fails), they do not, as the fixed-n design has it."""
    ok, failed = SimpleNamespace(ok=True), SimpleNamespace(ok=False)
    clustered, spread = ErrorTrack[SimpleNamespace](0.01, 16), ErrorTrack[SimpleNamespace](0.01, 16)
    for i in range(2144):
        clustered.add(i % 16, ok, failed if i % 16 == 0 and i // 16 < 6 else ok)
        spread.add(i % 16, ok, failed if i in (0, 357, 714, 1071, 1428, 1785) else ok)
    by_task, apart = clustered.read(0.05), spread.read(0.05)
    assert by_task is not None and apart is not None and by_task.change == apart.change
    assert apart.high <= 0.01 < by_task.high
