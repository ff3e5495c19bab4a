"""Relay one upstream response to the client, byte for byte, while timing it and reading acceptance as it passes.

Streams go out as they arrive (no buffering of whole streams), cut only at event boundaries so that a stream that
fails after its first byte can still end with a well-formed error event. That per-read work runs in C
(`dfserve.relay_core.EventRelay`, fed straight by the upstream connection's de-chunker): it writes each piece to the
client, then counts the tokens it carried, found by the JSON keys `dfserve.sglang` names (`TokenMarks`), and
counts the gap since the last piece with tokens into histogram buckets; the buckets go into the metrics once per
request (`record`). Whole responses are read, measured and sent; for non-streamed chat the gateway asked SGLang
for `meta_info` itself and strips it again here.

Acceptance per request, as exactly as the protocol allows (ARCHITECTURE.md, principle 6):
- native `/generate`: `completion_tokens / spec_verify_ct` from the final `meta_info` (exact);
- non-streamed chat: the same, from the `meta_info` the gateway asked for (exact);
- streamed chat and completions: usage tokens over content chunks (estimated; needs `include_usage`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from dfserve import sglang
from dfserve.errors import ProtocolError
from dfserve.gateway.server import Responder
from dfserve.gateway.upstream import MID_STREAM, Opened, mid_stream_error
from dfserve.headers import ARM, REPLICA
from dfserve.metrics import ITL_BUCKETS_S, DfserveMetrics
from dfserve.relay_core import EventRelay

Measure = Literal["exact", "estimated"]

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
    b"transfer-encoding", b"upgrade",
})
ARM_HEADER = ARM.encode()
REPLICA_HEADER = REPLICA.encode()


_NOT_RELAYED = HOP_BY_HOP | {b"content-length"}
"""Hop-by-hop headers, and Content-Length: the gateway frames each body it sends itself."""


def response_headers(headers: list[tuple[bytes, bytes]], arm: str, replica: str) -> list[tuple[bytes, bytes]]:
    """Upstream headers (names lower-cased, as `dfserve.http1` reads them) minus `_NOT_RELAYED`, plus arm and
    replica."""
    kept = [(name, value) for name, value in headers if name not in _NOT_RELAYED]
    kept.append((ARM_HEADER, arm.encode()))
    kept.append((REPLICA_HEADER, replica.encode()))
    return kept


@dataclass
class Acceptance:
    """One request's output tokens and acceptance length; None where the protocol did not show it."""

    output_tokens: int | None = None
    verify_ct: int | None = None
    accept_length: float | None = None
    measure: Measure | None = None


@dataclass(frozen=True)
class Binned:
    """Observations already counted into the buckets of `ITL_BUCKETS_S` (then +Inf), and their sum."""

    counts: tuple[int, ...]
    total: float


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
    chunk_gaps: Binned | None = None
    """Between the pieces of a stream that carried output."""
    token_gaps: Binned | None = None
    """The same gaps spread over the tokens that ended them, once per token, where a stream counts tokens exactly
    (native)."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    error: str | None = None
    unparsed: str | None = None


class StreamKind(Protocol):
    """How a stream's events show its output: what the relay counts in each piece, and how acceptance is read once
    the stream is complete."""

    @property
    def marks(self) -> sglang.TokenMarks:
        """What the relay counts in each piece: tokens (cumulative marks) or chunks of text."""

    def acceptance(self, count: int | None, tail: bytes) -> Acceptance:
        """From the relay's count and the stream's last events, once it is complete."""


class NativeStream:
    """Native `/generate`: cumulative `completion_tokens` in every event's `meta_info`, and the final
    `spec_verify_ct`, both read from the bytes (no JSON decoding per request either)."""

    marks = sglang.NATIVE_TOKENS

    def acceptance(self, count: int | None, tail: bytes) -> Acceptance:
        if count is None:
            return Acceptance()
        verify_ct = sglang.last_spec_verify_ct(tail)
        if verify_ct is None:
            return Acceptance(output_tokens=count)
        return Acceptance(count, verify_ct, sglang.accept_length(count, verify_ct), "exact")


class OpenAIStream:
    """Streamed chat/completions: content chunks counted, and usage read from the final chunk when the client
    asked for it (`include_usage`)."""

    marks = sglang.CONTENT_CHUNKS

    def acceptance(self, count: int | None, tail: bytes) -> Acceptance:
        last = sglang.last_data_event(tail) if sglang.mentions_usage(tail) else None
        parsed = sglang.parse_openai_event(last) if last is not None else None
        if not isinstance(parsed, sglang.OpenAIChunk) or parsed.usage is None:
            return Acceptance()
        tokens = parsed.usage.completion_tokens
        length = sglang.ChatAcceptanceEstimate(tokens, count or 0).accept_length
        return Acceptance(tokens, None, length, "estimated" if length is not None else None)


def meter(relay: EventRelay, exchange: Exchange) -> None:
    """The stream's first output and its gaps, as the relay counted them (what was relayed, also of a stream cut
    short)."""
    exchange.first = relay.first
    exchange.chunk_gaps = Binned(*relay.chunk_gaps)
    token_gaps = relay.token_gaps
    exchange.token_gaps = Binned(*token_gaps) if token_gaps is not None else None


async def relay_stream(opened: Opened, reply: Responder, kind: StreamKind, exchange: Exchange,
                       max_event_bytes: int) -> None:
    """Pass an SSE body through as it arrives, whole events at a time (`EventRelay`, fed by the upstream
    connection's de-chunker with no Python in between), reading the upstream only as fast as the client takes it;
    a failure after the first byte, or an event longer than `max_event_bytes` (held until it is whole), ends it
    with an error event, never half an event. The relay holds nothing of this coroutine's, so a finished request
    leaves no cycle for the garbage collector."""
    write, chunked = reply.body_writer()
    relay = EventRelay(write, chunked, kind.marks.keys, kind.marks.cumulative, ITL_BUCKETS_S, max_event_bytes)
    reply.hook(opened.call.pause_reading, opened.call.resume_reading, relay.detach)
    opened.call.attach(relay)
    failure: Exception | None = None
    try:
        await opened.call.done
    except MID_STREAM as exc:
        failure = exc
    finally:
        relay.ended()  # pieces that still arrive before the upstream is released are not the client's
        reply.unhook()
        meter(relay, exchange)
    if failure is not None:
        exchange.error = mid_stream_error(failure)
        if exchange.error == "client_stalled":
            message = str(failure)
        elif exchange.error == "event_too_large":
            message = f"upstream replica sent {failure}"
        else:
            message = f"upstream replica failed mid-stream ({type(failure).__name__})"
        reply.end(sglang.stream_error_events(message, "upstream_error", 502))
        return
    try:
        exchange.acceptance = kind.acceptance(relay.tokens, relay.tail)
    except ProtocolError as exc:
        exchange.unparsed = str(exc)
    reply.end(relay.pending, relay.last_chunk_written)


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


def record(metrics: DfserveMetrics, exchange: Exchange) -> None:
    """Turn one exchange's raw facts into the per-arm metrics."""
    arm, route = exchange.arm, exchange.route
    metrics.finished(arm, route, exchange.replica, exchange.status, exchange.error).inc()
    if exchange.first is not None:
        metrics.ttft.labels(arm, route).observe(exchange.first - exchange.start)
    if exchange.end is not None and exchange.status < 400 and exchange.error is None:
        metrics.e2e.labels(arm, route).observe(exchange.end - exchange.start)
    if exchange.chunk_gaps is not None:
        metrics.itl_per_chunk.labels(arm, route).add_binned(exchange.chunk_gaps.counts, exchange.chunk_gaps.total)
    if exchange.token_gaps is not None:
        metrics.itl_per_token.labels(arm, route).add_binned(exchange.token_gaps.counts, exchange.token_gaps.total)
    if exchange.unparsed is not None:
        metrics.child(metrics.upstream_errors, arm, exchange.replica, "protocol").inc()
    acceptance = exchange.acceptance
    if acceptance.output_tokens:
        metrics.output_tokens.labels(arm, route).inc(acceptance.output_tokens)
    if acceptance.verify_ct:
        metrics.spec_verify_rounds.labels(arm, route).inc(acceptance.verify_ct)
        metrics.spec_output_tokens.labels(arm, route).inc(acceptance.output_tokens or 0)
    if acceptance.accept_length is not None and acceptance.measure is not None:
        metrics.accept_length.labels(arm, route, acceptance.measure).observe(acceptance.accept_length)
