"""Per-arm summaries and report.html from records: counts, intervals, histogram, no made-up zeros."""

from __future__ import annotations

import io
import re

from rich.console import Console

from dfserve.loadtest.config import Sampling
from dfserve.loadtest.progress import Progress
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.report import (
    accept_length_figure,
    distribution,
    over_error_rate,
    read_lag_warning,
    render_html,
    summarize,
    summarize_arm,
)
from dfserve.loadtest.schedule import LoadShape
from dfserve.stamped_socket import ReadLag
from dfserve.svg import svg_cdf
from tests.synthetic import run_config, synthetic


def test_arm_summary_counts_errors_and_excludes_warmup() -> None:
    records = synthetic("zlab", 100, 8.0, seed=1, tokens=64, errors=0.1)
    records += [records[0].model_copy(update={"warmup": True, "index": 500})]
    summary = summarize_arm("zlab", records)
    assert summary.requests == 100
    assert summary.succeeded + sum(summary.errors.values()) == 100 and summary.errors.get("http_503", 0) > 0
    assert summary.error_rate == (100 - summary.succeeded) / 100
    assert summary.acceptance == "exact" and summary.accept_length is not None
    assert summary.accept_length.low < summary.accept_length.estimate < summary.accept_length.high
    assert summary.ttft_s is not None and summary.ttft_s.n == summary.succeeded
    assert summary.itl_per_token_s is not None and summary.itl_per_token_s.n == summary.succeeded * 63
    ok = [r for r in records if r.ok and not r.warmup]
    rounds = sum(r.spec_verify_ct or 0 for r in ok)
    assert sum(summary.round_tokens_histogram) == rounds  # one chunk per verify round after the prefill chunk
    assert sum(k * n for k, n in enumerate(summary.round_tokens_histogram)) == len(ok) * 63
    assert summary.wait_s is None  # closed loop: nothing waited for a slot


def test_requests_cancelled_at_the_stop_are_counted_apart_from_errors() -> None:
    records = [r.model_copy(update={"error_kind": "cancelled", "error_message": "stopped"}) if r.index >= 90 else r
               for r in synthetic("zlab", 100, 8.0, seed=1, tokens=64)]
    summary = summarize_arm("zlab", records)
    assert (summary.requests, summary.succeeded, summary.cancelled) == (100, 90, 10)
    assert summary.errors == {} and summary.error_rate == 0.0
    assert not over_error_rate(summarize(run_config("r"), records, True, {}), 0.0)


def test_arms_over_the_error_rate_limit_are_named_with_their_error_kinds() -> None:
    def failed(r: RequestRecord, kind: str, status: int | None) -> RequestRecord:
        return r.model_copy(update={"error_kind": kind, "http_status": status, "completion_tokens": None})

    zlab = synthetic("zlab", 40, 8.0, seed=1, tokens=8)
    inhouse = synthetic("inhouse", 40, 8.0, seed=1, tokens=8)
    zlab[0] = failed(zlab[0], "timeout", None)  # 2.5%
    inhouse[:10] = [failed(r, "connect", None) for r in inhouse[:6]] + [failed(r, "http_status", 503)
                                                                       for r in inhouse[6:10]]  # 25%
    summary = summarize(run_config("run-e"), zlab + inhouse, interrupted=False, read_lag={})
    (over,) = over_error_rate(summary, 0.05)
    assert over.arm == "inhouse" and over.error_rate == 0.25 and over.errors == {"connect": 6, "http_503": 4}
    assert over_error_rate(summary, 0.25) == [] and len(over_error_rate(summary, 0.0)) == 2


def dated_by_next(records: list[RequestRecord], count: int, chunk: int = 0) -> list[RequestRecord]:
    """The records, chunk `chunk` of the first `count` of them read with the next one (so carrying its date)."""
    def together(r: RequestRecord) -> RequestRecord:
        times = list(r.chunk_times_s)
        times[chunk] = times[chunk + 1]
        return r.model_copy(update={"chunk_times_s": times, "first_token_s": times[0]})

    return [together(r) if i < count else r for i, r in enumerate(records)]


def test_chunks_read_with_the_next_while_the_tester_fell_behind_are_warned_about() -> None:
    zlab = synthetic("zlab", 400, 9.0, seed=1, tokens=32)
    inhouse = dated_by_next(synthetic("inhouse", 400, 6.0, seed=2, tokens=32), 20)
    config = run_config("run-l")
    gap_s = summarize_arm("inhouse", inhouse).itl_per_chunk_s
    assert gap_s is not None
    behind = ReadLag(reads=5000, late_reads=300, max_lag_s=gap_s.p50.estimate / 2)
    late = summarize(config, zlab + inhouse, interrupted=False, read_lag={"inhouse": behind, "zlab": behind})
    together = next(a for a in late.arms if a.arm == "inhouse").read_with_next
    assert together is not None and (together.first_chunks, together.of_first_chunks) == (20, 400)
    assert together.chunks == 20 and together.of_chunks == sum(len(r.chunk_times_s) - 1 for r in inhouse)
    warning = read_lag_warning(late)
    assert warning is not None and warning.startswith("warning: arm inhouse: 20 of 400 first chunks and 20 of ")
    assert f"up to {gap_s.p50.estimate / 2 * 1e3:.1f} ms after" in warning and "--shard" in warning
    page = render_html(config, late, zlab + inhouse)
    assert "first 20 of 400 (5.00%)" in page and "first 0 of 400 (0.00%)" in page
    assert "max " in page and "6.00% of 5000 reads 1 ms or more late" in page


def test_chunks_read_together_or_a_late_read_alone_are_not_the_testers_error() -> None:
    """A server may send chunks together (the tester kept up, or fell under 1 ms behind chunks that all came at
    once); one read left waiting moves no figure (nothing was read with the next); one first chunk in sixty is
    sampling noise against one in a hundred."""
    config = run_config("run-q")
    inhouse = synthetic("inhouse", 400, 6.0, seed=2, tokens=32)
    gap_s = summarize_arm("inhouse", inhouse).itl_per_chunk_s
    assert gap_s is not None
    kept_up = ReadLag(reads=5000, late_reads=0, max_lag_s=gap_s.p50.estimate / 3)
    behind = ReadLag(reads=5000, late_reads=1, max_lag_s=gap_s.p50.estimate)
    at_once = [r.model_copy(update={"chunk_times_s": [r.chunk_times_s[-1]] * len(r.chunk_times_s)}) for r in inhouse]
    under_a_ms = ReadLag(reads=5000, late_reads=0, max_lag_s=0.0009)  # against a median chunk gap of nothing
    cases = [(dated_by_next(inhouse, 40), kept_up), (inhouse, behind), (dated_by_next(inhouse[:60], 1), behind),
             (at_once, under_a_ms)]
    for records, lag in cases:
        assert read_lag_warning(summarize(config, records, interrupted=False, read_lag={"inhouse": lag})) is None
    assert read_lag_warning(summarize(config, dated_by_next(inhouse[:60], 6), interrupted=False,
                                      read_lag={"inhouse": behind})) is not None
    page = render_html(config, summarize(config, inhouse, interrupted=False, read_lag={}), inhouse)
    assert "not measured" in page  # reads dated by the loop: no lag
    assert "100 requests + 0 warm-up on /generate;" in page


def test_the_report_says_how_many_requests_went_on_each_route() -> None:
    config = run_config("run-m").model_copy(update={"api": "mixed", "routes": {"native": 60, "completions": 40}})
    records = synthetic("inhouse", 20, 6.0, seed=2, tokens=32)
    page = render_html(config, summarize(config, records, interrupted=False, read_lag={}), records)
    assert "100 requests + 0 warm-up on /generate (60), /v1/completions (40);" in page


def test_no_data_is_none_not_zero() -> None:
    failed = [r.model_copy(update={"error_kind": "connect"}) for r in synthetic("a", 5, 8.0, seed=1, tokens=8)]
    summary = summarize_arm("a", failed)
    assert summary.succeeded == 0 and summary.accept_length is None and summary.ttft_s is None
    assert summary.output_tokens_per_s is None
    assert distribution([]) is None and accept_length_figure([]) is None


def test_report_html_is_self_contained_with_cdfs_and_histogram() -> None:
    records = synthetic("zlab", 40, 9.0, seed=1, tokens=32) + synthetic("inhouse", 40, 6.0, seed=2, tokens=32)
    config = run_config("run-x")
    summary = summarize(config, records, interrupted=True, read_lag={})
    page = render_html(config, summary, records)
    assert page.count("<svg") == 5 and "<polyline" in page and "<rect" in page
    assert "Interrupted" in page and "zlab" in page and "inhouse" in page
    assert "src=" not in page and "<script" not in page
    assert "no samples" in svg_cdf("TTFT", {"a": []}, "TTFT (ms)", "fraction of requests ≤ x")
    assert "{" not in page.split("<table>")[0].split("<body>")[1]  # the load and sampling in words, not JSON


def test_load_and_sampling_read_as_words() -> None:
    assert LoadShape(kind="closed", concurrency=16).describe() == "closed loop, 16 in flight per arm"
    assert (LoadShape(kind="poisson", rate=4, concurrency=8, seed=3).describe()
            == "Poisson arrivals at 4 req/s per arm, at most 8 in flight, seed 3")
    assert (Sampling(max_new_tokens=512, temperature=0, top_p=1).describe()
            == "at most 512 new tokens, temperature 0, top-p 1")


def test_legends_sit_above_the_plot_area() -> None:
    """A CDF reaches the top right corner; a legend there hid it."""
    plot = svg_cdf("TTFT", {"baseline": [0.01, 0.02], "candidate": [0.015, 0.03]}, "TTFT (ms)", "fraction ≤ x")
    legend_ys = [float(y) for y in re.findall(r'<text x="[\d.]+" y="([\d.]+)" font-size="11" fill=', plot)]
    y_axis_top = float(re.findall(r'<line x1="56" y1="([\d.]+)" x2="56"', plot)[0])
    assert len(legend_ys) == 2 and all(y < y_axis_top for y in legend_ys)


def test_every_plot_of_the_run_report_says_what_it_plots_on_both_axes() -> None:
    records = synthetic("zlab", 40, 9.0, seed=1, tokens=32) + synthetic("inhouse", 40, 6.0, seed=2, tokens=32)
    config = run_config("run-x")
    page = render_html(config, summarize(config, records, interrupted=False, read_lag={}), records)
    figures = re.findall(r"<svg.*?</svg>", page)
    titles = [re.search(r'aria-label="([^"]+)"', f)[1] for f in figures]  # type: ignore[index]
    y_labels = [re.search(r'transform="rotate\(-90[^>]*>([^<]+)<', f)[1] for f in figures]  # type: ignore[index]
    assert titles == ["TTFT: share of requests within x", "TPOT: share of requests within x",
                      "ITL per token: share of token gaps within x", "E2E latency: share of requests within x",
                      "tokens accepted per verify round"]
    assert y_labels == ["fraction of requests ≤ x", "fraction of requests ≤ x", "fraction of gaps ≤ x",
                        "fraction of requests ≤ x", "share of verify rounds"]
    for unit in ("TTFT (ms)", "TPOT (ms)", "gap between tokens (ms)", "E2E latency (ms)",
                 "tokens accepted per verify round"):
        assert f'text-anchor="middle">{unit}</text>' in page
    assert "<div class='scroll'><table>" in page and "width=device-width" in page


def test_live_progress_shows_each_arm_with_errors_and_acceptance() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    records = synthetic("zlab", 10, 8.0, seed=1, tokens=32) + synthetic("inhouse", 10, 8.0, seed=1, tokens=32,
                                                                         errors=1.0)
    with Progress(["zlab", "inhouse"], 10, console) as progress:
        for r in records:
            progress.observe(r)
    text = out.getvalue()
    assert "zlab" in text and "10/10" in text and "http_status=10" in text
    zlab = progress.tallies["zlab"]
    assert zlab.tokens == 320 and zlab.rounds > 0 and 6 < zlab.accepted_tokens / zlab.rounds < 11


def test_live_progress_counts_cancelled_requests_apart_from_errors() -> None:
    out = io.StringIO()
    records = synthetic("zlab", 4, 8.0, seed=1, tokens=32)
    records[3] = records[3].model_copy(update={"error_kind": "cancelled", "http_status": None})
    with Progress(["zlab"], 4, Console(file=out, force_terminal=True, width=100)) as progress:
        for r in records:
            progress.observe(r)
    tally = progress.tallies["zlab"]
    assert tally.done == 3 and tally.cancelled == 1 and not tally.errors
    assert "3/4 (1 cancelled)" in out.getvalue() and "cancelled=" not in out.getvalue()
