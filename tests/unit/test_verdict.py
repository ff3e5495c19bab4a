"""The verdict core on its own: paired statistics, gates as they are read, and the printer."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from dfserve.errors import FieldError
from dfserve.loadtest.judge import DEFAULT_GATE, judge, load_gate
from dfserve.loadtest.records import RequestRecord
from dfserve.verdict import stats
from dfserve.verdict.printer import print_judgement
from dfserve.verdict.results import fold
from tests.synthetic import synthetic


@pytest.mark.parametrize(("text", "message"), [
    ("rules: []\n", "rules: a gate needs at least one rule (with none, any candidate would pass)"),
    ("rules:\n  - {metric: accept_length, max_worse: .inf}\n", "rules.0.max_worse: Input should be a finite number"),
    ("rules:\n  - {metric: accept_length, max_worse: .nan}\n", "rules.0.max_worse: Input should be a finite number"),
    ("rules:\n  - {metric: lossless_fraction, at_least: .nan}\n", "rules.0.at_least: Input should be a finite number"),
    ("rules:\n  - {metric: accept_length, max_worse: true}\n", "rules.0.max_worse: Input should be a valid number"),
    ("rules:\n  - {metric: accept_length, max_worse: '0.02'}\n", "rules.0.max_worse: '0.02' is text, "
     "not a number (YAML reads an exponent without a decimal point, as in 2e-2, as text): write 0.02"),
    ("rules:\n  - {metric: accept_length, max_worse: 2e-2}\n", "rules.0.max_worse: '2e-2' is text, "
     "not a number (YAML reads an exponent without a decimal point, as in 2e-2, as text): write 0.02"),
    ("seed: -1\nrules:\n  - {metric: accept_length, max_worse: 0.02}\n",
     "seed: Input should be greater than or equal to 0"),
    ("bootstrap_draws: 100000000000\nrules:\n  - {metric: accept_length, max_worse: 0.02}\n",
     "bootstrap_draws: Input should be less than or equal to 100000"),
])
def test_a_gate_that_would_decide_nothing_is_refused_when_read(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "gate.yaml"
    path.write_text(text)
    with pytest.raises(FieldError) as caught:
        load_gate(path)
    assert caught.value.field == "gate" and str(caught.value) == f"gate: {path}: {message}"


@pytest.mark.parametrize(("rule", "message"), [
    ("{metric: error_rate, max_worse: 1}", "rules.1.max_worse: 1 passes any candidate on error_rate"),
    ("{metric: lossless_fraction, at_least: 0}", "rules.1.at_least: 0 passes any candidate on lossless_fraction"),
    ("{metric: output_tokens_per_s, max_worse: 1}", "rules.1.max_worse: 1 passes any candidate on output_tokens_per_s"),
])
def test_a_rule_no_candidate_can_miss_is_refused(tmp_path: Path, rule: str, message: str) -> None:
    """Higher is better on throughput: a candidate falls by all of it at most. Latency may rise without bound."""
    path = tmp_path / "gate.yaml"
    path.write_text(f"rules:\n  - {{metric: ttft_p99, max_worse: 5}}\n  - {rule}\n")
    with pytest.raises(FieldError) as caught:
        load_gate(path)
    assert str(caught.value).startswith(f"gate: {path}: {message}")  # the file named, as for any other refusal
    path.write_text(f"rules:\n  - {rule.replace(': 1}', ': 0.05}').replace(': 0}', ': 0.9}')}\n")
    assert load_gate(path).rules[0].limit in (0.05, 0.9)


def test_a_gate_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gate.yaml"
    path.write_bytes(b"rules:\n  - {metric: accept_length, max_worse: 0.01} # \xff\n")
    with pytest.raises(FieldError, match=r"gate: .*gate\.yaml: not UTF-8 text"):
        load_gate(path)


def test_the_printed_table_fits_80_columns_with_latencies_in_ms() -> None:
    j = judge(synthetic("zlab", 200, 9.0, seed=1), synthetic("inhouse", 200, 6.0, seed=2), DEFAULT_GATE, 0.0)
    out = io.StringIO()
    print_judgement(Console(file=out, width=80), j)
    lines = out.getvalue().splitlines()
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in {m.metric for m in j.metrics}}
    assert set(rows) == {m.metric for m in j.metrics}  # one line each: no cell wrapped
    assert all(len(line) <= 80 for line in lines)
    assert any(re.match(r" FAIL +accept_length: worse by", line) for line in lines)
    tpot = next(m for m in j.metrics if m.metric == "tpot_p95")
    assert tpot.baseline is not None and f"{tpot.baseline * 1e3:.4g} ms" in rows["tpot_p95"]
    assert " ms" not in rows["accept_length"]


def test_wilson_and_quantile_intervals() -> None:
    interval = stats.wilson(95, 100)
    assert interval is not None
    assert interval.low == pytest.approx(0.8882, abs=1e-3) and interval.high == pytest.approx(0.9785, abs=1e-3)
    assert stats.wilson(0, 0) is None
    assert stats.quantile([], 0.5) is None
    values = np.arange(1000, dtype=float)
    q = stats.quantile_interval(values, 0.95)
    assert q is not None and q.low < 949 < q.high and q.high - q.low < 40


def test_a_cluster_bootstrap_over_few_tasks_still_covers_about_95_percent() -> None:
    """The plain 2.5% percentiles of a ratio's bootstrap over 10 tasks cover it about 86% of the time; expanded for
    the few tasks (`stats.expanded_tail`), about 92%."""
    rng = np.random.default_rng(0)
    true_ratio = 9 * math.exp(0.25**2 / 2)
    covered = 0
    for _ in range(800):
        rounds = rng.lognormal(0, 0.8, size=10) * 50
        tokens = rounds * 9 * np.exp(rng.normal(0, 0.25, size=10))
        draws = stats.weighted_ratio(stats.cluster_weights(10, 1000, rng), tokens, rounds)
        interval = stats.percentile_interval(tokens.sum() / rounds.sum(), draws, 10)
        covered += interval.low <= true_ratio <= interval.high
    assert covered / 800 >= 0.895
    assert stats.t95(19) == pytest.approx(2.093, abs=1e-3) and stats.t95(3) == pytest.approx(3.182, abs=5e-3)
    assert stats.expanded_tail(20) == pytest.approx(0.0159, abs=2e-4) and stats.expanded_tail(10**6) == pytest.approx(0.025, abs=1e-5)


def test_an_error_rule_without_errors_passes_only_on_enough_requests() -> None:
    """No error in 80 requests bounds a rate only within about 4.5 points (Newcombe's interval of the difference;
    the task bootstrap of no error is [0, 0]): the 1-point rule is undecided there, and decided at 400."""
    newcombe = stats.newcombe(48, 80, 56, 70)  # Newcombe (1998), Statistics in Medicine 17, table II, method 10
    assert newcombe is not None and (round(newcombe.low, 4), round(newcombe.high, 4)) == (0.0524, 0.3339)
    few = judge(synthetic("zlab", 80, 9.0, seed=1), synthetic("inhouse", 80, 9.0, seed=2), DEFAULT_GATE, 0.0)
    errors = next(m for m in few.metrics if m.metric == "error_rate")
    assert (errors.baseline, errors.candidate) == (0.0, 0.0) and errors.change_high == pytest.approx(0.0458, abs=1e-3)
    undecided = {r.metric: r for r in few.rules}["error_rate"]
    assert undecided.status == "INCONCLUSIVE" and undecided.tasks_needed is None
    assert undecided.requests_needed == 381  # from the counts: repeats of the 40 tasks narrow it too
    assert stats.newcombe(0, 381, 0, 381).high <= 0.01 < stats.newcombe(0, 380, 0, 380).high  # type: ignore[union-attr]
    enough = judge(synthetic("zlab", 400, 9.0, seed=1), synthetic("inhouse", 400, 9.0, seed=2), DEFAULT_GATE, 0.0)
    assert {r.metric: r.status for r in enough.rules}["error_rate"] == "PASS"


def test_a_metric_measured_on_fewer_than_five_of_its_tasks_decides_nothing() -> None:
    """Five tasks with pairs, one of which gives acceptance (the others' answers report none): the interval is one
    task's, of no width."""
    def one_measured(records: list[RequestRecord]) -> list[RequestRecord]:
        return [r if r.task_id == "T0" else r.model_copy(update={"spec_verify_ct": None, "acceptance": "unknown"})
                for r in records]

    judged = judge(one_measured(synthetic("zlab", 400, 9.0, seed=1, tasks=5)),
                   one_measured(synthetic("inhouse", 400, 9.0, seed=2, tasks=5)), DEFAULT_GATE, 0.0)
    accept = {r.metric: r for r in judged.rules}["accept_length"]
    assert accept.status == "INCONCLUSIVE" and "fewer than 5 distinct tasks" in accept.detail
    assert accept.tasks_needed is None  # the set has 5: more of them, not more tasks, would give it values


@pytest.mark.parametrize("tasks", [1, 2, 4])
def test_fewer_than_five_tasks_decide_no_rule_however_many_requests(tasks: int) -> None:
    """One task's bootstrap draws all agree, an interval of no width; two to four reach no further than their range:
    400 requests of one prompt each PASSed every rule."""
    judged = judge(synthetic("zlab", 400, 9.0, seed=1, tasks=tasks), synthetic("inhouse", 400, 9.0, seed=2,
                                                                                tasks=tasks), DEFAULT_GATE, 0.0)
    rules = {r.metric: r for r in judged.rules}
    assert "lossless_fraction" in rules  # 400 identical outputs of one prompt are one observation
    assert judged.verdict == "INCONCLUSIVE" and {r.status for r in rules.values()} == {"INCONCLUSIVE"}
    assert all(r.tasks_needed == 5 and "fewer than 5 distinct tasks" in r.detail for r in rules.values())
    five = judge(synthetic("zlab", 400, 9.0, seed=1, tasks=5), synthetic("inhouse", 400, 9.0, seed=2, tasks=5),
                 DEFAULT_GATE, 0.0)
    assert all(m.change_low is not None and math.isfinite(m.change_low) for m in five.metrics)


def test_quantile_interval_covers_the_true_quantile_about_95_percent() -> None:
    rng = np.random.default_rng(0)
    true_p95 = -math.log(0.05)
    covered = 0
    for _ in range(400):
        q = stats.quantile_interval(rng.exponential(size=200), 0.95)
        assert q is not None
        covered += q.low <= true_p95 <= q.high
    assert 0.91 <= covered / 400 <= 0.99


def test_weighted_quantiles_with_unit_weights_match_the_plain_quantile() -> None:
    rng = np.random.default_rng(1)
    values = rng.normal(size=301)
    weights = np.ones((3, 301))
    assert stats.weighted_quantiles(weights, values, 0.9) == pytest.approx([stats.quantile(values, 0.9)] * 3)
    weights[1, values > np.median(values)] = 0  # drop the upper half: the 0.9 quantile falls
    assert stats.weighted_quantiles(weights, values, 0.9)[1] < np.median(values)


def test_cluster_weights_pick_as_many_tasks_as_there_are() -> None:
    weights = stats.cluster_weights(7, 50, np.random.default_rng(0))
    assert weights.shape == (50, 7) and (weights.sum(axis=1) == 7).all()


def test_grid_quantiles_of_many_values_agree_with_the_exact_ones() -> None:
    rng = np.random.default_rng(2)
    owners = rng.integers(0, 30, size=40_000)
    values = rng.exponential(size=40_000) + owners * 0.01
    weights = stats.cluster_weights(30, 400, rng)
    exact = stats.weighted_quantiles(weights[:, owners], values, 0.95)
    grid = stats.clustered_quantiles(weights, values, owners, 0.95)
    assert np.abs(grid - exact).max() < 0.02 * exact.mean()


def test_a_gate_none_of_whose_rules_applies_decides_nothing() -> None:
    assert fold(["NOT_APPLICABLE", "NOT_APPLICABLE"]) == "INCONCLUSIVE"
    assert fold(["NOT_APPLICABLE", "PASS"]) == "PASS"
    assert fold(["NOT_APPLICABLE", "INCONCLUSIVE", "PASS"]) == "INCONCLUSIVE"
    assert fold(["PASS", "FAIL", "NOT_APPLICABLE"]) == "FAIL"
