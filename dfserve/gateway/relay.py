"""Relay one upstream response to the client, byte for byte, while timing it and reading acceptance as it passes.

Streams go out as they arrive (no buffering of whole streams), cut only at event boundaries so that a stream that
fails after its first byte can still end with a well-formed error event. That per-read work runs in C
(`dfserve.relay_core.EventRelay`, fed straight by the upstream connection's de-chunker): it writes each piece to the
client, then counts the tokens it carried, found by the JSON keys `dfserve.sglang` names (`TokenMarks`), and
counts the gap since the last piece with tokens into histogram buckets; the buckets go into the metrics once per
request (`outcome`, by the metrics observer). Whole responses are read, measured and sent.

Acceptance per request, as exactly as the protocol allows:
- native `/generate`: `completion_tokens / spec_verify_ct` from the final `meta_info` (exact);
- chat and completions: the same, from `sglext.spec_tokens_details`, which the gateway asks SGLang for where the
  client did not, and cuts out again before the client gets the answer: from a whole body (`strip_spec_details`),
  and from a stream event by event (the relay's `strip`, `sglang.SPEC_DETAILS_KEY`: SGLang's chunk sent for them
  alone goes whole, and the client reads the bytes it would have read without the gateway's addition); the
  relay keeps the piece it cut them from (`EventRelay.stripped`), which is read with the last events (exact);
  or from `meta_info` where a client asked for it on a whole request;
- streamed chat and completions from a server that sends no spec details (before SGLang 0.5.23): usage tokens over
  content chunks (estimated; needs `include_usage`).

A stream that SGLang ends with an in-band error (HTTP 200, then an error event, or a final chunk whose finish reason
is an abort, with a status or through `/abort_request`) is a failure: its last events are read once it is complete
(`EventRelay.tail`), with the pieces before them in which an OpenAI stream's error or abort occurs (SGLang sends
closing chunks after them; `EventRelay.alarmed`, a byte search per piece). So is a whole 200 answer whose finish
reason is an abort.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from dfserve import sglang
from dfserve.errors import ProtocolError
from dfserve.gateway.observers import latency_origin
from dfserve.gateway.server import Responder
from dfserve.gateway.upstream import MID_STREAM, Opened, mid_stream_error
from dfserve.headers import ARM, REPLICA
from dfserve.metrics import ITL_BUCKETS_S, PROTOCOL_ERROR, STREAM_ERROR, Binned, Measure, Outcome
from dfserve.relay_core import EventRelay

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
    b"transfer-encoding", b"upgrade",
})
ARM_HEADER = ARM.encode()
REPLICA_HEADER = REPLICA.encode()


_NOT_RELAYED = HOP_BY_HOP | {b"content-length"}
"""Hop-by-hop headers, and Content-Length: the gateway frames each body it sends itself."""


def response_headers(headers: list[tuple[bytes, bytes]], arm: str, replica: str) -> list[tuple[bytes, bytes]]:
    """Upstream headers (names lower-cased, as `dfserve.http1` reads them) minus `_NOT_RELAYED` and those its
    Connection header names (hop-by-hop too, RFC 9110 7.6.1), plus arm and replica."""
    named = [value for name, value in headers if name == b"connection"]
    dropped = _NOT_RELAYED.union(token.strip().lower() for value in named for token in value.split(b",")) \
        if named else _NOT_RELAYED
    kept = [(name, value) for name, value in headers if name not in dropped]
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


@dataclass
class Exchange:
    """Raw facts about one relayed request (perf_counter seconds), handed to the observers once it is over
    (`outcome`, `gateway.observers`)."""

    arm: str
    route: str
    request_id: int = 0
    """Shared by a client's request and its shadow mirrors."""
    mirror: bool = False
    body: bytes = b""
    """The request body as the client sent it."""
    request: Mapping[str, Any] | None = None
    """`Exchanged.request`."""
    replica: str = ""
    start: float = field(default_factory=time.perf_counter)
    sent: float | None = None
    """`Exchanged.sent_s`."""
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
    error_code: int | None = None
    """The status an in-band error event carried (`error` is then `stream_error`; `status` stays 200)."""
    unparsed: str | None = None
    """Why a 200 answer is not SGLang's, if it is not (`error` is then `protocol`)."""
    answer: bytes = b""
    """A whole body as the replica sent it, or a stream's last events (`Exchanged.answer`)."""
    streamed: bool = False
    mirrors: tuple[str, ...] = ()
    """`Exchanged.mirrors`."""
    skipped: tuple[str, ...] = ()
    """`Exchanged.skipped`."""
    paused_s: float = 0.0
    """`Exchanged.paused_s`."""
    keep_pieces: bool = False
    """Recorded: a stream's relay keeps every piece it relays, with its arrival time (decided at dispatch)."""
    pieces: list[tuple[float, bytes]] | list[tuple[float, int]] | None = None
    """What the relay kept (`Exchanged.pieces`)."""


class StreamKind(Protocol):
    """How a stream's events show its output: what the relay counts in each piece, and what the stream's last
    events say once it is complete."""

    @property
    def marks(self) -> sglang.TokenMarks:
        """What the relay counts in each piece: tokens (cumulative marks) or chunks of text."""

    @property
    def alarm(self) -> tuple[bytes, ...] | None:
        """Keys of events the stream's end is read with wherever they came (`EventRelay.alarmed`)."""

    def read_end(self, count: int | None, tail: bytes) -> tuple[Acceptance, sglang.StreamError | None]:
        """Acceptance and the in-band error, if any, from the relay's count and the stream's last events."""


class NativeStream:
    """Native `/generate`: cumulative `completion_tokens` in every event's `meta_info`, and the final
    `spec_verify_ct`, both read from the bytes (no JSON decoding unless the stream ended with an error)."""

    marks = sglang.NATIVE_TOKENS
    alarm = None
    """SGLang ends a stream that failed with its error, or its abort, then `[DONE]`. A server that goes on after one
    and ends well is read by its end: watching every event for an error costs six times the relay's work on a native
    stream, each event repeating the whole output so far."""

    def read_end(self, count: int | None, tail: bytes) -> tuple[Acceptance, sglang.StreamError | None]:
        """`ProtocolError` for a stream that neither counted its output nor ended with an error: every event SGLang
        sends carries its running total."""
        error = sglang.native_stream_error(tail)
        if count is None and error is None:
            raise ProtocolError("a native stream whose events carry no meta_info.completion_tokens")
        if count is None:
            return Acceptance(), error
        verify_ct = sglang.last_spec_verify_ct(tail)
        if not verify_ct:
            return Acceptance(output_tokens=count), error
        return Acceptance(count, verify_ct, sglang.accept_length(count, verify_ct), "exact"), error


class NativeOutputs:
    """Native `/generate` asking several outputs (`sglang.asks_several_outputs`): each event with text is a chunk
    (TTFT, gaps), and the counts are left unknown rather than one output's; a shadow record reads every event."""

    marks = sglang.NATIVE_OUTPUTS
    alarm = sglang.NATIVE_ALARM  # an output that failed: the other outputs' events may follow it

    def read_end(self, count: int | None, tail: bytes) -> tuple[Acceptance, sglang.StreamError | None]:
        return Acceptance(), sglang.native_outputs_error(tail)


@dataclass(frozen=True)
class OpenAIStream:
    """Streamed chat/completions: content chunks counted; spec details, usage and errors read from the last events.
    A stream of one choice is also read for its finish reason (`sglang.OPENAI_FINISH_ALARM`)."""

    one_choice: bool = True
    marks = sglang.CONTENT_CHUNKS

    @property
    def alarm(self) -> tuple[bytes, ...]:
        return sglang.OPENAI_FINISH_ALARM if self.one_choice else sglang.OPENAI_ALARM

    def read_end(self, count: int | None, tail: bytes) -> tuple[Acceptance, sglang.StreamError | None]:
        """`ProtocolError` for a stream of one choice that ended well without a finish reason (the load tester's
        rule)."""
        end = sglang.openai_stream_end(tail)
        if self.one_choice and end.error is None and not end.finished:
            raise ProtocolError("stream finished without a finish_reason")
        tokens = sglang.spec_completion_tokens(end.spec, end.usage)
        if end.spec is not None and tokens is not None:
            verify_ct = end.spec.verify_ct
            return Acceptance(tokens, verify_ct, sglang.accept_length(tokens, verify_ct), "exact"), end.error
        if end.usage is None:
            return Acceptance(), end.error
        tokens = end.usage.completion_tokens
        length = sglang.estimated_accept_length(tokens, count or 0)
        return Acceptance(tokens, None, length, "estimated" if length is not None else None), end.error


def stream_kind(exchange: Exchange) -> StreamKind:
    """How an exchange's stream is read: by its route, and a native request for several outputs event by event."""
    if exchange.route != "native":
        choices = exchange.request.get("n") if exchange.request is not None else None
        return OpenAIStream(one_choice=choices is None or choices == 1)
    several = exchange.request is not None and sglang.asks_several_outputs(exchange.request)
    return NativeOutputs() if several else NativeStream()


def meter(relay: EventRelay, exchange: Exchange) -> None:
    """The stream's first output and its gaps, as the relay counted them, and the pieces it kept if asked (what was
    relayed, also of a stream cut short)."""
    exchange.first = relay.first
    exchange.pieces = relay.pieces
    exchange.chunk_gaps = Binned(*relay.chunk_gaps)
    token_gaps = relay.token_gaps
    exchange.token_gaps = Binned(*token_gaps) if token_gaps is not None else None


async def relay_stream(opened: Opened, reply: Responder, kind: StreamKind, exchange: Exchange,
                       max_event_bytes: int, strip: bytes | None = None) -> None:
    """Pass an SSE body through as it arrives, whole events at a time (`EventRelay`, fed by the upstream
    connection's de-chunker with no Python in between), reading the upstream only as fast as the client takes it,
    less the members whose key is `strip`; a failure after the first byte, an event longer than `max_event_bytes`
    (held until it is whole), or a body that ends without `[DONE]` or in half an event (`stream_cut`, as a client
    reading it would have it) ends it with an error event, never half an event, unless the relay already ended the
    client's body with the upstream's last bytes. The relay holds
    nothing of this coroutine's, so a finished request leaves no cycle for the garbage collector."""
    write, chunked = reply.body_writer()
    relay = EventRelay(write, chunked, kind.marks.keys, kind.marks.cumulative, ITL_BUCKETS_S, max_event_bytes,
                       strip, exchange.keep_pieces, kind.alarm)
    paused_at: list[float] = []

    def pause() -> None:
        paused_at.append(time.perf_counter())
        opened.call.pause_reading()

    def resume() -> None:
        if paused_at:
            exchange.paused_s += time.perf_counter() - paused_at.pop()
        opened.call.resume_reading()

    reply.hook(pause, resume, relay.detach)
    opened.call.attach(relay)
    failure: Exception | None = None
    try:
        await opened.call.done
    except MID_STREAM as exc:
        failure = exc
    except asyncio.CancelledError:
        if not (reply.disconnected and _whole(relay)):
            raise
        # The client had the whole stream and left before the upstream's last chunk came (OpenAI's SDK closes at
        # `[DONE]`): an answered request. The upstream connection, its body unfinished, is closed, not reused.
    finally:
        relay.ended()  # pieces that still arrive before the upstream is released are not the client's
        reply.unhook()  # resumes what is paused
        meter(relay, exchange)
    # A failure after a whole stream (the replica gone, or its body short of its Content-Length, after `[DONE]`) is
    # none: the client has its answer, as one that leaves at `[DONE]` has.
    if failure is not None and not _whole(relay):
        exchange.error = mid_stream_error(failure)
        if exchange.error == "client_stalled":
            message = str(failure)
        elif exchange.error == "event_too_large":
            message = f"upstream replica sent {failure}"
        else:
            message = f"upstream replica failed mid-stream ({type(failure).__name__})"
        reply.end(sglang.stream_error_events(message, "upstream_error", 502))
        return
    tail = relay.tail
    if not _whole(relay):
        exchange.error = "stream_cut"  # its end is the replica's: half an event, or no `[DONE]` after the last
        reply.end(b"" if relay.last_chunk_written else sglang.stream_error_events(
            "upstream replica ended the stream before [DONE]", "upstream_error", 502), relay.last_chunk_written)
        return
    exchange.answer, exchange.streamed = relay.alarmed + relay.stripped + tail, True
    try:
        exchange.acceptance, in_band = kind.read_end(relay.tokens, exchange.answer)
    except ProtocolError as exc:
        exchange.error, exchange.unparsed = PROTOCOL_ERROR, str(exc)
    else:
        if in_band is not None:
            exchange.error, exchange.error_code = STREAM_ERROR, in_band.code
    reply.end(relay.pending, relay.last_chunk_written)


def _whole(relay: EventRelay) -> bool:
    """Whether the events relayed so far are a whole stream: `[DONE]` last, and no part of an event after it."""
    return not relay.pending.strip() and sglang.ends_with_done(relay.tail)


def measure_whole(api: str, body: bytes) -> tuple[Acceptance, sglang.StreamError | None]:
    """Acceptance of a whole (non-streamed) 200 response body, and the abort it reports in band, if any (SGLang
    answers a request aborted through `/abort_request` with 200 and an `abort` finish reason); `ProtocolError` when
    it is not what SGLang sends."""
    if api == "native":
        results = sglang.parse_generate_response(body)
        errors = [r.meta.finish_reason.error for r in results if r.meta.finish_reason is not None]
        error = next((e for e in errors if e is not None), None)
        total = sum(r.meta.completion_tokens for r in results)
        specs = [r.meta.spec for r in results if r.meta.spec is not None]
        if specs:  # SGLang leaves out the spec fields of an output with no verify round (done at its first token)
            verify = sum(spec.verify_ct for spec in specs)
            return Acceptance(total, verify, sglang.accept_length(total, verify), "exact"), error
        return Acceptance(output_tokens=total), error
    result = sglang.parse_openai_response(body)
    error = result.error
    exact = result.acceptance
    if exact is not None:
        tokens, spec = exact
        return Acceptance(tokens, spec.verify_ct, sglang.accept_length(tokens, spec.verify_ct), "exact"), error
    return Acceptance(output_tokens=result.usage.completion_tokens if result.usage else None), error


def outcome(exchange: Exchange) -> Outcome:
    """One exchange's raw facts as dfserve's per-request families read them (`dfserve.metrics.observe`)."""
    acceptance = exchange.acceptance
    origin = latency_origin(exchange.mirror, exchange.start, exchange.sent)
    return Outcome(
        arm=exchange.arm, route=exchange.route, replica=exchange.replica, status=exchange.error_code or exchange.status,
        error=exchange.error,
        ttft_s=exchange.first - origin if exchange.first is not None else None,
        e2e_s=exchange.end - origin if exchange.end is not None else None,
        chunk_gaps=exchange.chunk_gaps, token_gaps=exchange.token_gaps,
        output_tokens=acceptance.output_tokens, verify_rounds=acceptance.verify_ct,
        accept_length=acceptance.accept_length, measure=acceptance.measure,
    )
