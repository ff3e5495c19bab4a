"""The streaming client of one arm: sends one request, keeps the raw arrival time of every read, and returns a
`RequestRecord` with the failure classified. Per-request failures are data here, never exceptions.

Timing comes first: each read is dated by when the kernel received its bytes (`dfserve.stamped_socket`; over
https, by `perf_counter()` as the loop reads them), so a busy loop does not add its own delay to a TTFT; the
client (`dfserve.http1`) does nothing else on that path and waits once for a response's end, not once per read. Requests are bytes
built from headers prepared once per arm (the user's `--header` and `--api-key` among them). Building an
`httpx.Request` and `httpx.Response` per request over the same client (`dfserve.transport`, which the run's probes
use) costs about 26 µs more (bench/request_overhead.py), 3 ms of the loop's time when 128 streams end together: in
bench/tester_timing.py's synchronized runs at 128 streams it put the tester's TTFT error p99 at 5.3 and 3.7 ms
against 1.9 and 2.2 without it. When the response has ended, or failed, or was cancelled, the client hands what it
kept (`Finished`: stamps, status, the stamped pieces) to its sink and does nothing more on the loop. SSE framing
and SGLang's JSON (through `dfserve.sglang` only) are parsed later, off the loop (`derive`, `read_stream`). Each
event takes the arrival time of the read that completed it. A stream that SGLang ends with an error in band (HTTP
200, then an error event, or a final chunk whose finish reason is an abort, with a status or through
`/abort_request`) is a failure of kind `stream_error`, whatever its HTTP status said.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dfserve import sglang
from dfserve.errors import ProtocolError
from dfserve.headers import ARM as PIN_HEADER
from dfserve.http1 import BadResponse, ConnectFailed, Disconnected, Pool, Response
from dfserve.loadtest.records import Acceptance, RequestRecord, output_sha256
from dfserve.loadtest.routes import ROUTE_FOR, Route
from dfserve.loadtest.stream import Failure, StreamRead
from dfserve.relay_core import EventTooLarge
from dfserve.tasks import Task


def _events(pieces: Sequence[tuple[float, bytes]], t0: float, decode_all: bool) -> tuple[list[str], list[float]]:
    """Every whole event's data and the arrival of the read that completed it (seconds since `t0`)."""
    framed = None if decode_all else sglang.plain_events([data for _, data in pieces])
    if framed is None:
        decoder = sglang.SSEDecoder()
        read = [(arrived, decoder.feed(data)) for arrived, data in pieces]
        return [event for _, events in read for event in events], [arrived - t0 for arrived, events in read
                                                                    for _ in events]
    events, owners = framed
    return events, [pieces[owner][0] - t0 for owner in owners]


def read_stream(api: sglang.Api, pieces: Sequence[tuple[float, bytes]], t0: float, *,
                decode_all: bool = False) -> StreamRead:
    """Decode the SSE events of a response's pieces (each with the clock reading of its arrival); `failure` says how
    the stream failed, if it did; the events are read as `api`'s (`Route.read`). OpenAI content chunks are read by
    `sglang.ChunkTemplate` unless `decode_all`; the record is the same either way."""
    try:
        events, times = _events(pieces, t0, decode_all)
    except UNREADABLE as exc:
        return StreamRead(failure=("protocol", unreadable(exc)))
    if not events and (body := b"".join(piece for _, piece in pieces)).strip():
        # a server that answered 200 with something else than events, an error document say: its words, not a cut
        said = sglang.parse_error_message(body[:65536])[:500]
        return StreamRead(failure=("protocol", f"an event stream without an event: {said}"))
    return read_events(api, events, times, decode_all=decode_all)


UNREADABLE = (ProtocolError, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
              RecursionError)
"""What a server's answer can make its reading raise: JSON of unexpected shapes and sizes is the server's fault, a
`protocol` failure of its request, never the end of the run's record writer."""


def unreadable(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, ProtocolError) else f"unreadable answer ({type(exc).__name__}: {exc})"


def read_events(api: sglang.Api, events: list[str], times: list[float], *, decode_all: bool = False) -> StreamRead:
    """`read_stream` of events already decoded (their data, and each one's arrival)."""
    stream = StreamRead()
    try:
        ROUTE_FOR[api].read(stream, events, times, decode_all)
    except UNREADABLE as exc:
        stream.failure = ("protocol", unreadable(exc))
        return stream
    return ended(stream)


def answered_in_time(response: Response, timeout_s: float) -> bool:
    """Whether the answer was complete, by its last byte's arrival, within `timeout_s` of the request."""
    return (response.completed is not None and response.sent is not None
            and response.completed - response.sent <= timeout_s)


def ended(stream: StreamRead) -> StreamRead:
    """`stream` read to its end, failed by the tester's rules where it did not end well: without `[DONE]`, without
    a finish reason, or with more verify rounds than tokens (each round commits one at least: such counts would make
    an acceptance below 1)."""
    if stream.failure is None and not stream.done:
        stream.failure = ("disconnect", "stream ended before [DONE]")
    elif stream.failure is None and stream.finish_reason is None:
        stream.failure = ("protocol", "stream finished without a finish_reason")
    elif (stream.failure is None and stream.verify_ct is not None
          and (stream.counted or stream.completion_tokens)  # else no count came
          and (why := sglang.impossible_rounds(stream.completion_tokens, stream.verify_ct)) is not None):
        stream.failure = ("protocol", why)
    if stream.spec is not None and stream.usage_seen and not sglang.spec_covers(stream.spec, stream.completion_tokens):
        stream.verify_ct = None  # its spec details are of other tokens than its usage counts: no acceptance
    return stream


@dataclass(frozen=True)
class Sent:
    """One request's place in the run and its timestamps (seconds since the run's start)."""

    arm: str
    task_id: str
    index: int
    warmup: bool
    scheduled_s: float | None
    dispatched_s: float
    sent_s: float | None
    end_s: float
    api: sglang.Api
    """The route it was sent on."""
    temperature: float | None = None
    """Its own temperature (a replayed capture's request); None: the run's."""
    output_budget: int | None = None
    """The most tokens its answer may count (`Route.output_budget`); None: the server's default."""


def build_record(sent: Sent, http_status: int | None, stream: StreamRead, error: Failure | None) -> RequestRecord:
    """The record of one request: what it showed (`stream`), and how it failed (`error`), if it did. Acceptance is
    exact where the server counted verify rounds, estimated from tokens per chunk where a stream's usage gave its
    tokens but not its rounds (an OpenAI route of an older SGLang), else unknown."""
    estimate = sglang.estimated_accept_length(stream.completion_tokens, len(stream.chunk_times))
    acceptance: Acceptance = ("exact" if stream.verify_ct is not None
                              else "estimated" if stream.usage_seen and estimate is not None else "unknown")
    finished = error is None
    return RequestRecord(
        arm=sent.arm,
        route=sent.api,
        index=sent.index,
        task_id=sent.task_id,
        warmup=sent.warmup,
        scheduled_s=sent.scheduled_s,
        dispatched_s=sent.dispatched_s,
        sent_s=sent.sent_s,
        first_token_s=stream.chunk_times[0] if stream.chunk_times else None,
        end_s=sent.end_s,
        chunk_times_s=stream.chunk_times,
        chunk_tokens=stream.chunk_tokens if ROUTE_FOR[sent.api].token_counts else None,
        prompt_tokens=stream.prompt_tokens,
        completion_tokens=stream.completion_tokens if stream.counted and (finished or stream.chunk_times) else None,
        spec_verify_ct=stream.verify_ct,
        acceptance=acceptance if finished else "unknown",
        finish_reason=stream.finish_reason,
        output_sha256=output_sha256(stream.text) if finished else None,
        temperature=sent.temperature,
        http_status=http_status or None,
        error_kind=error[0] if error else None,
        error_message=error[1][:500] if error else None,
        error_code=stream.error_code if error else None,
        simulated=stream.simulated,
        server_e2e_latency_s=stream.server_e2e,
        sim_chunk_sent_unix_s=stream.sim_sent,
        sim_chunk_due_unix_s=stream.sim_due,
    )


MAX_EVENT_BYTES = 64 * 1024 * 1024
"""The longest server-sent event (or whole body) the tester keeps of one answer: a native event repeats the whole
output so far, about 11 bytes a token (100k tokens: 1.1 MB), so only a server that never ends its event gets here,
and it would otherwise fill the memory as fast as loopback carries bytes."""


MAX_ANSWER_BYTES = 512 * 1024 * 1024
"""The most the tester keeps of one answer. A native stream repeats its whole output in every event, so its bytes
grow with the square of its length: 8k tokens one an event come to about 370 MB (SGLang's
`--incremental-streaming-output` sends only what is new); past this, a server that never ends its answer would fill
the memory as fast as loopback carries bytes."""

MAX_ANSWER_LINES = 4 * 1024 * 1024
"""The most lines of one answer: two an event (its data and the blank line), so two million events, more than the
tokens of any context. Each line is an object of its own once the answer is read, ten times its bytes for short
ones: a server sending tiny events without end would fill the memory long before `MAX_ANSWER_BYTES`."""

_EVENT_ENDS = (b"\n\n", b"\n\r\n")
_DONE_ENDS = (b"data: [DONE]\n\n", b"data:[DONE]\n\n", b"data: [DONE]\r\n\r\n")

DONE_GRACE_S = 1.0
"""How long the tester waits for a stream's end after a read that ended in `[DONE]`: a server that holds the
connection open past it has answered (`derive` counts the answer whole, ended at `[DONE]`), and would otherwise hold
the request's slot to its timeout. A `[DONE]` split over reads is not seen: that answer waits for its end or timeout."""


class BoundedAnswer(Response):
    """A `Response` that refuses an event still open past `max_event_bytes`, and an answer past `max_answer_bytes`
    or `MAX_ANSWER_LINES` (`EventTooLarge`: the request fails as a protocol error, its connection closed). An
    event's end is a blank line (LF LF or CRLF CRLF) within one read; one split between two reads is counted with
    the next event, so an event is refused only past its bound, or a pair of events past twice it."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES, max_answer_bytes: int = MAX_ANSWER_BYTES) -> None:
        super().__init__()
        self.max_event_bytes = max_event_bytes
        self.max_answer_bytes = max_answer_bytes
        self.open_bytes = 0
        """Bytes since the last event's end."""
        self.answer_bytes = 0
        self.answer_lines = 0
        self.done_read: Callable[[], None] | None = None
        """Called when a read ends in `[DONE]`."""

    def received(self, now: float, data: bytes) -> None:
        self.answer_bytes += len(data)
        self.answer_lines += data.count(b"\n")
        if self.answer_bytes > self.max_answer_bytes or self.answer_lines > MAX_ANSWER_LINES:
            raise EventTooLarge(f"an answer over {self.max_answer_bytes} bytes or {MAX_ANSWER_LINES} lines: the load "
                                "tester keeps no more of one (a native stream repeats its whole output in every event; "
                                "SGLang's --incremental-streaming-output sends only what is new)")
        if data.endswith(_EVENT_ENDS):  # a read of whole events: the common case, at the cost of one test
            self.open_bytes = 0
            if self.done_read is not None and data.endswith(_DONE_ENDS):
                self.done_read()
        else:
            lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\n\r\n")
            self.open_bytes = (len(data) - max(lf + 2, crlf + 3) if lf >= 0 or crlf >= 0
                               else self.open_bytes + len(data))
        if self.open_bytes > self.max_event_bytes:
            raise EventTooLarge(f"an event (or a body) over {self.max_event_bytes} bytes without its end: the load "
                                "tester keeps no more of one answer")
        self.pieces.append((now, data))


Wire = tuple[tuple[Any, ...], int, list[tuple[float, bytes]], Failure | None]


@dataclass(frozen=True, slots=True)
class Finished:
    """What one request left behind, as the loop saw it: `derive` makes its record."""

    sent: Sent
    http_status: int
    pieces: list[tuple[float, bytes]]
    error: Failure | None

    def wire(self) -> Wire:
        """Plain tuples, which `marshal` writes fastest (a few microseconds for a 64-chunk stream)."""
        s = self.sent
        return ((s.arm, s.task_id, s.index, s.warmup, s.scheduled_s, s.dispatched_s, s.sent_s, s.end_s, s.api,
                 s.temperature, s.output_budget),
                self.http_status, self.pieces, self.error)

    @classmethod
    def from_wire(cls, wire: Wire) -> Finished:
        sent, status, pieces, error = wire  # marshal gives back the tuples and lists it was given
        return cls(Sent(*sent), status, pieces, error)


def derive(t0: float, done: Finished, *, decode_all: bool = False) -> RequestRecord:
    """The record of a finished request, read as its route's (`t0`: the run's start on the clock the pieces were
    stamped with; `decode_all`: as `read_stream`'s)."""
    error, api = done.error, done.sent.api
    if error is not None and error[0] == "cancelled":
        stream = read_stream(api, done.pieces, t0, decode_all=decode_all)
        return build_record(done.sent, done.http_status, stream, error)
    if done.http_status not in (0, 200) and (error is None or error[0] != "connect"):
        message = sglang.parse_error_message(b"".join(piece for _, piece in done.pieces))
        return build_record(done.sent, done.http_status, StreamRead(), ("http_status", message))
    stream = read_stream(api, done.pieces, t0, decode_all=decode_all)
    sent = done.sent
    if (error is not None and error[0] in ("disconnect", "timeout")
            and (_whole(done.pieces) or (stream.done and stream.failure is not None))):
        # Cut, or held open, after `[DONE]`: the answer is whole, as a client that leaves there has it and as the
        # gateway counts it, and ended with the read that completed it; what was wrong with it before (no
        # finish_reason) or after (an event) is the server's fault, not the cut's.
        error, sent = None, replace(sent, end_s=done.pieces[-1][0] - t0)
    budget = sent.output_budget
    if stream.failure is None and stream.counted and budget is not None and stream.completion_tokens > budget:
        stream.failure = ("protocol", f"completion_tokens {stream.completion_tokens} is more than the request's "
                          f"{budget} new tokens at most")
    return build_record(sent, done.http_status, stream, error or stream.failure)


def _whole(pieces: Sequence[tuple[float, bytes]]) -> bool:
    """Whether the pieces end the stream whole (`sglang.ends_whole`), as the gateway has it; its `[DONE]` may be split
    over any number of reads."""
    tail = b""
    for _, piece in reversed(pieces):
        tail = piece + tail
        if len(tail) >= _TAIL_BYTES:
            break
    return sglang.ends_whole(tail)


_TAIL_BYTES = 256
"""Enough of a stream's end to hold its `[DONE]` and a keep-alive comment after it."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A task's request as one arm sends it: its route, the body, and the body's bytes."""

    route: Route
    request: dict[str, Any]
    body: bytes


def prepare(task: Task, api: sglang.Api, sampling: sglang.SamplingParams, model: str) -> Prepared:
    """The request `task` goes out as: on its own route with its own body where it was captured, else on `api` with
    `sampling`, naming `model` where the route asks for one."""
    route = ROUTE_FOR[task.route or api]
    captured = task.request(model)
    request = captured if captured is not None else route.body(task, sampling, model)
    return Prepared(route, request, json.dumps(request).encode())


Bodies = dict[tuple[str, str], Prepared]
"""Requests encoded before a run's clock starts, by task id and model; shared by the arms that name one model."""


def prepare_all(tasks: Sequence[Task], api: sglang.Api, sampling: sglang.SamplingParams,
                models: Sequence[str]) -> Bodies:
    """Every request a run may send, encoded once before its clock starts: a captured prompt of a megabyte takes
    about 8 ms to encode, so sixteen due at one instant went out over 126 ms when each was encoded as it was sent."""
    return {(task.id, model): prepare(task, api, sampling, model) for model in dict.fromkeys(models) for task in tasks}


class ArmClient:
    """Sends requests of one arm; `sink` receives what every request left, also requests cancelled mid-flight.
    A task of a task set goes on `api`; a replayed one on its own route. `headers` go on every request (an API key's
    `Authorization` among them). A task's request is taken from `bodies` where it was encoded before the run
    (`prepare_all`), and encoded as it is sent otherwise."""

    def __init__(
        self,
        arm: str,
        base_url: str,
        api: sglang.Api,
        sampling: sglang.SamplingParams,
        sink: Callable[[Finished], None],
        *,
        model: str = "default",
        t0: float,
        request_timeout_s: float,
        pin_arm: bool = False,
        headers: Mapping[str, str] | None = None,
        max_event_bytes: int = MAX_EVENT_BYTES,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        bodies: Bodies | None = None,
    ) -> None:
        self.arm = arm
        self.bodies = bodies or {}
        self.max_event_bytes = max_event_bytes
        self.max_answer_bytes = max_answer_bytes
        self.pool = Pool(base_url, time.perf_counter, kernel_stamps=True)
        fields = {"Content-Type": "application/json", "Accept": "text/event-stream", **(headers or {}),
                  **({PIN_HEADER: arm} if pin_arm else {})}
        self.headers = b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in fields.items())
        self.api = api
        self.sampling = sampling
        self.model = model
        self.t0 = t0
        self.timeout_s = request_timeout_s
        self._sink = sink

    def close(self) -> None:
        self.pool.close()

    def request(self, task: Task) -> Prepared:
        """The route a task goes on and the body sent there."""
        prepared = self.bodies.get((task.id, self.model))
        return prepared if prepared is not None else prepare(task, self.api, self.sampling, self.model)

    async def send(self, task: Task, index: int, *, warmup: bool, scheduled_s: float | None) -> None:
        dispatched = time.perf_counter() - self.t0
        prepared = self.request(task)
        route, request, body = prepared.route, prepared.request, prepared.body
        response = BoundedAnswer(self.max_event_bytes, self.max_answer_bytes)
        error: Failure | None = None

        def finish(error: Failure | None) -> None:
            end = response.completed if response.completed is not None else time.perf_counter()
            sent = Sent(self.arm, task.id, index, warmup, scheduled_s, dispatched,
                        response.sent - self.t0 if response.sent is not None else None, end - self.t0,
                        route.api, task.temperature(), route.output_budget(request))
            self._sink(Finished(sent, response.status, list(response.pieces), error))

        held_after_done = False

        def end_soon() -> None:
            nonlocal held_after_done
            later = asyncio.get_running_loop().time() + DONE_GRACE_S
            if (when := deadline.when()) is None or later < when:
                deadline.reschedule(later)
                held_after_done = True

        try:
            async with asyncio.timeout(self.timeout_s) as deadline:
                response.done_read = end_soon
                await self.pool.fetch(route.path, body, self.headers, response)
        except asyncio.CancelledError:
            finish(("cancelled", "stopped"))
            raise
        except ConnectFailed as exc:
            error = ("connect", str(exc))
        except TimeoutError:
            if not answered_in_time(response, self.timeout_s):  # else its end came in time, read by a loop late
                error = ("timeout", f"the stream was held open {DONE_GRACE_S:g} s after [DONE]" if held_after_done
                         else f"no complete answer within {self.timeout_s:g} s")
        except (Disconnected, OSError) as exc:
            error = ("disconnect", str(exc) or type(exc).__name__)
        except (BadResponse, EventTooLarge) as exc:
            error = ("protocol", str(exc))
        if error is None and response.status == 200 and response.media_type() != b"text/event-stream":
            error = ("protocol", "a 200 answer to a streamed request that is not an event stream (Content-Type: "
                     f"{response.media_type().decode('latin-1') or 'none'}): "
                     + sglang.parse_error_message(b"".join(piece for _, piece in response.pieces)[:65536])[:500])
        finish(error)
