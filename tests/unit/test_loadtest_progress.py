"""What the load test shows on a terminal of 80 columns and in a pipe: the live view, its time left, its plain lines,
the summary table and the sequential run's closing lines."""

from __future__ import annotations

import io
import re
import time

import pytest
from rich.console import Console

from dfserve.loadtest import cli
from dfserve.loadtest.judge import DEFAULT_GATE, Gate, Rule
from dfserve.loadtest.progress import Progress
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.report import summarize
from dfserve.loadtest.sequential import SequentialDesign, SequentialMonitor
from dfserve.terminal import duration, wrapped
from tests.synthetic import run_config, synthetic

WIDTH = 80


def rendered(progress: Progress) -> list[str]:
    console = Console(width=WIDTH, file=io.StringIO())
    return "".join(segment.text for segment in console.render(progress._render())).splitlines()


def sequential(records: list[RequestRecord], gate: Gate = DEFAULT_GATE, warmup: int = 0) -> SequentialMonitor:
    m = SequentialMonitor(SequentialDesign(gate=gate), "baseline", "candidate", 0.0, 164, warmup)
    for r in records:
        m.observe(r)
    return m


def paired(n: int, warmup: int = 0) -> list[RequestRecord]:
    base = synthetic("baseline", n, 9.0, seed=1, tasks=164)
    cand = synthetic("candidate", n, 8.8, seed=2, tasks=164, errors=0.05)
    records = [r for pair in zip(base, cand, strict=True) for r in pair]
    return [r.model_copy(update={"warmup": r.index < warmup}) for r in records]


def test_the_live_view_with_the_gate_fits_80_columns_and_wraps_no_number() -> None:
    gate = Gate(rules=(*DEFAULT_GATE.rules, Rule(metric="output_tokens_per_s", max_worse=0.02)))
    records = paired(64)
    m = sequential(records, gate)
    progress = Progress(["baseline", "candidate"], 400, Console(file=io.StringIO()), m)
    for r in records:
        progress.observe(r)
    lines = rendered(progress)
    assert max(len(line) for line in lines) <= WIDTH, "\n".join(lines)
    text = "\n".join(lines)
    assert "gate at look 4: 64 pairs over 64 tasks" in text
    assert m.latest is not None
    for rule in m.latest.rules:
        row = next(line for line in lines if line.startswith(rule.metric))  # names are never cut short
        if rule.estimate is not None:
            assert f"{rule.estimate:+.3f} [{rule.low:+.3f}, {rule.high:+.3f}]" in row
        assert f"{rule.limit:.4g}" in row
    arms = [line for line in lines if line.startswith(("baseline ", "candidate "))]
    assert len(arms) == 2 and all(re.search(r" 64/400 ", line) for line in arms)


def test_the_live_count_leaves_warm_up_out() -> None:
    """The count a user watches is of measured requests, as the run's end reports them."""
    records = paired(24, warmup=8)
    m = sequential(records, warmup=8)
    progress = Progress(["baseline", "candidate"], 16, Console(file=io.StringIO()), m, warmup=8)
    for r in records[:10]:
        progress.observe(r)
    assert "warm-up 5/8" in "\n".join(rendered(progress))
    for r in records[10:]:
        progress.observe(r)
    text = "\n".join(rendered(progress))
    assert "16/16" in text and "24/" not in text and "warm-up" not in text
    assert progress.tallies["baseline"].done == 16 and progress.tallies["baseline"].warmup_done == 8


def test_time_left_comes_from_the_pace_so_far_and_the_duration_bound() -> None:
    progress = Progress(["a", "b"], 90, Console(file=io.StringIO()), warmup=10)
    progress.started = 100.0
    assert progress.seconds_left(now=105.0) is None  # nothing finished: no pace yet
    for r in synthetic("a", 30, 8.0, seed=1) + synthetic("b", 20, 8.0, seed=2):
        progress.observe(r)
    assert progress.seconds_left(now=110.0) == pytest.approx(10.0 * (200 - 50) / 50)
    progress.duration_s = 25.0
    assert progress.seconds_left(now=110.0) == pytest.approx(15.0)
    progress.duration_s = 5.0
    assert progress.seconds_left(now=110.0) == 0.0
    until_decided = Progress(["a", "b"], 90, Console(file=io.StringIO()), sequential([]))
    until_decided.observe(synthetic("a", 1, 8.0, seed=1)[0])
    assert until_decided.seconds_left() is None  # a sequential run may stop at any look
    assert "until decided, at most 90 per arm" in "\n".join(rendered(until_decided))


def test_the_live_view_says_how_long_is_left() -> None:
    progress = Progress(["a", "b"], 90, Console(file=io.StringIO()))
    progress.started = time.perf_counter() - 30
    for r in synthetic("a", 45, 8.0, seed=1) + synthetic("b", 45, 8.0, seed=2):
        progress.observe(r)
    (title,) = [line for line in rendered(progress) if "load test" in line]
    assert re.search(r"load test, 30 s, about (29|30) s left", title), title


def test_durations_read_as_a_person_would_say_them() -> None:
    assert [duration(s) for s in (0, 41.2, 60, 185, 3600 + 1200)] == ["0 s", "41 s", "1 min 00 s", "3 min 05 s",
                                                                       "1 h 20 min"]


def test_without_a_terminal_plain_lines_come_at_an_interval() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=WIDTH)
    records = synthetic("a", 10, 8.0, seed=1, tokens=32) + synthetic("b", 10, 8.0, seed=2, tokens=32, errors=1.0)
    with Progress(["a", "b"], 40, console, plain_every_s=0.05) as progress:
        for r in records:
            progress.observe(r)
        time.sleep(0.4)
    lines = out.getvalue().splitlines()
    assert 2 <= len(lines) <= 9 and "\x1b" not in out.getvalue()
    assert all(line.startswith("load test, ") for line in lines)
    assert "a 10/40, 0 errors," in lines[-1] and "b 10/40, 10 errors, 0 tok/s" in lines[-1]
    assert re.search(r"s left: a 10/40, 0 errors, \d+ tok/s, τ \d\.\d\d; b", lines[-1])


def test_a_quiet_run_prints_nothing_without_a_terminal() -> None:
    out = io.StringIO()
    with Progress(["a"], 4, Console(file=out, force_terminal=False, quiet=True), plain_every_s=0.01) as progress:
        progress.observe(synthetic("a", 1, 8.0, seed=1)[0])
        time.sleep(0.1)
    assert out.getvalue() == ""


def test_the_summary_table_fits_80_columns_with_units_and_whole_numbers(capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    config = run_config("seq")
    records = synthetic("zlab", 200, 9.0, seed=1) + synthetic("inhouse", 200, 5.5, seed=2, errors=0.05)
    summary = summarize(config, records, False, {})
    cli._print_summary(config, summary)
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= WIDTH, "\n".join(lines)
    header = "\n".join(lines[:4])
    assert header.count("ms") == 2 and "p50/p99" in header and "p50/p95" in header
    for arm in summary.arms:
        row = next(line for line in lines if line.startswith(arm.arm))
        assert arm.accept_length is not None and arm.ttft_s is not None
        assert f"{arm.accept_length.estimate:.2f} [{arm.accept_length.low:.2f}, {arm.accept_length.high:.2f}]" in row
        assert f"{arm.ttft_s.p50.estimate * 1e3:.1f}/{arm.ttft_s.p99.estimate * 1e3:.1f}" in row
        assert f"{arm.succeeded}/{arm.requests}" in row


def test_the_sequential_closing_lines_break_between_words_on_a_terminal(capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "terminal_width", lambda stderr=False: WIDTH)
    m = sequential(paired(48))
    cli._print_sequential(m)
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert m.latest is not None
    words = " ".join(text.split())
    assert f"after {m.latest.pairs} paired requests (undecided at the end)" in words
    cli._print_sequential(m, interrupted=True)
    assert "(undecided when the run was stopped)" in " ".join(capsys.readouterr().out.split())
    for rule in m.latest.rules:
        assert f"{rule.status:<14} {rule.metric}: {rule.detail}".split() == next(
            " ".join([line, *_continued(lines, i)]).split() for i, line in enumerate(lines)
            if line.startswith(f"  {rule.status}") and f" {rule.metric}:" in line)


def _continued(lines: list[str], i: int) -> list[str]:
    """The lines after `i` that continue it (indented under its text)."""
    following = []
    for line in lines[i + 1:]:
        if not line.startswith(" " * 17):
            break
        following.append(line)
    return following


def test_wrapped_breaks_between_words_and_indents_what_follows() -> None:
    text = "INCONCLUSIVE   tpot_p95: worse by +0.4255 (relative), always-valid interval [-1.0000, +inf], limit 0.05"
    lines = wrapped(text, 40, indent=15).splitlines()
    assert max(len(line) for line in lines) <= 40 and all(line.startswith(" " * 15) for line in lines[1:])
    assert " ".join(" ".join(lines).split()) == " ".join(text.split())


def test_in_a_pipe_each_closing_line_stays_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    m = sequential(paired(48))
    cli._print_sequential(m)
    lines = capsys.readouterr().out.splitlines()
    assert m.latest is not None and len(lines) == 1 + len(m.latest.rules)
    assert lines[0].startswith("until decided: INCONCLUSIVE at look 3") and lines[0].endswith("writes the verdict.")
