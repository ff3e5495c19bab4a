"""The simulator's Prometheus families (SGLang's names and labels) and the running figures `/server_info` shows.

Updated by the scheduler after a step's chunks are handed to their streams, so no stream waits on a metric. The
speculative figures follow SGLang's scheduler (``SchedulerMetricsReporter`` in
``managers/scheduler_components/metrics_reporter.py``): each verify round adds its batch's tokens and verify calls
to the current decode-log interval; every `DECODE_LOG_INTERVAL` rounds the interval's averages become the
`sglang:spec_accept_length` / `spec_accept_rate` / `gen_throughput` gauges and its sums join the since-start totals
behind `/server_info`'s `avg_spec_accept_length` (``SchedulerInternalState._average_accept_length``). Decode rounds
only: the prefill token is in no round, so these read lower than a request's `completion_tokens / spec_verify_ct`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from dfserve.metrics import SGLangMetrics

DECODE_LOG_INTERVAL = 40
"""SGLang's `--decode-log-interval` default: decode rounds per refresh of its spec gauges and running totals."""


@dataclass(frozen=True)
class RoundRecord:
    """What one verify round of the whole batch produced, in model time."""

    tokens: int
    verify_calls: int
    correct_drafts: int
    proposed_drafts: int
    duration_s: float


class Telemetry:
    """SGLang's families bound to this server's labels, plus the since-start acceptance of `/server_info`."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_total_tokens: int) -> None:
        metrics = SGLangMetrics.build(registry)
        labels = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0"}
        self.prompt_tokens = metrics.prompt_tokens.labels(**labels)
        self.generation_tokens = metrics.generation_tokens.labels(**labels)
        self.spec_verify_calls = metrics.spec_verify_calls.labels(**labels)
        self.cached_tokens = metrics.cached_tokens.labels(**labels)
        self.num_requests = metrics.num_requests.labels(**labels)
        self.num_aborted = metrics.num_aborted_requests.labels(**labels)
        self.ttft = metrics.ttft.labels(**labels)
        self.itl = metrics.itl.labels(**labels)
        self.e2e = metrics.e2e.labels(**labels)
        self.queue_time = metrics.queue_time.labels(**labels)
        self.running = metrics.num_running_reqs.labels(**labels)
        self.queued = metrics.num_queue_reqs.labels(**labels)
        self.gen_throughput = metrics.gen_throughput.labels(**labels)
        self.token_usage = metrics.token_usage.labels(**labels)
        self.cache_hit_rate = metrics.cache_hit_rate.labels(**labels)
        self.spec_accept_length = metrics.spec_accept_length.labels(**labels)
        self.spec_accept_rate = metrics.spec_accept_rate.labels(**labels)
        self._interval: list[RoundRecord] = []
        self._max_total_tokens = max_total_tokens
        self.total_tokens = 0
        self.total_verify_calls = 0
        self.last_gen_throughput = 0.0

    def prefill(self, prompt_tokens: int, ttfts_s: list[float], queue_times_s: list[float]) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        for ttft in ttfts_s:
            self.ttft.observe(ttft)
        for queued in queue_times_s:
            self.queue_time.observe(queued)

    def round(self, record: RoundRecord, gaps: list[tuple[float, int]]) -> None:
        """`gaps`: per request, (seconds since its previous chunk, tokens this round), observed once per token."""
        self.generation_tokens.inc(record.tokens)
        if record.verify_calls:
            self.spec_verify_calls.inc(record.verify_calls)
        for gap, tokens in gaps:
            per_token = gap / tokens
            for _ in range(tokens):
                self.itl.observe(per_token)
        self._interval.append(record)
        if len(self._interval) == DECODE_LOG_INTERVAL:
            self._log_interval()

    def _log_interval(self) -> None:
        rounds, self._interval = self._interval, []
        tokens = sum(r.tokens for r in rounds)
        seconds = sum(r.duration_s for r in rounds)
        verify = sum(r.verify_calls for r in rounds)
        proposed = sum(r.proposed_drafts for r in rounds)
        self.last_gen_throughput = tokens / seconds if seconds > 0 else 0.0
        self.gen_throughput.set(self.last_gen_throughput)
        if verify:
            self.spec_accept_length.set(tokens / verify)
            self.total_tokens += tokens
            self.total_verify_calls += verify
        if proposed:
            self.spec_accept_rate.set(sum(r.correct_drafts for r in rounds) / proposed)

    def aborted(self) -> None:
        """An `/abort_request` that aborted something; the request itself then finishes as any other does."""
        self.num_aborted.inc()

    def finished(self, e2e_s: float, aborted: bool) -> None:
        if aborted:
            self.num_aborted.inc()
        else:
            self.e2e.observe(e2e_s)
        self.num_requests.inc()

    def occupancy(self, running: int, queued: int, tokens_in_use: int) -> None:
        self.running.set(running)
        self.queued.set(queued)
        self.token_usage.set(tokens_in_use / self._max_total_tokens)

    @property
    def avg_spec_accept_length(self) -> float | None:
        """Since start, warm-up included, like SGLang's `internal_states[0].avg_spec_accept_length`: decode rounds
        of the logged intervals only; None before the first."""
        return self.total_tokens / self.total_verify_calls if self.total_verify_calls else None
