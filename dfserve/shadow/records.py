"""One gateway exchange as the load tester's `RequestRecord`: pure, so the mapping is tested without a gateway.

A shadow run pairs by request, not by task: a record's `index` is the gateway's `request_id` (shared by a client's
request and its mirrors), and its `task_id` the hash of the client's body, so that identical requests are one
cluster (and, greedy, must give identical outputs). Times are seconds from the record folder's time zero on the
gateway's `perf_counter` clock: `dispatched_s` when the gateway had read the client's request, `sent_s` when this
arm's copy was written to its replica, so that a record's TTFT and E2E (from `sent_s`) are its arm's alone, a
mirror's without the gateway's delay in sending it. Acceptance is kept only where SGLang reported it exactly.

A recorded stream comes with the pieces its client read, each dated by its arrival (`Exchanged.pieces`: the
relay keeps them for requests the gateway records, decided at dispatch), and they are read here, on the observer's
thread, by the load tester's own reader (`loadtest.client.read_stream`): the chunk times (so TPOT and ITL) and the
output text hashed are what a load tester reading that stream would record. A native stream's events repeat the
whole output so far, so their bytes grow with the square of its length: for it the relay keeps only each event's
changed `completion_tokens` with its arrival, which give the same chunk times and tokens, and the output and how
the stream ended are read from its last events (`answer`). A whole body's output is read from the body; it has no
chunk times.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from dfserve import sglang
from dfserve.errors import ProtocolError
from dfserve.gateway.observers import Exchanged
from dfserve.loadtest.client import ended, read_stream
from dfserve.loadtest.records import ErrorKind, RequestRecord, output_sha256
from dfserve.loadtest.stream import StreamRead
from dfserve.metrics import CLIENT_LEFT_ERRORS, GATEWAY_OVERLOADED

GREEDY_DEFAULT_TEMPERATURE = 1.0
"""What a request that sets no temperature samples at (OpenAI's and SGLang's default): never taken for greedy."""


def request_temperature(route: str, request: object) -> float:
    """The temperature the client asked for in its decoded body (`sampling_params.temperature` natively,
    `temperature` otherwise)."""
    if not isinstance(request, Mapping):
        return GREEDY_DEFAULT_TEMPERATURE
    where: Any = request.get("sampling_params") if route == "native" else request
    value = where.get("temperature") if isinstance(where, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else GREEDY_DEFAULT_TEMPERATURE


@dataclass(frozen=True, slots=True)
class RequestTask:
    """What a request's records share, read once from the body every arm was sent: the task it is (the body's
    hash) and the temperature it asked for. A coding prompt's body is tens of kilobytes: hashing and decoding it
    costs more than the rest of a record."""

    task_id: str
    temperature: float
    several: bool = False
    """A native request for several outputs (`sglang.asks_several_outputs`): the gateway counted none of them."""

    @classmethod
    def of(cls, exchanged: Exchanged) -> RequestTask:
        """From the gateway's decoding of the body (`Exchanged.request`), or the body's own where it has none."""
        request = exchanged.request if exchanged.request is not None else _decoded(exchanged.body)
        route = exchanged.outcome.route
        several = route == "native" and isinstance(request, Mapping) and sglang.asks_several_outputs(request)
        return cls(hashlib.sha256(exchanged.body).hexdigest()[:16], request_temperature(route, request), several)


def _decoded(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None


def output_text(route: str, answer: bytes, streamed: bool) -> tuple[str | None, str | None]:
    """The answer's output text where `answer` holds all of it (a whole body, or a native stream's last event: SGLang
    repeats the whole output in each, unless it streams deltas), and how it finished (the first output's, of
    several); no text for an OpenAI stream (`answer` is only its end: its text is read from its pieces,
    `recorded_stream`)."""
    if not streamed:
        try:
            if route == "native":
                results = sglang.parse_generate_response(answer)
                finish = results[0].meta.finish_reason if results else None
                return "\x00".join(r.text for r in results), finish.kind if finish is not None else None
            result = sglang.parse_openai_response(answer)
            return result.text, result.finish_reason.kind if result.finish_reason is not None else None
        except ProtocolError:
            return None, None
    if route != "native":
        return None, None
    end = native_stream_end(answer)
    return end.text if end.failure is None and not end.incremental else None, end.finish_reason


def greedy_held(base: RequestRecord, cand: RequestRecord) -> bool:
    """A pair whose outputs must agree: both requests greedy and, where both finished, both outputs held."""
    return (base.temperature == 0 and cand.temperature == 0
            and (not (base.ok and cand.ok) or (base.output_sha256 is not None and cand.output_sha256 is not None)))


def error_kind(error: str | None, status: int | None) -> ErrorKind | None:
    """The load tester's error kind for the gateway's failure kind (`dfserve_requests_total{error}`)."""
    if error is None:
        return "http_status" if status is not None and status >= 400 else None
    if error in CLIENT_LEFT_ERRORS or error == GATEWAY_OVERLOADED:
        # the client left or stopped reading, the gateway stopped, or its own limit (max_concurrent_per_arm) refused
        # the request before the arm had it: not the arm's, not a pair
        return "cancelled"
    if error == "stream_error":
        return "stream_error"
    if "timeout" in error:
        return "timeout"
    if error == "disconnect":
        return "disconnect"
    if "connect" in error:
        return "connect"
    if error.startswith("http_"):
        return "http_status"
    if error == "stream_cut":
        return "disconnect"
    return "protocol"


def recorded_stream(route: str, pieces: Sequence[tuple[float, bytes]], t0_perf_s: float) -> StreamRead:
    """A recorded stream read as the load tester reads one: chunk times in seconds from `t0_perf_s`, output text,
    and how it failed by the tester's rules, if it did."""
    return read_stream(cast(sglang.Api, route), pieces, t0_perf_s)  # only proxied routes' streams are recorded


def native_stream_end(answer: bytes) -> StreamRead:
    """A native stream's output and how it ended, read from its last event and the `[DONE]` after it (`answer`
    holds its last pieces): SGLang repeats the whole output in every event, and ends a stream that failed with its
    error event. The events before it are the relay's to have read (`Outcome.error`), not decoded again here."""
    stream = StreamRead()
    try:
        stream.native_end(sglang.native_stream_end(answer))
    except ProtocolError as exc:
        return StreamRead(failure=("protocol", str(exc)))
    return ended(stream)


def recorded_native_stream(totals: Sequence[tuple[float, int]], answer: bytes, t0_perf_s: float) -> StreamRead:
    """A recorded native stream as the load tester would read it: a chunk per change of the running total (with the
    arrival of its piece, in seconds from `t0_perf_s`), and a total that went back a protocol error, as the tester
    has them; the output text, and how the stream ended, from its last events."""
    end = native_stream_end(answer)
    stream = StreamRead(texts=end.texts, incremental=end.incremental, failure=end.failure,
                        finish_reason=end.finish_reason, error_code=end.error_code)
    for now, total in totals:
        if total < stream.completion_tokens:
            stream.failure = ("protocol", f"completion_tokens went backwards: {stream.completion_tokens} -> {total}")
            break
        stream.chunk_times.append(now - t0_perf_s)
        stream.chunk_tokens.append(total - stream.completion_tokens)
        stream.completion_tokens = total
    return stream


CLIENT_BOUND_SHARE = 0.01
"""A share of a stream's E2E beyond which the time its relay waited on a slow client (`Exchanged.paused_s`) makes its
pair untimed (`RequestRecord.client_bound`): a brief wait, a large event filling the socket once, moves its times by
less than any latency rule can tell."""


def shadow_record(exchanged: Exchanged, t0_perf_s: float, task: RequestTask | None = None,
                  simulated: bool = False) -> RequestRecord:
    """The record of one arm's answer to one request; `task`, when its request's other records have read it;
    `simulated`, where the arm's engine said it is dfserve's simulator (its `/server_info`)."""
    o = exchanged.outcome
    task = task or RequestTask.of(exchanged)
    start, origin = exchanged.start_s - t0_perf_s, exchanged.timed_from_s - t0_perf_s
    sent = exchanged.sent_s - t0_perf_s if exchanged.sent_s is not None else start
    kind = error_kind(o.error, o.status)
    message = (exchanged.unparsed or o.error) if kind is not None else None
    if kind == "http_status" and exchanged.answer:
        message = sglang.parse_error_message(exchanged.answer[:65536])[:500]  # the server's words, as the tester's
    tokens, rounds = o.output_tokens, o.verify_rounds
    exact = o.measure == "exact" and rounds is not None
    text, finish, chunk_times, chunk_tokens, stream = None, None, [], None, None
    if exchanged.pieces is not None:
        if o.route == "native" and not task.several:
            stream = recorded_native_stream(cast(Sequence[tuple[float, int]], exchanged.pieces), exchanged.answer,
                                            t0_perf_s)
        else:
            stream = recorded_stream(o.route, cast(Sequence[tuple[float, bytes]], exchanged.pieces), t0_perf_s)
        chunk_times, chunk_tokens = stream.chunk_times, stream.chunk_tokens if o.route == "native" else None
        if task.several:  # the relay kept every event: the counts are read here, output by output
            tokens, rounds = stream.completion_tokens if stream.counted else None, stream.verify_ct
            exact = tokens is not None and rounds is not None
        if kind is None and stream.failure is not None:
            kind, message = stream.failure  # as the tester has it: an error event in band, events it cannot read
        elif stream.failure is not None and stream.failure[0] == kind:
            message = stream.failure[1]  # the server's words for it
        if kind is None and not stream.incremental:  # deltas: only the last is kept
            text = stream.text
    elif kind is None:
        text, finish = output_text(o.route, exchanged.answer, exchanged.streamed)
    if (kind is None and exact and tokens is not None
            and (why := sglang.impossible_rounds(tokens, rounds or 0)) is not None):
        kind, message, text = "protocol", why, None
    exact = exact and kind is None  # a failed answer's counts are no acceptance, as the tester has them
    in_band = kind == "stream_error"  # HTTP 200, and the status the error carried (`Outcome.status`), if any
    return RequestRecord(
        arm=o.arm, route=o.route, index=exchanged.request_id, task_id=task.task_id,
        dispatched_s=start, sent_s=sent,
        first_token_s=origin + o.ttft_s if o.ttft_s is not None else None,
        end_s=origin + o.e2e_s if o.e2e_s is not None else None, chunk_times_s=chunk_times, chunk_tokens=chunk_tokens,
        prompt_tokens=stream.prompt_tokens if stream is not None else None,
        completion_tokens=tokens, spec_verify_ct=rounds if exact else None,
        finish_reason=stream.finish_reason if stream is not None else finish,
        acceptance="exact" if exact else "unknown",
        output_sha256=output_sha256(text) if text is not None else None,
        http_status=200 if in_band else o.status or None, error_kind=kind, error_message=message,
        error_code=o.status if in_band and o.status != 200 else None,
        temperature=task.temperature, simulated=simulated,
        client_bound=o.e2e_s is not None and exchanged.paused_s > CLIENT_BOUND_SHARE * o.e2e_s,
    )


def skipped_record(exchanged: Exchanged, arm: str, t0_perf_s: float, task: RequestTask,
                   simulated: bool = False) -> RequestRecord:
    """The record of a mirror the gateway did not send, its arm down (`Exchanged.skipped`): the arm's failure, as a
    request sent to it then would have failed; left out, its worst hours would leave its record clean."""
    start = exchanged.start_s - t0_perf_s
    return RequestRecord(arm=arm, route=exchanged.outcome.route, index=exchanged.request_id, task_id=task.task_id,
                         dispatched_s=start, sent_s=None, end_s=start, error_kind="connect",
                         error_message=f"not sent: arm {arm} had no healthy replica (the gateway skipped its mirror)",
                         temperature=task.temperature, simulated=simulated)


def rebased(record: RequestRecord, later_s: float) -> RequestRecord:
    """`record` with its times from a time zero `later_s` later (a folder opened while it waited for its pair)."""
    def moved(at_s: float | None) -> float | None:
        return at_s - later_s if at_s is not None else None

    return record.model_copy(update={
        "scheduled_s": moved(record.scheduled_s), "dispatched_s": record.dispatched_s - later_s,
        "sent_s": moved(record.sent_s), "first_token_s": moved(record.first_token_s), "end_s": moved(record.end_s),
        "chunk_times_s": [at_s - later_s for at_s in record.chunk_times_s]})
