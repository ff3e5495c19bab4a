"""Relay one upstream response to the client, byte for byte, while timing it and reading acceptance as it passes.

Streams go out as they arrive (no buffering of whole streams), cut only at event boundaries so that a stream that
fails after its first byte can still end with a well-formed error event. Whole responses are read, measured and
sent; for non-streamed chat the gateway asked SGLang for `meta_info` itself and strips it again here.

Acceptance per request, as exactly as the protocol allows (ARCHITECTURE.md, principle 6):
- native `/generate`: `completion_tokens / spec_verify_ct` from the final `meta_info` (exact);
- non-streamed chat: the same, from the `meta_info` the gateway asked for (exact);
- streamed chat and completions: usage tokens over content chunks (estimated; needs `include_usage`).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import Histogram

from dfserve import sglang
from dfserve.errors import ProtocolError
from dfserve.headers import ARM, REPLICA
from dfserve.metrics import DfserveMetrics
from gateway.server import Responder
from gateway.upstream import MID_STREAM, Opened, mid_stream_error

Measure = Literal["exact", "estimated"]

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
    b"transfer-encoding", b"upgrade",
})
ARM_HEADER = ARM.encode()
REPLICA_HEADER = REPLICA.encode()


def event_boundary(buffer: bytes) -> int:
    """Length of the longest prefix of `buffer` that ends with a complete server-sent event (0 if none)."""
    lf = buffer.rfind(b"\n\n")
    crlf = buffer.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def response_headers(raw: Any, arm: str, replica: str, drop_length: bool) -> list[tuple[bytes, bytes]]:
    """Upstream headers minus hop-by-hop ones (and Content-Length when the body changes), plus arm and replica."""
    headers = [
        (name.lower(), value) for name, value in raw
        if name.lower() not in HOP_BY_HOP and not (drop_length and name.lower() == b"content-length")
    ]
    headers.append((ARM_HEADER, arm.encode()))
    headers.append((REPLICA_HEADER, replica.encode()))
    return headers


@dataclass
class Acceptance:
    """One request's output tokens and acceptance length; None where the protocol did not show it."""

    output_tokens: int | None = None
    verify_ct: int | None = None
    accept_length: float | None = None
    measure: Measure | None = None


@dataclass
class Exchange:
    """Raw facts about one relayed request (perf_counter seconds), turned into metrics by `record`."""

    arm: str
    route: str
    replica: str = ""
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    end: float | None = None
    status: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    token_gaps: list[tuple[float, int]] = field(default_factory=list)
    acceptance: Acceptance = field(default_factory=Acceptance)
    error: str | None = None
    unparsed: str | None = None


class NativeStream:
    """Reads native `/generate` events: cumulative `completion_tokens` per chunk, then the final `spec_verify_ct`.

    Both are read from the bytes (no JSON decoding per request either): SGLang repeats the cumulative counts in
    every event's `meta_info`, so the last ones seen are the request's totals."""

    exact_tokens = True

    def __init__(self) -> None:
        self.tokens = 0
        self.latest = b""
        """The last events that carried tokens; the final `spec_verify_ct` is read from them once the stream ends."""

    def feed(self, events: bytes) -> int:
        """Tokens these whole events added."""
        cumulative = sglang.last_completion_tokens(events)
        if cumulative is None:
            return 0
        self.latest = events
        added, self.tokens = max(cumulative - self.tokens, 0), max(cumulative, self.tokens)
        return added

    def acceptance(self) -> Acceptance:
        if not self.latest:
            return Acceptance()
        verify_ct = sglang.last_spec_verify_ct(self.latest)
        if verify_ct is None:
            return Acceptance(output_tokens=self.tokens)
        return Acceptance(self.tokens, verify_ct, sglang.accept_length(self.tokens, verify_ct), "exact")


class OpenAIStream:
    """Reads streamed chat/completions events: content chunks, and usage when the client asked for it."""

    exact_tokens = False

    def __init__(self) -> None:
        self.chunks = 0
        self.usage: sglang.Usage | None = None

    def feed(self, events: bytes) -> int:
        """Content chunks these whole events carried."""
        if sglang.mentions_usage(events):
            last = sglang.last_data_event(events)
            parsed = sglang.parse_openai_event(last) if last is not None else None
            if isinstance(parsed, sglang.OpenAIChunk) and parsed.usage is not None:
                self.usage = parsed.usage
        produced = sglang.count_content_events(events)
        self.chunks += produced
        return produced

    def acceptance(self) -> Acceptance:
        if self.usage is None:
            return Acceptance()
        estimate = sglang.ChatAcceptanceEstimate(self.usage.completion_tokens, self.chunks)
        length = estimate.accept_length
        return Acceptance(self.usage.completion_tokens, None, length, "estimated" if length is not None else None)


Observer = NativeStream | OpenAIStream


class StreamRelay:
    """Relays an SSE body from the upstream connection's data callback: each piece is cut at event boundaries,
    observed (timed at its arrival, tokens counted) and written to the client before the next upstream socket is
    read: no task is woken per chunk, and when a verify round makes every stream's chunk arrive at once, each
    leaves as soon as it is read instead of after all of them (bench/RESULTS.md).

    Observation never blocks the bytes: a body the observer cannot read is still relayed. The request's task
    waits on `settled`, then ends the stream (`relay_stream`).
    """

    def __init__(self, reply: Responder, observer: Observer, exchange: Exchange) -> None:
        self.reply = reply
        self.observer = observer
        self.exchange = exchange
        self.pending = b""
        """Bytes after the last whole event, held until their event is complete."""
        self.settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Resolved when the upstream response has ended (its call's `done` says how)."""
        self._previous: float | None = None
        self._watching = True

    def received(self, now: float, data: bytes) -> None:
        if self.settled.done():
            return
        if self.pending or not data.endswith(b"\n\n"):
            self.pending += data
            cut = event_boundary(self.pending)
            if not cut:
                return
            data, self.pending = self.pending[:cut], self.pending[cut:]
        if self._watching:
            self._observe(now, data)
        self.reply.write(data)

    def ended(self) -> None:
        if not self.settled.done():
            self.settled.set_result(None)

    def _observe(self, now: float, events: bytes) -> None:
        exchange = self.exchange
        try:
            produced = self.observer.feed(events)
        except ProtocolError as exc:
            exchange.unparsed, self._watching = str(exc), False
            return
        if produced <= 0:
            return
        if self._previous is None:
            exchange.first = now
        else:
            exchange.chunk_gaps.append(now - self._previous)
            if self.observer.exact_tokens:
                exchange.token_gaps.append((now - self._previous, produced))
        self._previous = now

    def conclude(self) -> None:
        """Record the request's acceptance, once the stream is complete."""
        if self._watching:
            try:
                self.exchange.acceptance = self.observer.acceptance()
            except ProtocolError as exc:
                self.exchange.unparsed = str(exc)


async def relay_stream(opened: Opened, reply: Responder, observer: Observer, exchange: Exchange) -> None:
    """Pass an SSE body through as it arrives, whole events at a time (`StreamRelay`), reading the upstream only
    as fast as the client takes it; a failure after the first byte ends it with an error event, never half an
    event."""
    relay = StreamRelay(reply, observer, exchange)
    reply.hook(opened.call.pause_reading, opened.call.resume_reading)
    opened.response.attach(relay)
    try:
        await relay.settled
    finally:
        relay.ended()  # pieces that still arrive before the upstream is released are not the client's
        reply.unhook()
    try:
        opened.call.done.result()
    except MID_STREAM as exc:
        exchange.error = mid_stream_error(exc)
        message = str(exc) if exchange.error == "client_stalled" else \
            f"upstream replica failed mid-stream ({type(exc).__name__})"
        reply.end(sglang.stream_error_events(message, "upstream_error", 502))
        return
    relay.conclude()
    reply.end(relay.pending)


def measure_whole(api: str, body: bytes) -> Acceptance:
    """Acceptance of a whole (non-streamed) response body; `ProtocolError` when it is not what SGLang sends."""
    if api == "native":
        results = sglang.parse_generate_response(body)
        total = sum(r.meta.completion_tokens for r in results)
        specs = [r.meta.spec for r in results if r.meta.spec is not None]
        if len(specs) == len(results):
            verify = sum(spec.verify_ct for spec in specs)
            return Acceptance(total, verify, sglang.accept_length(total, verify), "exact")
        return Acceptance(output_tokens=total)
    result = sglang.parse_openai_response(body)
    meta = result.meta
    if meta is not None and meta.spec is not None:
        return Acceptance(meta.completion_tokens, meta.spec.verify_ct, meta.accept_length, "exact")
    return Acceptance(output_tokens=result.usage.completion_tokens if result.usage else None)


def observe_many(histogram: Histogram, weighted: Iterable[tuple[float, int]]) -> None:
    """`histogram.observe(value)` `count` times for each `(value, count)`, with one locked update per bucket: a
    request carries hundreds of gaps (and a verify round's tokens share one). prometheus_client has no weighted or
    batched observe, so this does what `observe` does inside."""
    bounds, counts, total = histogram._upper_bounds, [0] * len(histogram._buckets), 0.0
    for value, count in weighted:
        counts[bisect.bisect_left(bounds, value)] += count
        total += value * count
    histogram._sum.inc(total)
    for bucket, count in zip(histogram._buckets, counts, strict=True):
        if count:
            bucket.inc(count)


def record(metrics: DfserveMetrics, exchange: Exchange) -> None:
    """Turn one exchange's raw facts into the per-arm metrics."""
    arm, route, child = exchange.arm, exchange.route, metrics.child
    metrics.finished(arm, route, exchange.replica, exchange.status, exchange.error).inc()
    if exchange.first is not None:
        child(metrics.ttft, arm, route).observe(exchange.first - exchange.start)
    if exchange.end is not None and exchange.status < 400 and exchange.error is None:
        child(metrics.e2e, arm, route).observe(exchange.end - exchange.start)
    if exchange.chunk_gaps:
        observe_many(child(metrics.itl_per_chunk, arm, route), ((gap, 1) for gap in exchange.chunk_gaps))
    if exchange.token_gaps:
        observe_many(child(metrics.itl_per_token, arm, route),
                     ((gap / tokens, tokens) for gap, tokens in exchange.token_gaps))
    if exchange.unparsed is not None:
        child(metrics.upstream_errors, arm, exchange.replica, "protocol").inc()
    acceptance = exchange.acceptance
    if acceptance.output_tokens:
        child(metrics.output_tokens, arm, route).inc(acceptance.output_tokens)
    if acceptance.verify_ct:
        child(metrics.spec_verify_rounds, arm, route).inc(acceptance.verify_ct)
        child(metrics.spec_output_tokens, arm, route).inc(acceptance.output_tokens or 0)
    if acceptance.accept_length is not None and acceptance.measure is not None:
        child(metrics.accept_length, arm, route, acceptance.measure).observe(acceptance.accept_length)
