"""Per-arm summaries of a run (summary.json) and its report.html: every figure with its n and a 95% interval.

Latency quantiles carry distribution-free order-statistic intervals; acceptance (Σ completion tokens / Σ verify
rounds) carries a bootstrap over tasks. report.html is self-contained: inline SVG latency CDFs and the histogram of
tokens per verify round, no plotting library.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dfserve.loadtest import records as rec
from dfserve.loadtest.config import RunConfig
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.schedule import ScheduleFidelity, schedule_fidelity
from dfserve.runs import SealedSummary
from dfserve.stamped_socket import ReadLag
from dfserve.svg import page, svg_cdf, svg_histogram, table
from dfserve.verdict import stats
from dfserve.verdict.results import Figure


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Distribution(_Model):
    n: int
    mean: float
    p50: Figure
    p90: float
    p95: Figure
    p99: Figure
    max: float


class ReadWithNext(_Model):
    """Token chunks that reached the tester in one read with the next chunk of their response, and so carry its
    date: the server sent them together, or the tester's loop left the first unread until the next arrived (then
    its TTFT or inter-chunk gap is off by up to a chunk gap; `read_lag_warning`)."""

    first_chunks: int = Field(ge=0, description="requests whose first token chunk was read with the second")
    of_first_chunks: int = Field(ge=1, description="requests with two token chunks or more")
    chunks: int = Field(ge=0, description="token chunks read with the next one")
    of_chunks: int = Field(ge=1, description="token chunks with a next one")

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> ReadWithNext | None:
        """Of answered records; None where none has two token chunks."""
        together = [rec.read_with_next(r) for r in records if len(r.chunk_times_s) >= 2]
        return cls(first_chunks=sum(flags[0] for flags in together), of_first_chunks=len(together),
                   chunks=sum(map(sum, together)), of_chunks=sum(map(len, together))) if together else None

    def surely_over(self, share: float) -> bool:
        """Whether the first chunks or all chunks read with the next are over `share` beyond sampling noise (the low
        end of the 95% Wilson interval): one in sixty is not one in a hundred."""
        return any(interval is not None and interval.low > share
                   for interval in (stats.wilson(self.first_chunks, self.of_first_chunks),
                                    stats.wilson(self.chunks, self.of_chunks)))


class ArmSummary(_Model):
    arm: str
    requests: int
    succeeded: int
    errors: dict[str, int] = Field(description="Failed requests by kind; HTTP error answers by status (`http_503`).")
    error_rate: float = Field(description="failed / (requests - cancelled)")
    cancelled: int = Field(0, description="requests the tester cancelled when it was stopped: not answered, and "
                           "not errors of the arm")
    acceptance: Literal["exact", "estimated", "unknown"]
    accept_length: Figure | None
    ttft_s: Distribution | None
    tpot_s: Distribution | None
    itl_per_token_s: Distribution | None
    itl_per_chunk_s: Distribution | None
    e2e_s: Distribution | None
    wait_s: Distribution | None
    output_tokens: int
    output_tokens_per_s: float | None
    round_tokens_histogram: list[int]
    simulated: bool
    tester_read_lag: ReadLag | None = Field(None, description="how long responses' bytes waited in the kernel "
                                            "for the tester's loop (None: reads dated by the loop)")
    read_with_next: ReadWithNext | None = Field(None, description="token chunks dated by the next one because "
                                                "both came in one read (None: no request had two chunks)")


class Summary(SealedSummary):
    schema_version: Literal[1] = 1
    kind: Literal["loadtest-summary"] = "loadtest-summary"
    run_id: str
    interrupted: bool
    arms: tuple[ArmSummary, ...]
    schedule_fidelity: dict[str, ScheduleFidelity] = Field(default_factory=dict, description="open loop, per arm: "
                                                           "how late measured requests were sent against schedule")
    records_sha256: str | None = Field(None, description="sha256 of requests.jsonl as written (`runs.unsealed`): "
                                       "a record edited since shows, whatever figures are kept")
    config_sha256: str | None = Field(None, description="sha256 of config.json as written: the settings a verdict "
                                      "compares two runs on; None in a summary older than this seal")


def _figure(interval: stats.Interval | None, n: int) -> Figure | None:
    if interval is None:
        return None
    return Figure(estimate=interval.estimate, low=interval.low, high=interval.high, n=n)


def distribution(values: Sequence[float]) -> Distribution | None:
    if not values:
        return None
    array = np.asarray(values, dtype=float)
    n = len(array)

    def q(p: float) -> Figure:
        figure = _figure(stats.quantile_interval(array, p), n)
        assert figure is not None
        return figure

    p90 = stats.quantile(array, 0.9)
    assert p90 is not None
    return Distribution(n=n, mean=float(array.mean()), p50=q(0.5), p90=p90, p95=q(0.95), p99=q(0.99),
                        max=float(array.max()))


def accept_length_figure(records: Sequence[RequestRecord], seed: int = 0, draws: int = 2000) -> Figure | None:
    """Σ completion tokens / Σ verify rounds, with a bootstrap interval over tasks."""
    rows = [(r.task_id, r.completion_tokens, rec.verify_rounds(r)) for r in records]
    rows = [(t, c, v) for t, c, v in rows if c is not None and v]
    if not rows:
        return None
    tasks = sorted({t for t, _, _ in rows})
    position = {t: i for i, t in enumerate(tasks)}
    tokens = np.zeros(len(tasks))
    rounds = np.zeros(len(tasks))
    for task, completion, verify in rows:
        tokens[position[task]] += completion
        rounds[position[task]] += verify
    estimate = float(tokens.sum() / rounds.sum())
    weights = stats.cluster_weights(len(tasks), draws, np.random.default_rng(seed))
    interval = stats.percentile_interval(estimate, stats.weighted_ratio(weights, tokens, rounds), len(tasks))
    return _figure(interval, len(rows))


def _flat(records: Sequence[RequestRecord], f: Callable[[RequestRecord], list[float]]) -> list[float]:
    return [value for r in records for value in f(r)]


def _each(records: Sequence[RequestRecord], f: Callable[[RequestRecord], float | None]) -> list[float]:
    return [v for v in map(f, records) if v is not None]


def _error_name(r: RequestRecord) -> str:
    return f"http_{r.http_status}" if r.error_kind == "http_status" and r.http_status else str(r.error_kind)


def over_error_rate(summary: Summary, max_error_rate: float) -> list[ArmSummary]:
    """The arms whose share of failed measured requests is above `max_error_rate` (0 to 1)."""
    return [a for a in summary.arms if a.error_rate > max_error_rate]


def summarize_arm(arm: str, records: Sequence[RequestRecord]) -> ArmSummary:
    """Figures of one arm's measured (non-warm-up) records."""
    measured = rec.measured_records(records)
    ok = [r for r in measured if r.ok]
    cancelled = sum(r.cancelled for r in measured)
    errors = Counter(_error_name(r) for r in measured if r.error_kind is not None and not r.cancelled)
    answered = len(measured) - cancelled
    # Requests without a verify round (one token, or an engine without speculation) have no acceptance to measure;
    # they leave the figure to the others, and its label says how the others measured it.
    known = {r.acceptance for r in ok} - {"unknown"}
    acceptance: Literal["exact", "estimated", "unknown"] = (
        "exact" if known == {"exact"} else "estimated" if known else "unknown"
    )
    output_tokens = sum(r.completion_tokens or 0 for r in ok)
    starts = [r.sent_s for r in ok if r.sent_s is not None]
    ends = [r.end_s for r in ok if r.end_s is not None]
    span = max(ends) - min(starts) if starts and ends else 0.0
    histogram = Counter(t for r in ok for t in rec.round_tokens(r))
    return ArmSummary(
        arm=arm,
        requests=len(measured),
        succeeded=len(ok),
        errors=dict(sorted(errors.items())),
        error_rate=(answered - len(ok)) / answered if answered else 0.0,
        cancelled=cancelled,
        acceptance=acceptance,
        accept_length=accept_length_figure(ok) if acceptance != "unknown" else None,
        ttft_s=distribution(_each(ok, rec.ttft_s)),
        tpot_s=distribution(_each(ok, rec.tpot_s)),
        itl_per_token_s=distribution(_flat(ok, rec.itl_per_token_s)),
        itl_per_chunk_s=distribution(_flat(ok, rec.itl_per_chunk_s)),
        e2e_s=distribution(_each(ok, rec.e2e_s)),
        wait_s=distribution([rec.wait_s(r) for r in measured if r.scheduled_s is not None]),
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / span if span > 0 else None,
        round_tokens_histogram=[histogram.get(k, 0) for k in range(max(histogram, default=-1) + 1)],
        simulated=any(r.simulated for r in measured),
        read_with_next=ReadWithNext.of(ok),
    )


def figures_differ(summary: ArmSummary, records: Sequence[RequestRecord]) -> bool:
    """The figures summary.json gives an arm are not those of its records (one or the other was edited): all but
    the tester's read lag, which its records do not hold."""
    exclude = {"tester_read_lag"}
    return summarize_arm(summary.arm, records).model_dump_json(exclude=exclude) != summary.model_dump_json(
        exclude=exclude)


def summarize(config: RunConfig, records: Sequence[RequestRecord], interrupted: bool,
              read_lag: Mapping[str, ReadLag]) -> Summary:
    arms = tuple(summarize_arm(arm.name, [r for r in records if r.arm == arm.name]).model_copy(
        update={"tester_read_lag": read_lag.get(arm.name)}) for arm in config.arms)
    fidelity = {arm.name: schedule_fidelity([(r.scheduled_s, r.sent_s) for r in rec.measured_records(records)
                                             if r.arm == arm.name and r.scheduled_s is not None
                                             and r.sent_s is not None]) for arm in config.arms}
    return Summary(run_id=config.run_id, interrupted=interrupted, arms=arms,
                   schedule_fidelity={name: f for name, f in fidelity.items() if f is not None})


READ_WITH_NEXT_WARNED = 0.01
"""A run warns when surely more than this share of an arm's first chunks, or of all its chunks, came in one read
with the next while the tester's loop fell behind: enough to move a p99."""
READ_LAG_WARNED_S = 1e-3
"""The least wait that counts as falling behind: a chunk dated by one that came under 1 ms later is not worth a
warning (and a server that sends its chunks together makes the median gap nothing)."""


def read_lag_warning(summary: Summary) -> str | None:
    """One line when the tester's loop fell behind enough to date some arm's chunks by the next ones
    (dfserve/stamped_socket.py): surely more than `READ_WITH_NEXT_WARNED` of its first chunks or of all its chunks
    read with the next, and reads left waiting half a median chunk gap or more (`READ_LAG_WARNED_S` at least). Either
    alone is not the tester's error: a server may send chunks together, and one read left waiting in thousands
    moves no figure."""
    for a in summary.arms:
        lag, gap, together = a.tester_read_lag, a.itl_per_chunk_s, a.read_with_next
        if lag is None or gap is None or together is None:
            continue
        behind = lag.max_lag_s >= max(gap.p50.estimate / 2, READ_LAG_WARNED_S)
        if behind and together.surely_over(READ_WITH_NEXT_WARNED):
            return (f"warning: arm {a.arm}: {together.first_chunks} of {together.of_first_chunks} first chunks and "
                    f"{together.chunks} of {together.of_chunks} chunks came in one read with the next one, so are "
                    f"dated by it, while the tester read some bytes up to {lag.max_lag_s * 1e3:.1f} ms after they "
                    f"arrived (chunks {gap.p50.estimate * 1e3:.1f} ms apart): TTFT and inter-chunk tails may be off "
                    "by a chunk gap; spread the load over processes (--shard) or lower --concurrency")
    return None


# ---------------------------------------------------------------------------------------------------------------
# report.html

_DATED_BY = {"kernel": "the kernel, as bytes arrived", "loop": "the tester, as it read them"}


def _read_lag(lag: ReadLag | None) -> str:
    if lag is None:
        return "not measured"
    late = f"{lag.late_reads / lag.reads:.2%} of {lag.reads} reads 1 ms or more late" if lag.reads else "no reads"
    return f"max {lag.max_lag_s * 1e3:.2f} ms; {late}"


def _read_with_next(together: ReadWithNext | None) -> str:
    if together is None:
        return "n/a"
    return (f"first {together.first_chunks} of {together.of_first_chunks} "
            f"({together.first_chunks / together.of_first_chunks:.2%}); all {together.chunks} of {together.of_chunks} "
            f"({together.chunks / together.of_chunks:.2%})")


def _row(label: str, values: list[str]) -> str:
    return f"<tr><th>{html.escape(label)}</th>" + "".join(f"<td>{html.escape(v)}</td>" for v in values) + "</tr>"


def _ms(d: Distribution | None, which: str) -> str:
    if d is None:
        return "n/a"
    figure: Figure = getattr(d, which)
    return f"{figure.estimate * 1000:.1f} [{figure.low * 1000:.1f}, {figure.high * 1000:.1f}] ms (n={figure.n})"


def render_html(config: RunConfig, summary: Summary, records: Sequence[RequestRecord]) -> str:
    measured = [r for r in rec.measured_records(records) if r.ok]
    by_arm = {a.arm: [r for r in measured if r.arm == a.arm] for a in summary.arms}
    names = [a.arm for a in summary.arms]
    rows = [
        "<tr><th></th>" + "".join(f"<th>{html.escape(n)}</th>" for n in names) + "</tr>",
        _row("requests (ok / all)", [f"{a.succeeded} / {a.requests}" for a in summary.arms]),
        _row("errors", [", ".join(f"{k}={v}" for k, v in a.errors.items()) or "none" for a in summary.arms]),
        _row("cancelled at the stop", [str(a.cancelled) for a in summary.arms]),
        _row("arrivals dated by", [_DATED_BY[config.arm(a.arm).arrival_stamps] for a in summary.arms]),
        _row("tester read lag", [_read_lag(a.tester_read_lag) for a in summary.arms]),
        _row("chunks read with the next", [_read_with_next(a.read_with_next) for a in summary.arms]),
        _row("acceptance length", [
            f"{a.accept_length.estimate:.3f} [{a.accept_length.low:.3f}, {a.accept_length.high:.3f}] ({a.acceptance}, "
            f"n={a.accept_length.n})" if a.accept_length else "unknown" for a in summary.arms]),
        *(_row(f"{label} {q}", [_ms(getattr(a, field), q) for a in summary.arms])
          for label, field in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL per token", "itl_per_token_s"),
                               ("ITL per chunk", "itl_per_chunk_s"), ("E2E", "e2e_s"))
          for q in ("p50", "p95", "p99")),
        _row("output tokens/s", [f"{a.output_tokens_per_s:.1f}" if a.output_tokens_per_s else "n/a" for a in summary.arms]),
    ]
    plots = [svg_cdf(f"{name}: share of requests within x", {n: _each(rs, f) for n, rs in by_arm.items()},
                     f"{name} (ms)", "fraction of requests ≤ x")
             for name, f in (("TTFT", rec.ttft_s), ("TPOT", rec.tpot_s), ("E2E latency", rec.e2e_s))]
    plots.insert(2, svg_cdf("ITL per token: share of token gaps within x",
                            {n: _flat(rs, rec.itl_per_token_s) for n, rs in by_arm.items()},
                            "gap between tokens (ms)", "fraction of gaps ≤ x"))
    plots.append(svg_histogram("tokens accepted per verify round", {a.arm: a.round_tokens_histogram
                                                                    for a in summary.arms}))
    simulated = any(a.simulated for a in summary.arms)
    body = (
        f"<h1>Run {html.escape(config.run_id)}</h1>"
        + ("<p><strong>SIMULATED engines: these figures come from dfserve's simulator, not a GPU.</strong></p>"
           if simulated else "")
        + ("<p><strong>Interrupted: partial run.</strong></p>" if summary.interrupted else "")
        + f"<p>tasks {html.escape(config.tasks.name)} ({config.tasks.sha256[:12]}), {config.num_requests} requests "
        f"+ {config.warmup} warm-up {html.escape(config.describe_routes())}; {html.escape(config.load.describe())}; "
        f"{html.escape(config.sampling.describe())}. Intervals are 95%.</p>"
        + table(rows) + "<div class='plots'>" + "".join(plots) + "</div>"
    )
    return page(config.run_id, body)
