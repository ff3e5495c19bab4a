"""The verdict's report.html: the verdict first, each rule against its limit, the change column, the stamps of a
forced verdict, the identical outputs, both sides' provenance, and nothing from a run that is not escaped."""

from __future__ import annotations

import html
import re
from functools import cache

from rich.console import Console

from dfserve.loadtest.judge import DEFAULT_GATE, judge
from dfserve.runs import Provenance
from dfserve.verdict.design import SequentialDesign, SequentialReport
from dfserve.verdict.printer import print_verdict
from dfserve.verdict.report import render_verdict_html, rule_interval
from dfserve.verdict.results import Judgement
from dfserve.verdict.verdict import Side, Verdict
from tests.synthetic import PASSING, synthetic


@cache
def _judgement(candidate_tau: float, lossy: float) -> Judgement:
    return judge(synthetic("zlab", PASSING, 9.0, seed=1), synthetic("inhouse", PASSING, candidate_tau, seed=2, lossy=lossy),
                 DEFAULT_GATE, 0.0)


def _verdict(candidate_tau: float = 6.0, drafter: str = "z-lab/Qwen3.6-27B-DFlash", lossy: float = 0.0,
             **changes: object) -> Verdict:
    j = _judgement(candidate_tau, lossy)
    side = {"target": "Qwen/Qwen3.6-27B", "url": "http://127.0.0.1:1"}
    verdict = Verdict(source="loadtest", verdict=j.verdict, forced=False, judgement=j, gate=DEFAULT_GATE,
                      baseline=Side(run_id="run-base", run_dir="/runs/run-base", name="zlab", drafter=drafter, **side),
                      candidate=Side(run_id="run-cand", run_dir="/runs/run-cand", name="inhouse",
                                     drafter="/ckpt/step-4000", **side),
                      provenance=Provenance.here())
    return verdict.model_copy(update=changes)


def _body(page: str) -> str:
    return page.split("<body>", 1)[1]


def test_the_verdict_comes_first_in_words_and_colour() -> None:
    page = render_verdict_html(_verdict())
    body = _body(page)
    assert body.index(">FAIL</p>") < body.index("<h2>Rules</h2>") < body.index("<h2>Metrics</h2>")
    assert "<p class='verdict' style='color:#b3261e'>FAIL</p>" in body
    assert "<title>FAIL: inhouse vs zlab</title>" in page and "width=device-width" in page
    assert "FORCED" not in body and "INCOMPLETE" not in body


def test_the_verdict_word_shrinks_to_a_phones_width_instead_of_breaking() -> None:
    style = render_verdict_html(_verdict()).split("<style>", 1)[1].split("</style>", 1)[0]
    rule = re.search(r"\.verdict\{([^}]*)\}", style)
    assert rule is not None and "overflow-wrap:normal" in rule[1] and "vw" in rule[1]  # the page's words may break


def test_a_pass_reads_pass() -> None:
    verdict = _verdict(verdict="PASS")
    assert "<p class='verdict' style='color:#1e7b34'>PASS</p>" in render_verdict_html(verdict)


def test_each_rule_shows_its_status_interval_and_limit_with_a_bar() -> None:
    verdict = _verdict()
    rules_part = _body(render_verdict_html(verdict)).split("<h2>Rules</h2>")[1].split("<h2>Metrics</h2>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", rules_part)[1:]
    assert len(rows) == len(verdict.judgement.rules) == 4
    gate = {r.metric: r for r in verdict.gate.rules}
    for rule, row in zip(verdict.judgement.rules, rows, strict=True):
        assert f">{rule.status}</span>" in row and f"<td>{rule.metric}</td>" in row
        interval = rule_interval(rule, gate[rule.metric], verdict.judgement)
        assert interval is not None
        relative = any(m.relative for m in verdict.judgement.metrics if m.metric == rule.metric)
        unit = "%" if relative else " pts"
        shown, mark = ((f"[{interval[0]:.4f}, {interval[1]:.4f}]", f"{rule.limit:.4g}")
                       if gate[rule.metric].at_least is not None else
                       (f"[{interval[0] * 100:+.2f}, {interval[1] * 100:+.2f}]{unit}", f"{rule.limit * 100:.4g}{unit}"))
        assert shown in row and f"limit {mark}</text>" in row
        colour = {"PASS": "#1e7b34", "FAIL": "#b3261e"}[rule.status]  # the bar says what the rule decided
        assert f'height="12" fill="{colour}"/>' in row
    accept = next(r for r in verdict.judgement.rules if r.metric == "accept_length")
    low, _ = rule_interval(accept, gate["accept_length"], verdict.judgement) or (0.0, 0.0)
    assert accept.status == "FAIL" and low > accept.limit  # a third fewer tokens per round: surely worse
    assert "identical fraction ≥ 0.99" in rules_part and "worse by ≤ 2% (relative)" in rules_part
    assert "worse by ≤ 1 pts (absolute)" in rules_part  # error_rate: a rate, its limit in points


def test_the_metrics_table_has_baseline_candidate_and_the_change_with_its_interval_and_n() -> None:
    verdict = _verdict()
    metrics_part = _body(render_verdict_html(verdict)).split("<h2>Metrics</h2>")[1].split("<h2>")[0]
    assert "<th>metric</th><th>baseline</th><th>candidate</th><th>change [95% CI]</th><th>n</th>" in metrics_part
    accept = next(m for m in verdict.judgement.metrics if m.metric == "accept_length")
    assert accept.change is not None and accept.change_low is not None and accept.change_high is not None
    row = next(r for r in re.findall(r"<tr>(.*?)</tr>", metrics_part) if f">{accept.metric}</span>" in r)
    change = f"{accept.change * 100:+.1f}% [{accept.change_low * 100:+.1f}, {accept.change_high * 100:+.1f}]"
    assert f"<td>{accept.baseline:.4g}</td><td>{accept.candidate:.4g}</td><td>{change} (higher is better)</td>" in row
    assert row.endswith(f"<td>{accept.n_baseline}</td>")
    tpot = next(m for m in verdict.judgement.metrics if m.metric == "tpot_p95")
    assert tpot.baseline is not None and f"<td>{tpot.baseline * 1e3:.4g} ms</td>" in metrics_part
    error = next(m for m in verdict.judgement.metrics if m.metric == "error_rate")
    assert not error.relative and f"{(error.change or 0) * 100:+.1f} pts" in metrics_part


def test_a_forced_verdict_on_incomplete_data_is_stamped_and_says_why() -> None:
    verdict = _verdict(forced=True, mismatches=["tasks: humaneval vs mbpp"],
                       incomplete=["run run-base was interrupted before its end"])
    body = _body(render_verdict_html(verdict))
    assert "<span class='stamp'>FORCED</span><span class='stamp'>INCOMPLETE DATA</span>" in body
    assert body.index("class='stamp'") < body.index("class='verdict'")
    assert "Forced comparison of runs that differ: tasks: humaneval vs mbpp" in body
    assert "Forced verdict on incomplete data: run run-base was interrupted before its end" in body


def test_losslessness_lists_the_differing_tasks() -> None:
    verdict = _verdict(lossy=0.3)
    loss = verdict.judgement.lossless
    assert loss is not None and loss.differing_tasks
    part = _body(render_verdict_html(verdict)).split("<h2>Losslessness</h2>")[1].split("<h2>")[0]
    assert f"{loss.identical} of {loss.pairs} paired outputs identical" in part
    assert all(f"<code>{task}</code>" in part for task in loss.differing_tasks)


def test_provenance_of_both_sides() -> None:
    part = _body(render_verdict_html(_verdict())).split("<h2>Provenance</h2>")[1]
    for expected in ("<td>run id</td><td><code>run-base</code></td><td><code>run-cand</code></td>",
                     "<td>drafter</td><td><code>z-lab/Qwen3.6-27B-DFlash</code></td><td><code>/ckpt/step-4000</code>",
                     "<td>arm</td><td><code>zlab</code></td><td><code>inhouse</code></td>"):
        assert expected in part


def test_the_changes_plot_has_a_title_an_axis_label_and_a_row_per_metric() -> None:
    verdict = _verdict()
    plot = re.findall(r"<svg[^>]*aria-label=\"change of each metric[^\"]*\".*?</svg>", render_verdict_html(verdict))
    assert len(plot) == 1
    assert "change, candidate vs baseline (% relative; points for rates)</text>" in plot[0]
    assert plot[0].count("<circle") == sum(m.change is not None for m in verdict.judgement.metrics)


def test_what_the_runs_name_is_escaped() -> None:
    verdict = _verdict(drafter="<script>alert(1)</script>")
    verdict = verdict.model_copy(update={"candidate": verdict.candidate.model_copy(update={"name": "<b>x</b>"})})
    page = render_verdict_html(verdict)
    assert "<script" not in page and "<b>x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_the_terminal_and_the_report_word_a_sequential_verdict_alike() -> None:
    report = SequentialReport(design=SequentialDesign(gate=DEFAULT_GATE), looks=3, stopped="decided",
                              stopped_after_pairs=48, verdict_when_stopped="FAIL", pairs=52)
    verdict = _verdict(sequential=report)
    console = Console(width=2000, record=True, color_system=None)
    print_verdict(console, verdict)
    text, page = console.export_text(), render_verdict_html(verdict)
    sentence = "stopped at look 3 after 48 pairs (decided, FAIL), judged over 52 pairs"
    printed = next(line for line in text.splitlines() if line.startswith("sequential: "))
    assert sentence in printed
    assert html.escape(printed.rstrip(".")) in page
    accept = next(m for m in verdict.judgement.metrics if m.metric == "accept_length")
    row = next(line for line in text.splitlines() if line.startswith("accept_length"))
    assert row.split()[1:3] == [f"{accept.baseline:.4g}", f"{accept.candidate:.4g}"]
    assert "change [95% CI, fixed-n]" in text and "<th>change [95% CI, fixed-n]</th>" in page
