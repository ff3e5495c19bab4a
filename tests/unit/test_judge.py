"""The load test as a source of pairs, on synthetic records with known effects: rules, verdicts, comparability,
gates, and which records pair (warm-up and cancelled requests do not)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dfserve.errors import UserError
from dfserve.loadtest.config import Sampling, SequentialDesign
from dfserve.loadtest.judge import DEFAULT_GATE, comparability, judge, load_gate
from dfserve.loadtest.records import RequestRecord
from dfserve.verdict.gate import Gate, Rule
from dfserve.verdict.results import RuleResult, overall, tasks_needed
from tests.synthetic import PASSING, run_config, synthetic


def statuses(j: object) -> dict[str, str]:
    return {r.metric: r.status for r in j.rules}  # type: ignore[attr-defined]


def test_identical_arms_pass_every_rule() -> None:
    base = synthetic("a", PASSING, 9.0, seed=1)
    cand = [r.model_copy(update={"arm": "b"}) for r in base]
    j = judge(base, cand, DEFAULT_GATE, temperature=0.0)
    assert j.verdict == "PASS"
    assert set(statuses(j).values()) == {"PASS"}
    accept = next(m for m in j.metrics if m.metric == "accept_length")
    assert accept.change == pytest.approx(0.0) and accept.n_baseline == PASSING
    assert j.lossless.identical == PASSING and j.lossless.differing_tasks == []


def test_a_clearly_worse_drafter_fails_on_acceptance() -> None:
    j = judge(synthetic("zlab", 200, 9.0, seed=1), synthetic("inhouse", 200, 6.0, seed=2), DEFAULT_GATE, 0.0)
    assert j.verdict == "FAIL"
    assert statuses(j)["accept_length"] == "FAIL"
    accept = next(m for m in j.metrics if m.metric == "accept_length")
    assert accept.change_high is not None and accept.change_high < -0.25  # 6/9 - 1 = -0.33
    assert accept.change_low is not None and accept.change_low <= accept.change <= accept.change_high


def test_independent_aa_runs_are_not_fail() -> None:
    j = judge(synthetic("a", 200, 9.0, seed=1), synthetic("b", 200, 9.0, seed=2), DEFAULT_GATE, 0.0)
    assert j.verdict != "FAIL"


def test_an_effect_at_the_limit_is_inconclusive_with_a_sample_estimate() -> None:
    j = judge(synthetic("a", 60, 9.0, seed=1, noise=0.3), synthetic("b", 60, 9.0 * 0.98, seed=2, noise=0.3),
              Gate(rules=(Rule(metric="accept_length", max_worse=0.02),)), 0.0)
    assert j.verdict == "INCONCLUSIVE"
    assert j.tasks_needed is not None and j.tasks_needed > j.tasks


def test_lossy_candidate_is_caught_and_differing_tasks_listed() -> None:
    j = judge(synthetic("a", 200, 9.0, seed=1), synthetic("b", 200, 9.0, seed=1, lossy=0.1), DEFAULT_GATE, 0.0)
    assert statuses(j)["lossless_fraction"] == "FAIL"
    assert j.verdict == "FAIL"
    assert 0.8 < (j.lossless.fraction or 0) < 0.97
    assert j.lossless.differing_tasks and all(t.startswith("T") for t in j.lossless.differing_tasks)


def test_losslessness_is_not_judged_above_temperature_zero() -> None:
    j = judge(synthetic("a", 100, 9.0, seed=1), synthetic("b", 100, 9.0, seed=1, lossy=0.5), DEFAULT_GATE, 0.7)
    assert statuses(j)["lossless_fraction"] == "NOT_APPLICABLE"
    assert j.lossless is not None and not j.lossless.applicable and j.lossless.greedy_of is None
    assert j.lossless.pairs == 100 and j.lossless.differing_tasks  # counted over every pair, for reading only


def test_a_replayed_captures_greedy_requests_are_judged_for_losslessness_among_sampled_ones() -> None:
    """A capture's requests carry their own temperature; the run's is the loosest replayed (0.7 here). The greedy
    ones are judged: a candidate that changes them fails, where the run-wide temperature alone would not judge
    losslessness at all."""
    def mixed(records: list[RequestRecord]) -> list[RequestRecord]:
        return [r.model_copy(update={"temperature": 0.0 if r.index % 2 else 0.7}) for r in records]

    j = judge(mixed(synthetic("a", 100, 9.0, seed=1)), mixed(synthetic("b", 100, 9.0, seed=1, lossy=0.5)),
              DEFAULT_GATE, 0.7)
    assert statuses(j)["lossless_fraction"] == "FAIL" and j.verdict == "FAIL"
    assert j.lossless is not None and (j.lossless.greedy_of, j.lossless.pairs) == (100, 50)
    same = judge(mixed(synthetic("a", 100, 9.0, seed=1)), mixed(synthetic("b", 100, 9.0, seed=1)), DEFAULT_GATE, 0.7)
    assert statuses(same)["lossless_fraction"] == "PASS"
    claimed = judge(mixed(synthetic("a", 100, 9.0, seed=1)), mixed(synthetic("b", 100, 9.0, seed=1, lossy=0.5)),
                    DEFAULT_GATE, 0.0)  # a greedy run: no record's own temperature takes a pair out
    assert statuses(claimed)["lossless_fraction"] == "FAIL" and claimed.lossless is not None
    assert (claimed.lossless.pairs, claimed.lossless.greedy_of) == (100, None)


@pytest.mark.parametrize(("field", "greedy", "edited", "said"), [
    ("temperature", 0.0, 0.7, "temperature 0.0, arm b 0.7"),
    ("route", "native", "chat", "route native, arm b chat"),
])
def test_a_request_whose_arms_record_different_settings_is_refused(
        field: str, greedy: object, edited: object, said: str) -> None:
    """A task has one body: an arm's record that says it was sampled where the other's says greedy, or sent on
    another route, was edited (it would take its pair out of losslessness, or pair a chat answer with a native)."""
    base = [r.model_copy(update={field: greedy}) for r in synthetic("a", 20, 9.0, seed=1)]
    cand = [r.model_copy(update={field: edited if r.index == 3 else greedy})
            for r in synthetic("b", 20, 9.0, seed=1, lossy=0.5)]
    with pytest.raises(UserError, match=rf"request 3: arm a records {said}; records of one request that disagree"):
        judge(base, cand, DEFAULT_GATE, 0.7)


def test_error_rate_regression_fails() -> None:
    j = judge(synthetic("a", 300, 9.0, seed=1), synthetic("b", 300, 9.0, seed=1, errors=0.3), DEFAULT_GATE, 0.0)
    assert statuses(j)["error_rate"] == "FAIL"
    rate = next(m for m in j.metrics if m.metric == "error_rate")
    assert rate.relative is False and 0.2 < (rate.change or 0) < 0.4


def test_slower_candidate_fails_on_tpot() -> None:
    j = judge(synthetic("a", 200, 9.0, seed=1), synthetic("b", 200, 9.0, seed=1, tpot=0.012), DEFAULT_GATE, 0.0)
    assert statuses(j)["tpot_p95"] == "FAIL"


def test_pairs_with_different_tasks_are_refused() -> None:
    base = synthetic("a", 10, 9.0, seed=1)
    cand = [r.model_copy(update={"arm": "b", "task_id": "other"}) for r in base]
    with pytest.raises(UserError, match="same schedule"):
        judge(base, cand, DEFAULT_GATE, 0.0)


def test_warmup_records_are_left_out() -> None:
    base = synthetic("a", 50, 9.0, seed=1)
    cand = [r.model_copy(update={"arm": "b", "warmup": r.index < 10}) for r in synthetic("b", 50, 9.0, seed=2)]
    assert judge(base, cand, DEFAULT_GATE, 0.0).pairs == 40


def test_requests_cancelled_at_the_stop_are_no_errors_of_the_arm() -> None:
    """Ctrl-C cancels what is in flight; the slower arm has more in flight, and that is not its failure."""
    base = synthetic("a", PASSING * 3 // 2, 9.0, seed=1)
    cand = [r.model_copy(update={"arm": "b"}) if r.index % 3 else
            r.model_copy(update={"arm": "b", "error_kind": "cancelled", "error_message": "stopped"}) for r in base]
    j = judge(base, cand, DEFAULT_GATE, 0.0)
    errors = next(m for m in j.metrics if m.metric == "error_rate")
    assert (errors.baseline, errors.candidate) == (0.0, 0.0) and j.pairs == PASSING
    assert statuses(j)["error_rate"] == "PASS"


def test_tasks_needed_scales_with_the_square_of_the_spread() -> None:
    assert tasks_needed(100, 0.02, 0.01) == 400
    assert tasks_needed(100, 0.02, 0.0) is None
    assert tasks_needed(100, 0.001, 0.01) == 101


def test_gate_yaml(tmp_path: Path) -> None:
    path = tmp_path / "gate.yaml"
    path.write_text("rules:\n  - metric: accept_length\n    max_worse: 0.01\n  - metric: lossless_fraction\n"
                    "    at_least: 0.95\n")
    gate = load_gate(path)
    assert [r.metric for r in gate.rules] == ["accept_length", "lossless_fraction"]
    assert load_gate(None) == DEFAULT_GATE
    path.write_text("rules:\n  - metric: speed\n    max_worse: 0.01\n")
    with pytest.raises(UserError, match="unknown metric 'speed'"):
        load_gate(path)
    path.write_text("rules:\n  - metric: lossless_fraction\n    max_worse: 0.01\n")
    with pytest.raises(UserError, match="at_least"):
        load_gate(path)
    path.write_text("rules: [\n")
    with pytest.raises(UserError, match="invalid YAML"):
        load_gate(path)
    path.write_text("rules:\n  - &tight {metric: accept_length, max_worse: 0.01}\n"
                    "  - {<<: *tight, metric: tpot_p95, max_worse: 0.05}\n")
    assert [(r.metric, r.max_worse) for r in load_gate(path).rules] == [("accept_length", 0.01), ("tpot_p95", 0.05)]
    path.write_text("rules:\n  - {metric: accept_length, max_worse: 0.01}\n  - {metric: accept_length, max_worse: 0.5}\n")
    with pytest.raises(UserError, match="accept_length: one rule per metric"):
        load_gate(path)
    path.write_text("rules:\n  - {metric: accept_length, max_worse: 0.01, max_worse: 0.5}\n")
    with pytest.raises(UserError, match="key 'max_worse' given twice"):
        load_gate(path)


def test_a_difference_is_told_in_words_not_python_reprs() -> None:
    sequential = run_config("r2").model_copy(update={"sequential": SequentialDesign(gate=DEFAULT_GATE)})
    hotter = run_config("r3").model_copy(update={"sampling": Sampling(max_new_tokens=256, temperature=0.7, top_p=1)})
    problems = [*comparability(run_config("r1"), "zlab", sequential, "inhouse"),
                *comparability(run_config("r1"), "zlab", hotter, "inhouse")]
    assert problems == ["sequential: not set vs set", "sampling.temperature: 0.0 vs 0.7"]


def test_comparability_names_every_difference() -> None:
    assert comparability(run_config("r1"), "zlab", run_config("r1"), "inhouse") == []
    assert comparability(run_config("r1"), "zlab", run_config("r2"), "inhouse") == []
    problems = comparability(run_config("r1"), "zlab", run_config("r2", num_requests=50, max_running=8), "inhouse")
    assert any(p.startswith("num_requests") for p in problems)
    assert any("max_running_requests" in p for p in problems)
    with pytest.raises(UserError, match="no arm named"):
        comparability(run_config("r1"), "nope", run_config("r1"), "inhouse")


def test_a_zero_baseline_quantile_gives_an_undefined_change_not_a_warning() -> None:
    """Chunks read together have zero gaps: a relative change from a zero baseline is undefined, never NaN or inf."""
    base = synthetic("a", 120, 9.0, seed=1)
    base = [r.model_copy(update={"chunk_times_s": [r.chunk_times_s[0]] * len(r.chunk_times_s)}) for r in base]
    cand = synthetic("b", 120, 9.0, seed=2)
    j = judge(base, cand, DEFAULT_GATE, temperature=0.0)
    itl = next(m for m in j.metrics if m.metric.startswith("itl") and m.baseline == 0.0)
    assert itl.change is None and itl.candidate is not None and itl.candidate > 0


def test_a_decided_fail_asks_for_no_more_tasks() -> None:
    """"about N distinct tasks would decide it" is of an open verdict: a FAIL is decided, whatever its other rules
    would still need."""
    failing = RuleResult(metric="accept_length", limit=0.02, status="FAIL", detail="")
    open_rule = RuleResult(metric="tpot_p95", limit=0.05, status="INCONCLUSIVE", detail="", tasks_needed=319)
    assert overall([failing, open_rule]) == ("FAIL", None)
    assert overall([open_rule, open_rule.model_copy(update={"tasks_needed": 40})]) == ("INCONCLUSIVE", 319)
