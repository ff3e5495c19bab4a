"""Prometheus metric names and buckets: defined here once, used by the simulator, the gateway and the load tester.

Dashboards and alert rules query exactly these names. Every family is built on an injected `CollectorRegistry`
(never the global one), so each app instance and each test has its own.

Two vocabularies live here:
- `SGLangMetrics`: the names SGLang's server emits (``python/sglang/srt/observability/metrics_collector.py``),
  used by dfserve's simulated engine so that dashboards built for SGLang work against it unchanged;
- `DfserveMetrics`: dfserve's own per-arm families, labelled `arm`, `replica`, `route`, shared by gateway and tester.

The gateway and the load tester each turn a finished request into one `Outcome` and hand it to `observe`, the one
function that updates the per-request families; it also holds the one decision of which requests count toward
them: every request toward `dfserve_requests_total`, only those that succeeded toward latency, tokens and acceptance.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dfserve import families

Family = TypeVar("Family", Counter, Gauge, Histogram)

ARM_NAME = re.compile(r"[A-Za-z0-9_-]+")
"""An arm's name, as the `arm` label, a header value, a `--set` path and a dashboard's matcher all take it."""
ARM_NAME_RULE = "ASCII letters, digits, '-' and '_'"

# Latency buckets in seconds, reaching minutes for long generations: at most 1.5 apart (mostly 1.25-1.33) from 5 ms
# (TTFT) and 0.5 ms (gaps) up to seconds, so that a dashboard's p95/p99, interpolated within a bucket, is off by a
# fraction of a bucket's width, not by the factor of two of doubling bounds.
TTFT_BUCKETS_S = (0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2,
                  0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10, 20, 60)
ITL_BUCKETS_S = (0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.0125,
                 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1)
E2E_BUCKETS_S = (0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 7.5, 10, 12.5,
                 15, 20, 25, 30, 40, 50, 60, 75, 90, 120, 300)
# Acceptance length is between 1 and the block size (16 for z-lab's drafters); half-token steps resolve a 3% change.
ACCEPT_LENGTH_BUCKETS = tuple(x / 2 for x in range(2, 33))
TOKEN_COUNT_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# --- SGLang's names (the server's, with the colon) -------------------------------------------------------------
SGLANG_PROMPT_TOKENS = "sglang:prompt_tokens"  # counter; exposed with _total
SGLANG_GENERATION_TOKENS = "sglang:generation_tokens"
SGLANG_SPEC_VERIFY_CALLS = "sglang:spec_verify_calls"
SGLANG_CACHED_TOKENS = "sglang:cached_tokens"
SGLANG_NUM_REQUESTS = "sglang:num_requests"
SGLANG_NUM_ABORTED_REQUESTS = "sglang:num_aborted_requests"
SGLANG_TTFT = "sglang:time_to_first_token_seconds"
SGLANG_ITL = "sglang:inter_token_latency_seconds"
SGLANG_E2E = "sglang:e2e_request_latency_seconds"
SGLANG_QUEUE_TIME = "sglang:queue_time_seconds"
SGLANG_NUM_RUNNING_REQS = "sglang:num_running_reqs"
SGLANG_NUM_QUEUE_REQS = "sglang:num_queue_reqs"
SGLANG_GEN_THROUGHPUT = "sglang:gen_throughput"
SGLANG_TOKEN_USAGE = "sglang:token_usage"
SGLANG_CACHE_HIT_RATE = "sglang:cache_hit_rate"
SGLANG_SPEC_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_SPEC_ACCEPT_RATE = "sglang:spec_accept_rate"
SGLANG_LABELS = ("model_name", "engine_type", "tp_rank")
DEPLOYMENT_LABEL = "deployment"
"""Target label Prometheus attaches to every engine it scrapes (static config or PodMonitor relabeling), naming the
deployment; SGLang's own labels cannot tell two deployments of the same model apart."""

# --- dfserve's names -------------------------------------------------------------------------------------------
REQUESTS = "dfserve_requests"  # counter; exposed with _total
REQUESTS_FAILED = "dfserve_requests_failed"
"""Of `dfserve_requests_total`, those that did not succeed (`status` not 2xx), by arm, route and replica only: its
series start at 0 with the arm's success series (`DfserveMetrics.start`), so an error ratio read from it and the
2xx series sees every failure. The failure series of `dfserve_requests_total` (by status and kind, open-ended)
appear at their first failure, which no `rate()` or `increase()` counts (Prometheus takes a series' first sample
for its start): they say why, this says how many."""
REQUESTS_IN_FLIGHT = "dfserve_requests_in_flight"
TTFT = "dfserve_time_to_first_token_seconds"
ITL_PER_TOKEN = "dfserve_inter_token_latency_per_token_seconds"
ITL_PER_CHUNK = "dfserve_inter_chunk_latency_seconds"
E2E = "dfserve_e2e_request_latency_seconds"
OUTPUT_TOKENS = "dfserve_output_tokens"
SPEC_OUTPUT_TOKENS = "dfserve_spec_output_tokens"
"""Completion tokens of only the requests that reported verify rounds: the numerator of pooled acceptance.
`dfserve_output_tokens` counts every request, also those without spec fields (streamed chat), so dividing it by
`dfserve_spec_verify_rounds` overstates acceptance whenever such traffic is mixed in."""
SPEC_VERIFY_ROUNDS = "dfserve_spec_verify_rounds"
ACCEPT_LENGTH = "dfserve_accept_length"
UPSTREAM_ERRORS = "dfserve_upstream_errors"
RETRIES = "dfserve_retries"
EJECTIONS = "dfserve_replica_ejections"
REPLICA_HEALTHY = "dfserve_replica_healthy"
SHADOW_REQUESTS = "dfserve_shadow_requests"
ARM_WEIGHT = "dfserve_arm_weight"
ARM_WINDOWED_ACCEPT_LENGTH = "dfserve_arm_windowed_accept_length"
CLIENT_CONNECTIONS_REFUSED = "dfserve_client_connections_refused"
REFUSAL_REASONS = ("over_capacity", "head_timeout", "body_timeout")
"""Why the gateway closed a client's connection on its own: it came with `max_connections` already open (answered
503), or it did not send a whole request head or body in time (answered 408)."""
REQUESTS_ANSWERED_BY_GATEWAY = "dfserve_gateway_answered_requests"
"""Requests the gateway answered itself before an arm took them, by status: 4xx (unreadable, too large, too slow,
or not allowed) or 500 (failed inside the gateway); `dfserve_requests_total` counts those an arm took."""
ROUTING_VERSION = "dfserve_gateway_routing_version"
"""1 on the one series whose `version` label is the hash of the routing a gateway runs (`gateway.watch`), so
`count by (version) (dfserve_gateway_routing_version)` counts the replicas on each version during a rollout."""
ROUTING_RELOADS = "dfserve_gateway_routing_reloads"  # counter; exposed with _total
RELOAD_OUTCOMES = ("applied", "refused")
"""Values of the `outcome` label of `dfserve_gateway_routing_reloads_total`."""
EVAL_WATCH_STEP = "dfserve_eval_watch_step"
EVAL_WATCH_TAU = "dfserve_eval_watch_tau"
EVAL_WATCH_BASELINE_TAU = "dfserve_eval_watch_baseline_tau"
EVAL_WATCH_TAU_GAP = "dfserve_eval_watch_tau_gap"
EVAL_WATCH_PROJECTED_CROSSING_STEP = "dfserve_eval_watch_projected_crossing_step"
EVAL_WATCH_PROJECTION = "dfserve_eval_watch_projection"
EVAL_WATCH_OUTCOMES = ("too_few_checkpoints", "reached", "will_reach", "plateau_below", "undetermined")
"""Values of the `outcome` label of `dfserve_eval_watch_projection` (1 on the current one, 0 on the others), pushed
by `dfserve eval watch` to a Pushgateway after each checkpoint it scores, grouped by `watch`; every family but the
step is labelled `method` (vanilla, ddtreeN)."""

SHADOW_DECISION = "dfserve_shadow_decision"
SHADOW_DECISION_STATES = ("deciding", "pass", "fail", "abandoned")
"""Values of the `state` label of `dfserve_shadow_decision` (1 on the current one, 0 on the others): a shadow
gateway with `until_decided` is judging its mirrored pairs (`deciding`), has decided the gate and stopped mirroring
(`pass`, `fail`), or has given the live decision up (`abandoned`: an exchange it waits for never came)."""
SHADOW_DECISION_PAIRS = "dfserve_shadow_decision_pairs"
"""Mirrored pairs the live decision has judged in its current record folder."""

OBSERVER_FAILURES = "dfserve_gateway_observer_failures"  # counter; exposed with _total
OBSERVER_FAILURE_REASONS = ("failed", "behind")
"""Why an observer of the gateway's finished exchanges missed one (`gateway.observers`): it raised, or its queue was
full (it fell behind). Neither ever fails or slows the client's request."""

ARM_LABELS = ("arm", "route")
GENERATION_ROUTES = ("native", "chat", "completions")
"""`route` values of generation requests (`/generate`, `/v1/chat/completions`, `/v1/completions`): an arm's traffic.
The gateway also relays metadata GETs to an arm under routes of their own (`models`, `server_info`,
`model_info`, `health_generate`), which the dashboards and rules leave out of request rates, error ratios and latencies."""
REQUEST_LABELS = (*ARM_LABELS, "replica", "status", "error")
"""Labels of `dfserve_requests_total`, the same from the gateway and the load tester (see `request_labels`):

- `status` is one of a fixed set: the HTTP status class of a finished answer (`2xx`; `4xx`/`5xx` for an error
  answer, from the engine or made by the gateway: 429 overloaded, 502/503/504 no replica; for a 200 stream that
  SGLang ended with an error in band, the class of the error's code); `499` when the client
  side gave up first (nginx's code for it); `error` when there was no complete answer and no HTTP error status
  (connection refused, timeout, a stream cut or unreadable after its 2xx headers, a 2xx answer that is not SGLang's,
  an answer aborted through SGLang's `/abort_request`, which carries no code).
- `error` is empty for a success, `http_status` for an HTTP error answer, `stream_error` for an error in band,
  else the producer's failure kind.

So `status!="2xx"` selects every failure, `status="5xx"` the server errors, and `error` says why."""
STATUS_OK = "2xx"
STREAM_ERROR = "stream_error"
"""Failure kind of a stream that SGLang answered with HTTP 200 and then ended with an error in band (an error event,
or an abort as the finish reason); its `status` label is the class of the code the error carried (`error` for an
abort through `/abort_request`, which carries none)."""
PROTOCOL_ERROR = "protocol"
"""Failure kind of a 2xx answer that is not SGLang's (a body or events that do not read as its JSON): no success,
whatever its status said; the load tester calls the same answer a protocol error."""
GATEWAY_STOPPED = "cancelled"
"""The failure kind of an exchange the gateway's own stop cut short."""
GATEWAY_OVERLOADED = "overloaded"
"""The failure kind of a request the gateway's own `max_concurrent_per_arm` refused (429) before its arm had it."""
CLIENT_LEFT_ERRORS = frozenset({"client_disconnect", "client_stalled", GATEWAY_STOPPED})
"""Failure kinds where the client side gave up, not the arm: the gateway's client went away or stopped reading, or
the load tester cancelled the request when its run stopped."""
Measure = Literal["exact", "estimated"]
MEASURES: tuple[Measure, ...] = ("exact", "estimated")
"""Values of the `measure` label on acceptance: exact from SGLang's spec fields, estimated from chunk counts."""


def request_labels(http_status: int | None, error: str | None) -> tuple[str, str]:
    """`status` and `error` of one finished request, from the HTTP status its client side saw (None or 0: none)
    and the producer's failure kind (None: no failure)."""
    if error in CLIENT_LEFT_ERRORS:
        return "499", error
    if http_status and http_status >= 400:
        return f"{http_status // 100}xx", error or "http_status"
    if error is not None or not http_status:
        return "error", error or "no_status"
    return f"{http_status // 100}xx", ""


def succeeded(http_status: int | None, error: str | None) -> bool:
    """A complete answer: a 2xx status and no failure, in band or out."""
    return request_labels(http_status, error)[0] == STATUS_OK


@dataclass(frozen=True, slots=True)
class Binned:
    """Observations already counted into the buckets of a histogram (its bounds, then +Inf), and their sum."""

    counts: tuple[int, ...]
    total: float

    @classmethod
    def of(cls, values: Iterable[float], bounds: tuple[float, ...] = ITL_BUCKETS_S) -> Binned:
        """Count `values` as a Prometheus histogram with `bounds` does (a value goes to the first bucket whose
        bound is not below it)."""
        counts = [0] * (len(bounds) + 1)
        total = 0.0
        for value in values:
            counts[bisect_left(bounds, value)] += 1
            total += value
        return cls(tuple(counts), total)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished request as dfserve's per-request families see it, from the gateway's relay or the load tester:
    the one type both turn their raw facts into, so that a series means the same from either (`observe`)."""

    arm: str
    route: str
    replica: str
    status: int | None
    """The answer's status: its HTTP status, or the code an in-band error event carried; None or 0: no answer."""
    error: str | None
    """The failure kind; None for a complete answer."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_gaps: Binned | None = None
    """Gaps between the chunks that carried output, binned on `ITL_BUCKETS_S`."""
    token_gaps: Binned | None = None
    """The same gaps spread over the tokens each chunk carried, once per token; None where tokens per chunk are not
    visible (OpenAI streams count chunks of text, not tokens)."""
    output_tokens: int | None = None
    verify_rounds: int | None = None
    """Verify rounds SGLang reported for this request (exact acceptance only)."""
    accept_length: float | None = None
    measure: Measure | None = None


def observe(metrics: DfserveMetrics, outcome: Outcome) -> None:
    """Update every per-request family with one finished request.

    Which requests count, decided once for the gateway and the load tester alike: `dfserve_requests_total` counts
    every request (its labels say how it ended); every other per-request family (TTFT, inter-token and inter-chunk
    latency, end-to-end latency, output tokens, verify rounds, acceptance) counts only requests that succeeded (a
    complete 2xx answer without an in-band error), as the load test's summary and the judge do. A failed stream's
    first token and gaps are then not latencies of an answer: a stream cut after its first chunk would otherwise
    improve TTFT while it failed the user.
    """
    o = outcome
    metrics.finished(o.arm, o.route, o.replica, o.status, o.error).inc()
    if not succeeded(o.status, o.error):
        metrics.failed.labels(o.arm, o.route, o.replica).inc()
        return
    arm, route = o.arm, o.route
    if o.ttft_s is not None:
        metrics.ttft.labels(arm, route).observe(o.ttft_s)
    if o.e2e_s is not None:
        metrics.e2e.labels(arm, route).observe(o.e2e_s)
    if o.chunk_gaps is not None:
        metrics.itl_per_chunk.labels(arm, route).add_binned(o.chunk_gaps.counts, o.chunk_gaps.total)
    if o.token_gaps is not None:
        metrics.itl_per_token.labels(arm, route).add_binned(o.token_gaps.counts, o.token_gaps.total)
    if o.output_tokens:
        metrics.output_tokens.labels(arm, route).inc(o.output_tokens)
    if o.verify_rounds:
        metrics.spec_verify_rounds.labels(arm, route).inc(o.verify_rounds)
        metrics.spec_output_tokens.labels(arm, route).inc(o.output_tokens or 0)
    if o.accept_length is not None and o.measure is not None:
        metrics.accept_length.labels(arm, route, o.measure).observe(o.accept_length)


@dataclass(frozen=True)
class SGLangMetrics:
    """The families an SGLang server exports with `--enable-metrics`, labelled like SGLang's."""

    prompt_tokens: Counter
    generation_tokens: Counter
    spec_verify_calls: Counter
    cached_tokens: Counter
    num_requests: Counter
    num_aborted_requests: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram
    num_running_reqs: Gauge
    num_queue_reqs: Gauge
    gen_throughput: Gauge
    token_usage: Gauge
    cache_hit_rate: Gauge
    spec_accept_length: Gauge
    spec_accept_rate: Gauge

    @classmethod
    def build(cls, registry: CollectorRegistry) -> SGLangMetrics:
        labels = SGLANG_LABELS

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        return cls(
            prompt_tokens=counter(SGLANG_PROMPT_TOKENS, "Number of prefill tokens processed."),
            generation_tokens=counter(SGLANG_GENERATION_TOKENS, "Number of generation tokens processed."),
            spec_verify_calls=counter(SGLANG_SPEC_VERIFY_CALLS, "Number of speculative verify rounds."),
            cached_tokens=counter(SGLANG_CACHED_TOKENS, "Number of cached prompt tokens."),
            num_requests=counter(SGLANG_NUM_REQUESTS, "Number of requests processed."),
            num_aborted_requests=counter(SGLANG_NUM_ABORTED_REQUESTS, "Number of requests aborted."),
            ttft=histogram(SGLANG_TTFT, "Histogram of time to first token in seconds.", TTFT_BUCKETS_S),
            itl=histogram(SGLANG_ITL, "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S),
            e2e=histogram(SGLANG_E2E, "Histogram of end-to-end request latency in seconds.", E2E_BUCKETS_S),
            queue_time=histogram(SGLANG_QUEUE_TIME, "Histogram of queueing time in seconds.", TTFT_BUCKETS_S),
            num_running_reqs=gauge(SGLANG_NUM_RUNNING_REQS, "The number of running requests."),
            num_queue_reqs=gauge(SGLANG_NUM_QUEUE_REQS, "The number of requests in the waiting queue."),
            gen_throughput=gauge(SGLANG_GEN_THROUGHPUT, "The generation throughput (token/s)."),
            token_usage=gauge(SGLANG_TOKEN_USAGE, "The token usage of the KV cache."),
            cache_hit_rate=gauge(SGLANG_CACHE_HIT_RATE, "The prefix cache hit rate."),
            spec_accept_length=gauge(SGLANG_SPEC_ACCEPT_LENGTH, "The average acceptance length of speculative decoding."),
            spec_accept_rate=gauge(SGLANG_SPEC_ACCEPT_RATE, "The average acceptance rate of speculative decoding."),
        )


@dataclass(frozen=True)
class DfserveMetrics:
    """dfserve's per-arm families, measured at the client side of each arm (gateway relay or load tester).

    The families updated on every request are dfserve's own (`dfserve.families`: no lock per update, and
    `labels()` is one dictionary lookup); the rest are prometheus_client's, looked up through `child`."""

    requests: families.Counter
    failed: families.Counter
    in_flight: families.Gauge
    ttft: families.Histogram
    itl_per_token: families.Histogram
    itl_per_chunk: families.Histogram
    e2e: families.Histogram
    output_tokens: families.Counter
    spec_output_tokens: families.Counter
    spec_verify_rounds: families.Counter
    accept_length: families.Histogram
    upstream_errors: Counter
    retries: Counter
    ejections: Counter
    replica_healthy: Gauge
    shadow_requests: Counter
    arm_weight: Gauge
    arm_windowed_accept_length: Gauge
    client_connections_refused: Counter
    answered_by_gateway: Counter
    _children: dict[tuple[object, ...], Any] = field(default_factory=dict, repr=False, compare=False)

    def child(self, family: Family, *labels: str) -> Family:
        """`family.labels(*labels)` of a prometheus_client family, looked up once: `labels()` builds a key and takes
        a lock on every call."""
        key = (family, *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = family.labels(*labels)
        return cast(Family, found)

    def start(self, arm: str, routes: Iterable[str], replicas: Iterable[str]) -> None:
        """An arm's success series at 0 before its first request: Prometheus takes a series' first sample for its
        start, so what it counted before its first scrape would be in no `rate()` or `increase()` (a dashboard's
        first minute of an arm, a rule's error ratio). Failed requests are counted from 0 by arm, route and replica
        (`REQUESTS_FAILED`), also under no replica (`""`: the gateway's own refusals, before a replica had the
        request); their series by status and kind are not started: those are open-ended."""
        replicas = tuple(replicas)
        for route in routes:
            for replica in replicas:
                self.requests.labels(arm, route, replica, STATUS_OK, "")
            for replica in dict.fromkeys((*replicas, "")):
                self.failed.labels(arm, route, replica)
            for family in (self.ttft, self.itl_per_token, self.itl_per_chunk, self.e2e, self.output_tokens,
                           self.spec_output_tokens, self.spec_verify_rounds):
                family.labels(arm, route)
            for measure in MEASURES:
                self.accept_length.labels(arm, route, measure)

    def finished(self, arm: str, route: str, replica: str, status: int | None,
                 error: str | None) -> families.CounterSeries:
        """The `requests` series of one finished request (labels as `request_labels` sets them)."""
        return self.requests.labels(arm, route, replica, *request_labels(status, error))

    @classmethod
    def build(cls, registry: CollectorRegistry) -> DfserveMetrics:
        arm = ARM_LABELS
        return cls(
            requests=families.Counter(REQUESTS, "Requests finished; status: 2xx, 4xx, 5xx, 499 (client gave up) or "
                                      "error (no complete answer); error: the failure kind, empty on success.",
                                      REQUEST_LABELS, registry),
            failed=families.Counter(REQUESTS_FAILED, "Of dfserve_requests_total, those without status 2xx; from 0 "
                                    "for each arm, route and replica, for error ratios.", (*ARM_LABELS, "replica"),
                                    registry),
            in_flight=families.Gauge(REQUESTS_IN_FLIGHT, "Requests in flight.", arm, registry),
            ttft=families.Histogram(TTFT, "Time to first token seen by the client side, seconds.", arm, TTFT_BUCKETS_S,
                                    registry),
            itl_per_token=families.Histogram(ITL_PER_TOKEN, "Gap between chunks divided over the tokens the chunk "
                                             "carried, one sample per token, seconds.", arm, ITL_BUCKETS_S, registry),
            itl_per_chunk=families.Histogram(ITL_PER_CHUNK, "Gap between successive stream chunks, one sample per "
                                             "chunk, seconds.", arm, ITL_BUCKETS_S, registry),
            e2e=families.Histogram(E2E, "End-to-end request latency, seconds.", arm, E2E_BUCKETS_S, registry),
            output_tokens=families.Counter(OUTPUT_TOKENS, "Completion tokens received.", arm, registry),
            spec_output_tokens=families.Counter(SPEC_OUTPUT_TOKENS, "Completion tokens of the requests counted in "
                                                "dfserve_spec_verify_rounds: the numerator of pooled acceptance.", arm,
                                                registry),
            spec_verify_rounds=families.Counter(SPEC_VERIFY_ROUNDS, "Speculative verify rounds reported by meta_info.",
                                                arm, registry),
            accept_length=families.Histogram(ACCEPT_LENGTH, "Per-request acceptance length (tokens per verify round, "
                                             "bonus included); measure=exact from meta_info, estimated from chunk "
                                             "counts.", (*arm, "measure"), ACCEPT_LENGTH_BUCKETS, registry),
            upstream_errors=Counter(UPSTREAM_ERRORS, "Upstream failures by kind.", ("arm", "replica", "kind"),
                                    registry=registry),
            retries=Counter(RETRIES, "Requests retried on another replica of the same arm.", ("arm", "replica"),
                            registry=registry),
            ejections=Counter(EJECTIONS, "Replicas ejected as unhealthy.", ("arm", "replica"), registry=registry),
            replica_healthy=Gauge(REPLICA_HEALTHY, "1 when the replica is admitted, 0 when ejected.",
                                  ("arm", "replica"), registry=registry),
            shadow_requests=Counter(SHADOW_REQUESTS, "Mirrored requests by outcome.", ("arm", "outcome"),
                                    registry=registry),
            arm_weight=Gauge(ARM_WEIGHT, "Configured traffic weight of an arm.", ("arm",), registry=registry),
            arm_windowed_accept_length=Gauge(
                ARM_WINDOWED_ACCEPT_LENGTH,
                "Acceptance length of an arm over the last scrape window, from its replicas' SGLang counters "
                "(Δ generation_tokens / Δ spec_verify_calls).", ("arm",), registry=registry),
            client_connections_refused=Counter(
                CLIENT_CONNECTIONS_REFUSED, "Client connections the gateway closed on its own; reason: over_capacity "
                "(answered 503), head_timeout or body_timeout (a request not sent in time, answered 408).",
                ("reason",), registry=registry),
            answered_by_gateway=Counter(
                REQUESTS_ANSWERED_BY_GATEWAY, "Requests the gateway answered itself before an arm took them, by "
                "status: 4xx (unreadable, too large, too slow or not allowed) or 500 (failed inside the gateway).",
                ("status",),
                registry=registry),
        )


@dataclass(frozen=True)
class RoutingMetrics:
    """The gateway's view of its routing source: which version it runs and how its reloads went."""

    version: Gauge
    reloads: Counter

    @classmethod
    def build(cls, registry: CollectorRegistry) -> RoutingMetrics:
        """The families, every outcome's series at 0 from the start, so `increase()` sees the first reload."""
        reloads = Counter(ROUTING_RELOADS, "Changed routing files read: applied, or refused (the last good routing "
                          "stays).", ("outcome",), registry=registry)
        for outcome in RELOAD_OUTCOMES:
            reloads.labels(outcome)
        return cls(
            version=Gauge(ROUTING_VERSION, "1 for the hash of the routing (mode, arms, weights) this gateway runs.",
                          ("version",), registry=registry),
            reloads=reloads,
        )


@dataclass(frozen=True)
class ObserverMetrics:
    """What became of the exchanges handed to the gateway's observers that they did not take."""

    failures: Counter

    @classmethod
    def build(cls, registry: CollectorRegistry) -> ObserverMetrics:
        return cls(Counter(OBSERVER_FAILURES, "Finished exchanges an observer missed; reason: failed (it raised) or "
                           "behind (its queue was full, the exchange was dropped for it).", ("observer", "reason"),
                           registry=registry))

    def watch(self, observer: str) -> dict[str, Counter]:
        """The series of one observer, every reason's at 0 from its registration, so `increase()` sees the first."""
        return {reason: self.failures.labels(observer, reason) for reason in OBSERVER_FAILURE_REASONS}


@dataclass(frozen=True)
class ShadowDecisionMetrics:
    """Where a shadow gateway's live decision stands (`dfserve.shadow.monitor`); set from the recorder's thread."""

    state: Gauge
    pairs: Gauge

    @classmethod
    def build(cls, registry: CollectorRegistry) -> ShadowDecisionMetrics:
        return cls(
            state=Gauge(SHADOW_DECISION, "1 on the live decision's state (deciding, pass, fail, abandoned), 0 on "
                        "the others; pass or fail: mirroring has stopped.", ("state",), registry=registry),
            pairs=Gauge(SHADOW_DECISION_PAIRS, "Mirrored pairs judged in the current record folder.",
                        registry=registry),
        )

    def set_state(self, state: str) -> None:
        for each in SHADOW_DECISION_STATES:
            self.state.labels(each).set(1 if each == state else 0)


@dataclass(frozen=True)
class EvalWatchMetrics:
    """A training run's latest scored checkpoint against its baseline, and the projection of where it is heading."""

    step: Gauge
    tau: Gauge
    baseline_tau: Gauge
    tau_gap: Gauge
    projected_crossing_step: Gauge
    projection: Gauge

    @classmethod
    def build(cls, registry: CollectorRegistry) -> EvalWatchMetrics:
        method = ("method",)
        return cls(
            step=Gauge(EVAL_WATCH_STEP, "Training step of the latest checkpoint scored.", registry=registry),
            tau=Gauge(EVAL_WATCH_TAU, "Offline τ (tokens per verify round) of the latest checkpoint scored.", method,
                      registry=registry),
            baseline_tau=Gauge(EVAL_WATCH_BASELINE_TAU, "Offline τ of the baseline drafter on the same features.",
                               method, registry=registry),
            tau_gap=Gauge(EVAL_WATCH_TAU_GAP, "Latest checkpoint's τ minus the baseline's (negative: below it).",
                          method, registry=registry),
            projected_crossing_step=Gauge(
                EVAL_WATCH_PROJECTED_CROSSING_STEP, "Step at which the fitted τ curve reaches the baseline's; absent "
                "when the fit places no crossing.", method, registry=registry),
            projection=Gauge(EVAL_WATCH_PROJECTION, "1 on the projection's current outcome (plateau_below: the run "
                             "is projected not to reach the baseline), 0 on the others.", (*method, "outcome"),
                             registry=registry),
        )
