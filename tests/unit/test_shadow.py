"""Shadow records without a gateway: an exchange as a record, the recorder's pairing, rotation and bound, and the
verdict's refusals and losslessness on live traffic."""

from __future__ import annotations

import gc
import hashlib
import html
import json
import re
import time
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from dfserve import sglang
from dfserve.errors import FieldError, Untrusted, UserError
from dfserve.gateway.config import load_config
from dfserve.gateway.observers import Exchanged, Observers
from dfserve.loadtest.cli import compare, promote
from dfserve.loadtest.client import Finished, Sent, derive, read_events
from dfserve.loadtest.judge import TIMED
from dfserve.loadtest.records import e2e_s, read_records, tpot_s
from dfserve.loadtest.report import summarize_arm
from dfserve.metrics import ObserverMetrics, Outcome
from dfserve.relay_core import EventRelay
from dfserve.sglang.server import NativeStreamEncoder, meta_info_body
from dfserve.sglang.simulated import SIM_MARKER_KEY
from dfserve.shadow import recorder as recorder_module
from dfserve.shadow.policy import ShadowPolicy
from dfserve.shadow.recorder import ShadowRecorder
from dfserve.shadow.records import (
    RequestTask,
    error_kind,
    native_stream_end,
    output_text,
    request_temperature,
    shadow_record,
)
from dfserve.shadow.verdict import NO_HASH, compare_shadow
from dfserve.verdict.results import NOT_JUDGED
from tests.synthetic import PASSING


def _native(text: str, tokens: int, verify: int) -> bytes:
    return json.dumps({"text": text, "meta_info": {"completion_tokens": tokens, "spec_verify_ct": verify,
                                                   "prompt_tokens": 3, "finish_reason": {"type": "length"}}}).encode()


def exchanged(rid: int, arm: str, mirror: bool, *, text: str = "out", verify: int = 4, temperature: float = 0,
              error: str | None = None, streamed: bool = False, answer: bytes | None = None,
              mirrors: tuple[str, ...] = ("inhouse",)) -> Exchanged:
    """A client's exchange (mirrored to `mirrors`) or a mirror's; another arm's answer takes a few microseconds
    more (two servers' never take the same times)."""
    body = json.dumps({"text": f"prompt {rid % 10}", "sampling_params": {"temperature": temperature}}).encode()
    later_s = 0.0 if arm == "zlab" else 3e-6 * (1 + len(arm))
    outcome = Outcome(arm=arm, route="native", replica="r", status=200, error=error, ttft_s=0.01 + later_s,
                      e2e_s=0.1 + later_s,
                      output_tokens=16, verify_rounds=verify, accept_length=16 / verify, measure="exact")
    return Exchanged(rid, mirror, "POST", "/generate", b"", body, 100.0 + rid, outcome,
                     answer=_native(text, 16, verify) if answer is None else answer, streamed=streamed,
                     mirrors=() if mirror else mirrors)


def test_each_arms_record_is_timed_from_when_its_own_copy_was_written_to_its_replica() -> None:
    """The gateway reads a client's request, writes it to the primary, and writes the mirror as its loop gets to it:
    a record's TTFT and E2E (from `sent_s`) are its replica's, not the gateway's delays."""
    primary = shadow_record(replace(exchanged(5, "zlab", False), sent_s=105.002), 100.0)  # outcome: from 105.0
    assert (primary.dispatched_s, primary.sent_s, primary.first_token_s, primary.end_s) == pytest.approx(
        (5.0, 5.002, 5.01, 5.1))
    mirror = shadow_record(replace(exchanged(5, "inhouse", True), sent_s=105.03), 100.0)  # outcome: from its send
    assert (mirror.dispatched_s, mirror.sent_s) == pytest.approx((5.0, 5.03))
    assert mirror.first_token_s - mirror.sent_s == pytest.approx(0.01 + 3e-6 * 8)
    assert (mirror.route, primary.route) == ("native", "native")


def test_an_exchange_becomes_the_load_testers_record() -> None:
    record = shadow_record(exchanged(7, "zlab", False, text="hello"), t0_perf_s=100.0)
    assert (record.arm, record.index, record.sent_s, record.first_token_s, record.end_s) == ("zlab", 7, 7.0,
                                                                                           7.01, 7.1)
    assert (record.acceptance, record.spec_verify_ct, record.temperature) == ("exact", 4, 0.0)
    assert record.output_sha256 == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert record.task_id == shadow_record(exchanged(17, "x", True), 0).task_id  # the same body: one cluster
    failed = shadow_record(exchanged(1, "zlab", False, error="stream_cut"), 100.0)
    assert failed.error_kind == "disconnect" and failed.output_sha256 is None
    impossible = shadow_record(exchanged(2, "zlab", False, verify=17), 100.0)  # 17 rounds for 16 tokens
    assert impossible.error_kind == "protocol" and not impossible.ok and impossible.output_sha256 is None


def test_an_output_with_a_lone_escaped_surrogate_is_hashed_not_lost() -> None:
    """A server may send `\\ud83d` alone: the record hashes it as its code point, and differs from one without it."""
    lone = shadow_record(exchanged(7, "zlab", False, answer=_native("a\ud83d", 16, 4)), t0_perf_s=100.0)
    assert lone.ok and lone.output_sha256 == hashlib.sha256("a\ud83d".encode("utf-8", "surrogatepass")).hexdigest()
    assert lone.output_sha256 != shadow_record(exchanged(7, "zlab", False, text="a"), 100.0).output_sha256


def test_outputs_the_gateway_holds() -> None:
    event = b'data: ' + _native("whole so far", 3, 1) + b'\n\ndata: [DONE]\n\n'
    assert output_text("native", event, streamed=True) == ("whole so far", "length")
    assert output_text("chat", b'data: {"choices": []}\n\ndata: [DONE]\n\n', streamed=True) == (None, None)
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
    assert output_text("chat", json.dumps(chat).encode(), streamed=False) == ("hi", "stop")
    assert output_text("native", b"not json", streamed=False) == (None, None)
    meta = {"id": "r", "prompt_tokens": 1, "completion_tokens": 2}
    two = [{"text": "a", "meta_info": {**meta, "finish_reason": {"type": "length", "length": 2}}},
           {"text": "b", "meta_info": {**meta, "finish_reason": {"type": "stop", "matched": 2}}}]
    assert output_text("native", json.dumps(two).encode(), streamed=False) == ("a\x00b", "length")
    assert shadow_record(exchanged(1, "zlab", False), 100.0).finish_reason == "length"  # a whole body's, as streams


@pytest.mark.parametrize(("route", "body", "temperature"), [
    ("native", {"sampling_params": {"temperature": 0}}, 0.0), ("native", {"temperature": 0}, 1.0),
    ("chat", {"temperature": 0.7}, 0.7), ("chat", {}, 1.0), ("chat", {"temperature": True}, 1.0)])
def test_a_request_without_a_temperature_is_not_greedy(route: str, body: dict[str, object], temperature: float) -> None:
    assert request_temperature(route, body) == temperature


def test_a_records_temperature_is_read_from_the_gateways_decoding_of_the_body_or_else_from_the_body() -> None:
    sent = exchanged(1, "zlab", False, temperature=0.25)
    assert RequestTask.of(sent).temperature == 0.25
    assert RequestTask.of(replace(sent, request={"sampling_params": {"temperature": 0}})).temperature == 0.0
    assert RequestTask.of(replace(sent, body=b"\xff not json")).temperature == 1.0


def test_error_kinds() -> None:
    """A client that stops reading is its own doing, as one that leaves: the primary's record is no failure of its
    arm (a mirror never stalls, so counting it would always favour the candidate). A request the gateway's own
    limit refused never reached its arm: no failure of it either (a slower candidate's dropped mirrors were its
    429 errors, and failed it on error_rate), where a replica's own 429 is."""
    assert [error_kind(e, s) for e, s in [(None, 200), (None, 503), ("client_disconnect", 200), ("connect", 502),
                                          ("timeout", 504), ("http_500", 500), ("stream_error", 200),
                                          ("client_stalled", 200), ("overloaded", 429), ("http_429", 429)]] == [
        None, "http_status", "cancelled", "connect", "timeout", "http_status", "stream_error", "cancelled",
        "cancelled", "http_status"]


def test_an_error_answers_record_keeps_the_servers_words_as_the_load_testers_does() -> None:
    refused = exchanged(1, "inhouse", True, answer=b'{"object":"error","message":"max_completion_tokens is too large",'
                                                   b'"type":"BadRequestError","param":null,"code":400}')
    record = shadow_record(replace(refused, outcome=replace(refused.outcome, status=400)), 100.0)
    assert (record.error_kind, record.http_status, record.error_message) == (
        "http_status", 400, "max_completion_tokens is too large")


def _folders(root: Path) -> list[Path]:
    return sorted(root.iterdir())


def _chat_pieces(texts: list[str], start: float, gap: float) -> list[tuple[float, bytes]]:
    """A streamed chat as its client read it: a role chunk, one piece per text, the finish and usage chunks in one
    piece, then [DONE]."""
    def event(obj: dict[str, object]) -> bytes:
        return b"data: " + sglang.json_bytes({"id": "c", "object": "chat.completion.chunk", **obj}) + b"\n\n"

    role = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    contents = [event({"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]}) for t in texts]
    end = (event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
           + event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2 * len(texts),
                                             "total_tokens": 3 + 2 * len(texts)}}))
    pieces = [role, *contents, end, b"data: [DONE]\n\n"]
    return [(start + gap * (n + 1), piece) for n, piece in enumerate(pieces)]


def streamed_chat(rid: int, arm: str, mirror: bool, gap: float, *, error: str | None = None,
                  texts: tuple[str, ...] = ("def", " f", "(x)"), cut: int = 0) -> Exchanged:
    start = 100.0 + rid
    pieces = _chat_pieces(list(texts), start, gap)[:len(texts) + 3 - cut]
    outcome = Outcome(arm=arm, route="chat", replica="r", status=200, error=error, ttft_s=2 * gap,
                      e2e_s=gap * len(pieces), output_tokens=2 * len(texts), verify_rounds=len(texts),
                      accept_length=2.0, measure="exact")
    body = json.dumps({"messages": [{"role": "user", "content": f"p{rid % 6}"}], "stream": True,
                       "temperature": 0}).encode()
    return Exchanged(rid, mirror, "POST", "/v1/chat/completions", b"", body, start, outcome,
                     answer=b"".join(p for _, p in pieces[-2:]), streamed=True, pieces=pieces,
                     mirrors=() if mirror else ("inhouse",))


def test_a_recorded_openai_stream_has_the_testers_output_hash_and_chunk_times() -> None:
    """The record of a streamed chat is what the load tester would record reading the same pieces: the hash of the
    text the client read, and one time per content chunk (so TPOT)."""
    exchange = streamed_chat(4, "zlab", False, gap=0.01)
    record = shadow_record(exchange, t0_perf_s=100.0)
    assert record.output_sha256 == hashlib.sha256(b"def f(x)").hexdigest()
    assert record.chunk_times_s == pytest.approx([4.02, 4.03, 4.04]) and record.chunk_tokens is None
    assert tpot_s(record) == pytest.approx((4.04 - 4.02) / 5)
    sent = Sent("zlab", record.task_id, 4, False, None, 4.0, 4.0, 4.06, "chat")
    tester = derive(100.0, Finished(sent, 200, list(exchange.pieces or ()), None))
    assert (tester.output_sha256, tester.chunk_times_s) == (record.output_sha256, record.chunk_times_s)


def test_a_failed_or_unfinished_recorded_stream_has_chunk_times_but_no_hash() -> None:
    failed = shadow_record(streamed_chat(1, "zlab", False, gap=0.01, error="stream_cut"), 100.0)
    assert failed.error_kind == "disconnect" and failed.output_sha256 is None and len(failed.chunk_times_s) == 3
    unfinished = shadow_record(streamed_chat(1, "zlab", False, gap=0.01, cut=1), 100.0)  # no [DONE]: not whole
    assert (unfinished.error_kind, unfinished.error_message) == ("disconnect", "stream ended before [DONE]")
    assert unfinished.output_sha256 is None and len(unfinished.chunk_times_s) == 3  # as the tester reads it


@pytest.mark.parametrize(("route", "streamed", "answer", "said"), [
    ("native", True, b"data: {not json\n\n" + sglang.SSE_DONE, "invalid JSON"),
    ("native", False, b"not json at all", "not SGLang's"),
])
def test_a_200_answer_that_is_not_sglangs_is_the_arms_protocol_error(route: str, streamed: bool, answer: bytes,
                                                                     said: str) -> None:
    """A candidate answering garbage with 200 must not look error-free to a verdict: the tester's reading of the
    same answer is a protocol error."""
    e = exchanged(3, "inhouse", True, streamed=streamed, answer=answer)
    if not streamed:  # as the gateway hands it on: its own reading failed
        e = exchanged(3, "inhouse", True, streamed=streamed, answer=answer, error="protocol")
        e = replace(e, unparsed="the answer is not SGLang's (invalid JSON)")
    else:  # the gateway's reading of the stream's end passed: the record reads every event
        e = replace(e, pieces=[])
    record = shadow_record(e, 100.0)
    assert record.error_kind == "protocol" and said in (record.error_message or "") and record.output_sha256 is None


def test_an_error_event_before_a_streams_closing_chunks_fails_its_record() -> None:
    """SGLang follows an in-band error with the usage chunk and `[DONE]`; read apart, they push the error out of the
    last events the relay keeps. The record reads every piece, as the tester would: a stream error."""
    exchange = streamed_chat(2, "inhouse", True, gap=0.01)
    error = _event({"error": {"object": "error", "message": "retracted", "type": "SERVICE_UNAVAILABLE", "code": 503}})
    pieces = [*exchange.pieces[:3], (102.05, error), *((102.06 + i / 100, p) for i, (_, p) in enumerate(exchange.pieces[-2:]))]
    record = shadow_record(replace(exchange, pieces=pieces, answer=b"".join(p for _, p in pieces[-2:])), 100.0)
    assert record.error_kind == "stream_error" and record.error_message == "retracted" and record.output_sha256 is None
    assert shadow_record(exchange, 100.0).ok


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


META = {"prompt_tokens": 3, "completion_tokens": 2, "finish_reason": {"type": "stop"}, "spec_verify_ct": 1}
FINISHED = {"text": "ab", "output_ids": [1, 2], "meta_info": META}
ENDS = {
    "finished": _event(FINISHED) + sglang.SSE_DONE,
    "finished, no [DONE]": _event(FINISHED),
    "only [DONE]": sglang.SSE_DONE,
    "nothing": b"",
    "an error event": _event({"error": {"message": "boom", "code": 503}}) + sglang.SSE_DONE,
    "an abort": _event({**FINISHED, "meta_info": {**META, "finish_reason": {
        "type": "abort", "message": "Aborted", "status_code": None}}}) + sglang.SSE_DONE,
    "no finish reason": _event({**FINISHED, "meta_info": {**META, "finish_reason": None}}) + sglang.SSE_DONE,
    "a delta": _event({"text": "b", "output_ids": [2], "meta_info": {**META, "finish_reason": {"type": "length"}}}),
    "malformed JSON": b'data: {"text\n\n' + sglang.SSE_DONE,
    "no meta_info": _event({"text": "ab"}) + sglang.SSE_DONE,
    "a bad completion_tokens": _event({**FINISHED, "meta_info": {**META, "completion_tokens": "2"}}) + sglang.SSE_DONE,
    "a bad finish_reason": _event({**FINISHED, "meta_info": {**META, "finish_reason": 3}}),
    "an event before the last": _event({"text": "a", "meta_info": {**META, "completion_tokens": 1}})
    + _event(FINISHED) + sglang.SSE_DONE,
}


@pytest.mark.parametrize("answer", ENDS.values(), ids=ENDS.keys())
def test_a_native_streams_end_is_read_as_the_load_tester_reads_its_last_event(answer: bytes) -> None:
    """A shadow record reads only what an end needs of the last event (not its spec fields, which the relay read);
    what it reads of it (output, deltas, how it failed) is what the load tester's whole reading of that event
    gives."""
    events = sglang.SSEDecoder().feed(answer)
    last = max(len(events) - 1, 0)
    while last > 0 and events[last] == sglang.DONE:
        last -= 1
    tester = read_events("native", events[last:], [0.0] * (len(events) - last))
    end = native_stream_end(answer)
    assert (end.text, end.incremental, end.failure) == (tester.text, tester.incremental, tester.failure)


def test_a_recorded_native_stream_has_tokens_per_chunk() -> None:
    last = b"data: " + _native("ab", 2, 2) + b"\n\n"
    exchange = replace(exchanged(0, "zlab", False, streamed=True, answer=last + sglang.SSE_DONE),
                       pieces=[(101.0, 1), (102.0, 2)])
    record = shadow_record(exchange, 100.0)
    assert (record.chunk_times_s, record.chunk_tokens) == ([1.0, 2.0], [1, 1])
    assert record.output_sha256 == hashlib.sha256(b"ab").hexdigest() and record.finish_reason == "length"


def test_a_native_stream_of_several_outputs_is_recorded_from_every_event_as_the_tester_reads_it() -> None:
    """The gateway cannot count interleaved outputs (`NativeOutputs`): the relay keeps every event, and the record
    reads them output by output, at temperature 1 too, where one output runs ahead of the other."""
    def event(index: int, text: str, tokens: int, verify: int | None = None) -> bytes:
        meta: dict[str, object] = {"completion_tokens": tokens, "prompt_tokens": 3}
        if verify is not None:
            meta |= {"spec_verify_ct": verify, "finish_reason": {"type": "length", "length": tokens}}
        return b"data: " + json.dumps({"index": index, "text": text, "meta_info": meta}).encode() + b"\n\n"
    pieces = [(101.0, event(0, "a", 1)), (101.1, event(1, "x", 2)), (101.2, event(1, "xyz", 6, verify=2)),
              (101.3, event(0, "ab", 4, verify=2)), (101.4, sglang.SSE_DONE)]
    body = {"text": "p", "sampling_params": {"n": 2, "temperature": 1.0}, "stream": True}
    exchange = replace(exchanged(0, "zlab", False, streamed=True, answer=pieces[-2][1] + sglang.SSE_DONE),
                       pieces=pieces, body=json.dumps(body).encode(), request=body,
                       outcome=Outcome(arm="zlab", route="native", replica="r", status=200, error=None, ttft_s=1.0,
                                       e2e_s=1.4, output_tokens=None, verify_rounds=None, measure=None))
    record = shadow_record(exchange, 100.0)
    assert record.ok and (record.completion_tokens, record.spec_verify_ct, record.acceptance) == (10, 4, "exact")
    assert record.chunk_tokens == [1, 2, 4, 3] and record.output_sha256 == hashlib.sha256(b"ab\x00xyz").hexdigest()


def test_an_error_in_band_is_recorded_as_the_tester_has_it() -> None:
    """HTTP 200, the status the error carried, the server's words, and no acceptance (as the gateway hands it: the
    outcome's status is the error's code)."""
    error = b'data: {"error": {"message": "context too long", "code": 400}}\n\n'
    exchange = replace(exchanged(0, "zlab", False, streamed=True, answer=error + sglang.SSE_DONE),
                       pieces=[(101.0, 1)])
    exchange = replace(exchange, outcome=replace(exchange.outcome, error="stream_error", status=400))
    record = shadow_record(exchange, 100.0)
    assert (record.error_kind, record.error_message, record.http_status, record.error_code) == (
        "stream_error", "context too long", 200, 400)
    assert (record.acceptance, record.spec_verify_ct) == ("unknown", None)


@pytest.mark.parametrize("end", [b'data: {"error": {"message": "boom", "code": 500}}\n\n', b"data: {\"text\n\n"],
                         ids=["an error in band", "a malformed last event"])
def test_a_recorded_native_stream_whose_last_event_is_not_a_finish_has_no_output_hash(end: bytes) -> None:
    """Only the last event is decoded (each repeats the whole output): one that is an error, malformed or missing
    leaves the record without a hash, though the events before it finished well."""
    finished = b"data: " + _native("ab", 2, 2) + b"\n\n"
    exchange = replace(exchanged(0, "zlab", False, streamed=True, answer=finished + end + sglang.SSE_DONE),
                       pieces=[(101.0, 1), (102.0, 2)])
    assert shadow_record(exchange, 100.0).output_sha256 is None
    assert shadow_record(replace(exchange, answer=sglang.SSE_DONE), 100.0).output_sha256 is None
    whole = replace(exchange, answer=finished + sglang.SSE_DONE)
    assert shadow_record(whole, 100.0).output_sha256 == hashlib.sha256(b"ab").hexdigest()


def native_stream(tokens: int, incremental: bool = False) -> list[bytes]:
    """A native `/generate` stream as SGLang writes it: the whole text and ids so far in every event (only the new
    ones, `incremental`), one to four tokens an event (verify rounds), the finish, latency and spec fields on the
    last, then `[DONE]`."""
    encoder, events, sent = NativeStreamEncoder(incremental), [], 0
    while sent < tokens:
        step = min(1 + len(events) % 4, tokens - sent)
        sent += step
        last = sent == tokens
        meta = meta_info_body(rid="r", finish=sglang.FinishReason("length", length=tokens) if last else None,
                              prompt_tokens=7, completion_tokens=sent, e2e_latency_s=1.5 if last else None,
                              spec=sglang.SpecStats(verify_ct=len(events) + 1) if last else None)
        events.append(encoder.event(' é"\\x' * step, range(sent - step, sent), meta))
    return [*events, sglang.SSE_DONE]


def relayed(events: list[bytes], t0: float) -> tuple[EventRelay, list[tuple[float, bytes]]]:
    """The events through a recording relay, read by read (now two events in one read, now one cut across two):
    the relay, and the pieces its client read, each with its arrival."""
    reads, body, at = [], b"".join(events), 0
    for n, event in enumerate(events):
        end = at + len(event) + (len(events[n + 1]) if n % 5 == 1 and n + 1 < len(events) else 0)
        reads += [body[at:end - 7], body[end - 7:end]] if n % 3 == 0 else [body[at:end]]
        at = end
        if at >= len(body):
            break
    client: list[tuple[float, bytes]] = []
    marks, now = sglang.NATIVE_TOKENS, t0
    relay = EventRelay(lambda data: client.append((now, data)), False, marks.keys, marks.cumulative, (), None, None,
                       True)
    for n, read in enumerate(reads):
        now = t0 + 0.001 * (n + 1)
        relay.received(now, read)
    return relay, client


@pytest.mark.parametrize("tampered", ["whole", "no [DONE]", "a total went back"])
def test_a_recorded_native_stream_is_what_the_tester_would_read_without_keeping_its_events(tampered: str) -> None:
    """A native stream's relay keeps each event's running total, not the events (which repeat the whole output):
    its record has the chunk times, tokens and output hash that the load tester's reader gives for the pieces the
    client read, also when the stream did not end (no hash) or a total went back (the tester stops there)."""
    events = native_stream(2048)
    if tampered == "no [DONE]":
        events = events[:-1]
    elif tampered == "a total went back":
        events[300] = re.sub(rb'"completion_tokens":(\d+)', lambda m: b'"completion_tokens":%d' % (int(m[1]) - 60),
                             events[300])
    relay, client = relayed(events, 100.0)
    assert relay.pieces is not None and all(isinstance(total, int) for _, total in relay.pieces)
    exchange = replace(exchanged(3, "zlab", False, streamed=True, answer=relay.tail), pieces=relay.pieces)
    record = shadow_record(exchange, 100.0)
    sent = Sent("zlab", record.task_id, 3, False, None, 3.0, 3.0, 103.0, "native")
    tester = derive(100.0, Finished(sent, 200, client, None))
    assert (record.chunk_times_s, record.chunk_tokens) == (tester.chunk_times_s, tester.chunk_tokens)
    assert record.output_sha256 == tester.output_sha256
    if tampered == "whole":
        assert record.output_sha256 == hashlib.sha256((' é"\\x' * 2048).encode()).hexdigest()
        assert sum(record.chunk_tokens or ()) == 2048 and len(record.chunk_times_s) == 820
    else:
        assert record.output_sha256 is None and len(record.chunk_times_s) == (820 if tampered == "no [DONE]" else 300)


def test_compare_judges_tpot_on_recorded_streams(tmp_path: Path) -> None:
    traffic = [e for rid in range(30) for e in (streamed_chat(rid, "zlab", False, gap=0.01),
                                                streamed_chat(rid, "inhouse", True, gap=0.02))]
    gate = tmp_path / "gate.yaml"
    gate.write_text("rules:\n  - {metric: tpot_p95, max_worse: 0.05}\n  - {metric: lossless_fraction, at_least: 0.99}\n")
    judged = compare_shadow(_record(tmp_path, traffic), None, gate, False, tmp_path / "v")
    rules = {r.metric: r for r in judged.verdict.judgement.rules}
    assert rules["tpot_p95"].status == "FAIL" and rules["lossless_fraction"].status == "PASS"
    assert judged.verdict.verdict == "FAIL" and judged.notes == []


def test_recorder_keeps_only_mirrored_requests_and_rotates(tmp_path: Path) -> None:
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path, records_per_folder=4, max_folders=2), "zlab")
    recorder.observe(exchanged(0, "zlab", False, mirrors=()))  # never mirrored: not recorded
    recorder.observe(exchanged(9, "inhouse", False, mirrors=()))  # pinned to an arm: no pair, and no rotation
    recorder.observe(exchanged(1, "inhouse", True))         # mirror first, then its primary
    recorder.observe(exchanged(1, "zlab", False))
    recorder.observe(exchanged(2, "zlab", False))
    recorder.observe(exchanged(2, "inhouse", True))         # the fourth record: the folder is closed
    first = _folders(tmp_path)
    assert len(first) == 2 and (first[0] / "summary.json").exists() and not (first[1] / "summary.json").exists()
    assert [(r.index, r.arm) for r in read_records(first[0] / "requests.jsonl")] == [
        (1, "zlab"), (1, "inhouse"), (2, "zlab"), (2, "inhouse")]  # a request's records together, primary first
    for rid in (3, 4):
        recorder.observe(exchanged(rid, "inhouse", True))
        recorder.observe(exchanged(rid, "zlab", False))
    recorder.observe(exchanged(5, "inhouse", True))         # max_folders reached: recording has stopped
    recorder.close()
    assert len(_folders(tmp_path)) == 2
    assert len(list(read_records(_folders(tmp_path)[1] / "requests.jsonl"))) == 4


def test_a_folder_that_holds_no_record_when_recording_ends_is_removed(tmp_path: Path) -> None:
    """The folder opened when the last one filled, with no mirrored request after: it was left closed and empty,
    and `dfserve compare` on it said it had mirrored arms []."""
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path, records_per_folder=2), "zlab")
    recorder.observe(exchanged(1, "zlab", False))
    recorder.observe(exchanged(1, "inhouse", True))  # the folder is full: closed, the next opened
    assert len(_folders(tmp_path)) == 2
    recorder.close()
    (only,) = _folders(tmp_path)
    assert (only / "summary.json").exists() and len(list(read_records(only / "requests.jsonl"))) == 2


class Totals(list[tuple[float, int]]):
    """What a relay kept, which a weak reference can follow."""


def test_a_pending_primary_is_held_as_its_record_not_its_exchange(tmp_path: Path) -> None:
    """What waits for a mirror is the primary's record: its exchange (a native stream's whole output, an OpenAI
    stream's pieces) is let go as soon as it is observed; the record, written beside its mirror's once that comes,
    has the stream's chunks."""
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path), "zlab")
    totals = Totals([(101.001, 1), (101.002, 3)])
    kept = weakref.ref(totals)
    recorder.observe(replace(exchanged(1, "zlab", False, streamed=True), pieces=totals))
    del totals
    gc.collect()
    assert kept() is None
    recorder.observe(exchanged(1, "inhouse", True))
    recorder.close()
    primary, mirror = read_records(_folders(tmp_path)[0] / "requests.jsonl")
    assert (primary.arm, primary.chunk_tokens, mirror.arm) == ("zlab", [1, 2], "inhouse")


def test_a_primary_paired_after_a_rotation_is_timed_from_its_new_folders_time_zero(tmp_path: Path) -> None:
    """A primary held while its folder filled is written with its mirror into the next folder, its times moved to
    that folder's time zero: the pair's shared start is one time there."""
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path, records_per_folder=2), "zlab")
    recorder.observe(replace(exchanged(1, "zlab", False, streamed=True), pieces=[(101.005, 2)]))
    recorder.observe(exchanged(2, "zlab", False))
    recorder.observe(exchanged(2, "inhouse", True))  # the second record: the folder is closed, the next opened
    recorder.observe(replace(exchanged(1, "inhouse", True, streamed=True), pieces=[(101.007, 2)]))
    recorder.close()
    second = list(read_records(_folders(tmp_path)[1] / "requests.jsonl"))
    assert [(r.index, r.arm) for r in second] == [(1, "zlab"), (1, "inhouse")]
    primary, mirror = second
    assert primary.dispatched_s == pytest.approx(mirror.dispatched_s, abs=1e-9)
    assert primary.chunk_times_s[0] == pytest.approx(mirror.chunk_times_s[0] - 0.002, abs=1e-9)


def test_a_requests_body_is_read_once_for_all_its_arms_records(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Hashing and decoding a body costs more than the rest of a record when prompts are long: the recorder reads
    each request's once, and every arm's record carries what it read."""
    read: list[bytes] = []
    of = RequestTask.of

    def counted(exchanged: Exchanged) -> RequestTask:
        read.append(exchanged.body)
        return of(exchanged)

    monkeypatch.setattr(RequestTask, "of", counted)
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path / "shadow", secondary="zlab2"), "zlab", ENGINES)
    for rid in (0, 1):
        recorder.observe(exchanged(rid, "inhouse", True, temperature=0.5))
        recorder.observe(exchanged(rid, "zlab", False, mirrors=("inhouse", "zlab2"), temperature=0.5))
        recorder.observe(exchanged(rid, "zlab2", True, temperature=0.5))
    recorder.close()
    records = list(read_records(_folders(tmp_path / "shadow")[0] / "requests.jsonl"))
    assert len(read) == 2 and len(records) == 6
    for rid in (0, 1):
        same = {(r.task_id, r.temperature) for r in records if r.index == rid}
        assert same == {(shadow_record(exchanged(rid, "zlab", False, temperature=0.5), 0).task_id, 0.5)}


def test_a_requests_records_are_written_together_and_one_let_go_unpaired_makes_its_folder_incomplete(
        tmp_path: Path) -> None:
    """Request 1's candidate finishes before a rotation and its primary and secondary after: all three land in one
    folder. Request 2's secondary never comes: past max_pending waiting requests it is written without it, and
    its folder is judged only by force."""
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path / "shadow", records_per_folder=4, max_pending=2,
                                           secondary="zlab2"), "zlab", ENGINES)
    both = ("inhouse", "zlab2")
    recorder.observe(exchanged(0, "zlab", False, mirrors=("inhouse",)))  # the secondary's arm was down
    recorder.observe(exchanged(1, "inhouse", True))
    recorder.observe(exchanged(0, "inhouse", True))  # request 0 written: 2 records
    recorder.observe(exchanged(1, "zlab", False, mirrors=both))
    recorder.observe(exchanged(1, "zlab2", True))  # request 1 written: 5 records, the folder is closed after it
    recorder.observe(exchanged(2, "zlab", False, mirrors=both))
    recorder.observe(exchanged(2, "inhouse", True))
    for rid in (3, 4):
        recorder.observe(exchanged(rid, "zlab", False, mirrors=both))
    for rid in (3, 4):
        for arm in both:
            recorder.observe(exchanged(rid, arm, True))
    recorder.close()
    first, second, third = _folders(tmp_path / "shadow")
    assert [(r.index, r.arm) for r in read_records(first / "requests.jsonl")] == [
        (0, "zlab"), (0, "inhouse"), (1, "zlab"), (1, "inhouse"), (1, "zlab2")]
    assert [(r.index, r.arm) for r in read_records(second / "requests.jsonl")] == [
        (2, "zlab"), (2, "inhouse"), (3, "zlab"), (3, "inhouse"), (3, "zlab2")]
    assert [(r.index, r.arm) for r in read_records(third / "requests.jsonl")] == [
        (4, "zlab"), (4, "inhouse"), (4, "zlab2")]
    assert not compare_shadow(third, None, None, False, tmp_path / "v").verdict.forced
    judged = compare_shadow(first, None, None, False, tmp_path / "v")
    assert not judged.verdict.forced
    assert "requests recorded without a pair are not judged (1 of zlab): not mirrored to zlab2" in " ".join(
        judged.notes)
    with pytest.raises(Untrusted, match=r"wrote requests whose records never all came"):
        compare_shadow(second, None, None, False, tmp_path / "v")
    forced = compare_shadow(second, None, None, True, tmp_path / "v")
    assert forced.verdict.forced and "never all came" in forced.verdict.incomplete[0]


def test_a_request_waiting_behind_max_pending_later_ones_is_let_go_once_and_duplicates_are_no_records(
        tmp_path: Path) -> None:
    """Request 0's secondary exchange is lost (it comes only after its request was let go), and its candidate's
    exchange comes twice; every later request completes."""
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path / "shadow", max_pending=3, secondary="zlab2"), "zlab", ENGINES)
    both = ("inhouse", "zlab2")
    recorder.observe(exchanged(0, "inhouse", True))
    recorder.observe(exchanged(0, "inhouse", True, verify=1))  # a second exchange of one arm: not a record
    recorder.observe(exchanged(0, "zlab", False, mirrors=both))
    for rid in range(1, 6):
        if rid == 5:
            recorder.observe(exchanged(0, "zlab2", True))  # request 0 was let go at request 4: not recorded
        recorder.observe(exchanged(rid, "zlab", False, mirrors=both))
        for arm in both:
            recorder.observe(exchanged(rid, arm, True))
    recorder.close()
    [folder] = _folders(tmp_path / "shadow")
    records = list(read_records(folder / "requests.jsonl"))
    assert [(r.index, r.arm) for r in records] == [
        *[(rid, arm) for rid in (1, 2, 3) for arm in ("zlab", *both)], (0, "zlab"), (0, "inhouse"),
        *[(rid, arm) for rid in (4, 5) for arm in ("zlab", *both)]]
    assert next(r for r in records if (r.index, r.arm) == (0, "inhouse")).spec_verify_ct == 4  # the first exchange
    with pytest.raises(Untrusted, match="never all came"):
        compare_shadow(folder, None, None, False, tmp_path / "v")
    assert compare_shadow(folder, None, None, True, tmp_path / "v").verdict.judgement.pairs == 6


def test_a_request_waiting_when_the_primary_changes_is_recorded_nowhere(tmp_path: Path) -> None:
    """Request 3 waits for its mirror while the routing makes zlab2 the primary: it is no pair of zlab2's folder
    (and zlab's is closed), so neither holds it, and neither is incomplete."""
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path / "shadow"), "zlab", ENGINES)
    for e in _traffic(3, 4):
        recorder.observe(e)
    recorder.observe(exchanged(3, "zlab", False))
    recorder.observe(exchanged(4, "zlab2", False))  # the routing changed: the folder rotates
    recorder.observe(exchanged(3, "inhouse", True))
    recorder.observe(exchanged(4, "inhouse", True))
    recorder.close()
    first, second = _folders(tmp_path / "shadow")
    assert [(r.index, r.arm) for r in read_records(first / "requests.jsonl")] == [
        (rid, arm) for rid in range(3) for arm in ("zlab", "inhouse")]
    assert [(r.index, r.arm) for r in read_records(second / "requests.jsonl")] == [(4, "zlab2"), (4, "inhouse")]
    for folder in (first, second):
        assert not compare_shadow(folder, None, None, False, tmp_path / "v").verdict.forced


def test_a_folder_whose_summary_was_edited_is_refused_unless_forced(tmp_path: Path) -> None:
    """The `interrupted` flag (requests written without all their records) was not sealed, and a folder whose
    config's seal was dropped, so that an arm's drafter could be renamed, was judged unforced."""
    for name, edit in (("flag", lambda s: {**s, "interrupted": not s["interrupted"]}),
                       ("unsealed", lambda s: {k: v for k, v in s.items() if k != "config_sha256"})):
        folder = _record(tmp_path / name, _traffic(10, 4))
        summary = folder / "summary.json"
        summary.write_text(json.dumps(edit(json.loads(summary.read_text()))))
        with pytest.raises(Untrusted, match=r"summary\.json is not as its writer left it \(its fields' sha256"):
            compare_shadow(folder, None, None, False, tmp_path / name / "v")
        assert compare_shadow(folder, None, None, True, tmp_path / name / "v").verdict.forced


def test_mirrors_records_without_their_primarys_are_refused_unless_forced(tmp_path: Path) -> None:
    folder = _record(tmp_path, _traffic(10, 4))
    requests = folder / "requests.jsonl"
    records = [json.loads(line) for line in requests.read_text().splitlines()]
    kept = [r for r in records if not (r["arm"] == "zlab" and r["index"] in (3, 7))]
    requests.write_text("".join(json.dumps(record) + "\n" for record in kept))
    summary = json.loads((folder / "summary.json").read_text())
    summary["arms"][0] = json.loads(summarize_arm("zlab", [r for r in read_records(requests) if r.arm == "zlab"])
                                    .model_dump_json())
    (folder / "summary.json").write_text(json.dumps(summary))  # the summary edited to match
    with pytest.raises(Untrusted, match=r"2 requests have mirrors' records and no primary's"):
        compare_shadow(folder, None, None, False, tmp_path / "v")
    forced = compare_shadow(folder, None, None, True, tmp_path / "v")
    assert forced.verdict.forced and len(forced.verdict.judgement.rules) and "2 of inhouse" in " ".join(forced.notes)


def test_records_written_in_batches_are_each_on_disk_once_in_order_and_rotation_flushes(tmp_path: Path) -> None:
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path, records_per_folder=6), "zlab")
    seam = Observers(ObserverMetrics.build(CollectorRegistry()))
    seam.add("shadow", recorder)
    for rid in range(10):
        seam.finished(exchanged(rid, "zlab", False))
        seam.finished(exchanged(rid, "inhouse", True))
    seam.close()  # the gateway's stop: every batch flushed, the last folder closed
    folders = _folders(tmp_path)
    written = [(r.index, r.arm) for folder in folders for r in read_records(folder / "requests.jsonl")]
    assert written == [(rid, arm) for rid in range(10) for arm in ("zlab", "inhouse")]
    assert [len((f / "requests.jsonl").read_text().splitlines()) for f in folders] == [6, 6, 6, 2]
    assert all((f / "summary.json").exists() for f in folders)


ENGINES = {"zlab": "http://engine-a", "inhouse": "http://engine-b", "zlab2": "http://engine-c"}
DRAFTERS = {"http://engine-a": "z-lab/dflash", "http://engine-b": "inhouse-0001", "http://engine-c": "z-lab/dflash"}


@pytest.fixture(autouse=True)
def engines(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, object]]:
    """What each arm's engine says of itself (`/server_info`), without a server."""
    infos: dict[str, dict[str, object]] = {url: {"model_path": "Qwen/Qwen3-8B", "max_running_requests": 64,
                                                 "speculative_draft_model_path": drafter}
                                           for url, drafter in DRAFTERS.items()}
    monkeypatch.setattr(recorder_module, "server_info", lambda url: infos.get(url))
    return infos


def test_a_folders_wall_clock_zero_is_read_with_its_clock_zero_not_after_the_arms_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Record times are offsets from the folder's time zero; `t0_unix_s` puts them on the wall clock, so it must be
    read at that zero, not after each arm's `/server_info` came (up to seconds each)."""
    asked_unix_s: list[float] = []

    def slow_server_info(url: str) -> None:
        asked_unix_s.append(time.time())
        time.sleep(0.2)

    monkeypatch.setattr(recorder_module, "server_info", slow_server_info)
    before = time.time()
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path / "shadow"), "zlab", ENGINES)
    config = json.loads((_folders(tmp_path / "shadow")[0] / "config.json").read_text())
    recorder.close()
    assert len(asked_unix_s) == len(ENGINES) and before <= config["t0_unix_s"] <= asked_unix_s[0]


def _recording(tmp_path: Path, exchanges: list[Exchanged], secondary: str | None = None) -> ShadowRecorder:
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path / "shadow", secondary=secondary), "zlab", ENGINES)
    for e in exchanges:
        recorder.observe(e)
    recorder.flush()  # as the gateway's observer thread does after each batch
    return recorder


def _record(tmp_path: Path, exchanges: list[Exchanged], secondary: str | None = None) -> Path:
    _recording(tmp_path, exchanges, secondary).close()
    return _folders(tmp_path / "shadow")[0]


def _traffic(n: int, cand_verify: int, temperature: float = 0, cand_text: str = "out",
             mirrors: tuple[str, ...] = ("inhouse",)) -> list[Exchanged]:
    return [e for rid in range(n) for e in (exchanged(rid, "zlab", False, temperature=temperature, mirrors=mirrors),
                                            exchanged(rid, "inhouse", True, verify=cand_verify, text=cand_text,
                                                      temperature=temperature))]


def test_a_pair_whose_client_read_slowly_is_not_timed_on_either_side(tmp_path: Path) -> None:
    """The relay reads the primary's stream only as fast as its client takes it, the mirror's at full speed: timed,
    a slow client's pairs made the candidate look twice as fast. A brief wait (a large event filling the socket
    once) leaves the pair timed."""
    def slow(e: Exchanged, paused_s: float) -> Exchanged:
        outcome = replace(e.outcome, e2e_s=0.1 + paused_s) if not e.mirror else e.outcome
        return replace(e, outcome=outcome, paused_s=paused_s if not e.mirror else 0.0)

    traffic = [slow(e, 0.5 if e.request_id % 2 else 0.0005) for e in _traffic(40, 4)]
    records = read_records(_record(tmp_path, traffic) / "requests.jsonl")
    bound = {(r.index, r.arm) for r in records if r.client_bound}
    assert bound == {(rid, arm) for rid in range(1, 40, 2) for arm in ("zlab", "inhouse")}
    assert all(e2e_s(r) is None and tpot_s(r) is None for r in records if r.client_bound)
    assert all(e2e_s(r) is not None for r in records if not r.client_bound)
    even = [slow(e, 0.5 if e.request_id % 2 else 0.0005) for e in _traffic(PASSING, 4, cand_text="out")]
    judged = compare_shadow(_record(tmp_path / "judged", even), None, None, False, tmp_path / "v")
    rules = {r.metric: r for r in judged.verdict.judgement.rules}
    timed = [r for r in rules.values() if r.metric in TIMED]
    assert timed and all(r.status != "PASS" and "client_bound" in r.detail for r in timed)
    assert rules["accept_length"].status != "INCONCLUSIVE" and judged.verdict.verdict != "PASS"
    assert any(f"{PASSING // 2} of {PASSING} pairs were read at a slow client's pace" in n for n in judged.notes)


def test_mirrors_skipped_while_their_arm_was_down_are_its_failures(tmp_path: Path) -> None:
    """The gateway sends no mirror to an arm with no healthy replica: its requests then are its failures, not left
    out, or a candidate's worst hours would leave a clean record (and a PASS on errors)."""
    down = [replace(exchanged(rid, "zlab", False, mirrors=()), skipped=("inhouse",)) for rid in range(10)]
    traffic = down + _traffic(PASSING, 4)[20:]
    folder = _record(tmp_path, traffic)
    records = [r for r in read_records(folder / "requests.jsonl") if r.arm == "inhouse"]
    assert len(records) == PASSING and sum(r.error_kind == "connect" for r in records) == 10
    assert "no healthy replica" in next(r.error_message or "" for r in records if r.error_kind)
    judged = compare_shadow(folder, None, None, False, tmp_path / "v")
    errors = {r.metric: r for r in judged.verdict.judgement.rules}["error_rate"]
    assert errors.status == "FAIL" and judged.verdict.verdict == "FAIL"


def test_compare_fails_a_worse_candidate_and_reports_the_noise_floor(tmp_path: Path) -> None:
    traffic = _traffic(30, cand_verify=8, mirrors=("inhouse", "zlab2")) + [exchanged(rid, "zlab2", True)
                                                                          for rid in range(30)]
    judged = compare_shadow(_record(tmp_path, traffic, secondary="zlab2"), None, None, False, tmp_path / "v")
    assert judged.verdict.verdict == "FAIL" and judged.verdict.judgement.pairs == 30
    assert judged.verdict.candidate.name == "inhouse" and judged.verdict.baseline.name == "zlab"
    assert (judged.verdict.baseline.drafter, judged.verdict.candidate.drafter) == ("z-lab/dflash", "inhouse-0001")
    assert judged.verdict.candidate.target == "Qwen/Qwen3-8B" and not judged.verdict.forced
    assert judged.noise_floor is not None and judged.noise_floor.judgement.candidate == "zlab2"
    assert judged.noise_floor.judgement.verdict != "FAIL"
    assert "Noise floor: zlab2 against zlab" in (judged.path.parent / "report.html").read_text()
    assert (judged.path.parent / "noise-floor.json").exists()


def test_records_and_verdicts_of_simulated_engines_say_so(tmp_path: Path,
                                                          engines: dict[str, dict[str, object]]) -> None:
    """As the load tester's do: a rehearsal on dfserve's simulator is never mistaken for a drafter's figures."""
    for info in engines.values():
        info[SIM_MARKER_KEY] = True
    judged = compare_shadow(_record(tmp_path, _traffic(30, cand_verify=8)), None, None, False, tmp_path / "v")
    records = list(read_records(_folders(tmp_path / "shadow")[0] / "requests.jsonl"))
    assert records and all(r.simulated for r in records)
    assert judged.verdict.baseline.simulated and judged.verdict.candidate.simulated
    assert "SIMULATED" in (judged.path.parent / "report.html").read_text()


def test_chunks_read_with_the_next_are_a_note_of_the_verdict(tmp_path: Path) -> None:
    """A gateway whose loop fell a chunk gap behind dates a chunk by the next (the kernel keeps the newer stamp):
    said beside the verdict for the arm it happened to, as the load tester warns of its own."""
    relay, _ = relayed(native_stream(16), 100.0)

    def streamed(rid: int, arm: str, mirror: bool, together: bool) -> Exchanged:
        first = 100.0 + rid + 0.01
        totals = [(first, 2), (first if together else first + 0.01, 4), (first + 0.02, 16)]
        return replace(exchanged(rid, arm, mirror, streamed=True, answer=relay.tail), pieces=totals)

    traffic = [e for rid in range(30) for e in (streamed(rid, "zlab", False, False), streamed(rid, "inhouse", True,
                                                                                             rid % 3 == 0))]
    judged = compare_shadow(_record(tmp_path, traffic), None, None, False, tmp_path / "v")
    assert [note.split(":")[0] for note in judged.notes if "one read with the next" in note] == ["inhouse"]
    assert ("inhouse: 10 of 30 first chunks and 10 of 60 chunks came in one read with the next one, so are dated by "
            "it") in " ".join(judged.notes)


def test_losslessness_on_live_traffic(tmp_path: Path) -> None:
    differing = compare_shadow(_record(tmp_path / "a", _traffic(30, 4, cand_text="other")), None, None, False,
                               tmp_path / "v")
    lossless = next(r for r in differing.verdict.judgement.rules if r.metric == "lossless_fraction")
    assert lossless.status == "FAIL"
    sampled = compare_shadow(_record(tmp_path / "b", _traffic(PASSING, 4, temperature=0.7, cand_text="other")),
                             None, None, False, tmp_path / "v")
    lossless = next(r for r in sampled.verdict.judgement.rules if r.metric == "lossless_fraction")
    assert lossless.status == "NOT_APPLICABLE" and sampled.verdict.verdict == "PASS"


def test_a_candidate_that_changes_greedy_outputs_fails_in_mixed_traffic(tmp_path: Path) -> None:
    """Sampled requests beside greedy ones never make losslessness unjudged: it is judged on the greedy pairs (a
    PASS here, on acceptance and latency alone, would promote a candidate that changes outputs)."""
    traffic = [e for rid in range(40) for e in (exchanged(rid, "zlab", False, temperature=0.7 if rid % 2 else 0),
                                                 exchanged(rid, "inhouse", True, temperature=0.7 if rid % 2 else 0,
                                                           text="other"))]
    judged = compare_shadow(_record(tmp_path, traffic), None, None, False, tmp_path / "v")
    lossless = next(r for r in judged.verdict.judgement.rules if r.metric == "lossless_fraction")
    assert lossless.status == "FAIL" and judged.verdict.verdict == "FAIL"
    assert lossless.detail.startswith("0/20 identical (the greedy pairs of 40)")
    assert judged.verdict.judgement.lossless is not None and judged.verdict.judgement.lossless.greedy_of == 40
    assert "0 of 20 paired outputs identical (the greedy pairs of 40)" in (judged.path.parent / "report.html").read_text()
    same = [e for rid in range(40) for e in (exchanged(rid, "zlab", False, temperature=0.7 if rid % 2 else 0),
                                             exchanged(rid, "inhouse", True, temperature=0.7 if rid % 2 else 0,
                                                       text="other" if rid % 2 else "out"))]
    judged = compare_shadow(_record(tmp_path / "same", same), None, None, False, tmp_path / "v")
    lossless = next(r for r in judged.verdict.judgement.rules if r.metric == "lossless_fraction")
    assert lossless.status == "PASS" and lossless.detail.startswith("20/20 identical (the greedy pairs of 40)")
    assert "passes on the observed fraction, 1.0000 ≥ 0.99" in lossless.detail  # its interval reaches below 0.99


def test_greedy_openai_streams_make_losslessness_not_applicable_and_say_why(tmp_path: Path) -> None:
    stream_end = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    traffic = [e for rid in range(30) for e in (exchanged(rid, "zlab", False),
                                                exchanged(rid, "inhouse", True, streamed=True, answer=stream_end))]
    judged = compare_shadow(_record(tmp_path, traffic), None, None, False, tmp_path / "v")
    assert judged.notes == [NO_HASH]
    assert next(r for r in judged.verdict.judgement.rules if r.metric == "lossless_fraction").status == "NOT_APPLICABLE"


def test_refusals(tmp_path: Path) -> None:
    recording = _recording(tmp_path / "a", _traffic(10, 4))
    open_folder = _folders(tmp_path / "a" / "shadow")[0]
    with pytest.raises(Untrusted, match=r"no summary\.json"):
        compare_shadow(open_folder, None, None, False, tmp_path / "v")
    assert compare_shadow(open_folder, None, None, True, tmp_path / "v").verdict.forced
    recording.close()
    folder = _record(tmp_path / "b", _traffic(10, 4))
    with pytest.raises(FieldError, match="never judged against itself"):
        compare_shadow(folder, "zlab", None, False, tmp_path / "v")
    with pytest.raises(FieldError, match=r"^candidate: the folder has no mirrored arm named 'nope' \(its arms: inhouse\)"):
        compare_shadow(folder, "nope", None, False, tmp_path / "v")
    requests = folder / "requests.jsonl"
    lines = requests.read_text().splitlines()
    requests.write_text("\n".join([*lines, lines[0]]) + "\n")
    with pytest.raises(Untrusted, match=r"requests\.jsonl holds 11 records, summary\.json counts 10"):
        compare_shadow(folder, None, None, False, tmp_path / "v")
    with pytest.raises(UserError, match="recorded 2 times"):
        compare_shadow(folder, None, None, True, tmp_path / "v")
    edited = _record(tmp_path / "c", _traffic(10, 4, cand_text="other"))  # lossy: FAIL as recorded
    requests = edited / "requests.jsonl"
    records = [json.loads(line) for line in requests.read_text().splitlines()]
    for record in records:
        if record["arm"] == "inhouse" and record["index"] == 2:
            record["temperature"] = 0.7  # would take request 2 out of losslessness
    requests.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(UserError, match=r"request 2: arm zlab records temperature 0\.0, arm inhouse 0\.7"):
        compare_shadow(edited, None, None, True, tmp_path / "v")
    reindexed = _record(tmp_path / "d", _traffic(10, 4))  # a candidate's requests moved off their pairs
    requests = reindexed / "requests.jsonl"
    records = [json.loads(line) for line in requests.read_text().splitlines()]
    for record in records:
        if record["arm"] == "inhouse" and record["index"] % 2:
            record["index"] += 1000
            record["spec_verify_ct"] = 1  # and its acceptance made better
    requests.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(Untrusted, match=r"arm inhouse: summary\.json's figures are not those of its records"):
        compare_shadow(reindexed, None, None, False, tmp_path / "v")


def test_a_shadow_verdict_edited_into_a_pass_is_not_promoted(tmp_path: Path) -> None:
    folder = _record(tmp_path / "a", _traffic(10, 4, cand_text="other"))  # lossy: FAIL
    judged = compare_shadow(folder, None, None, False, tmp_path / "v")
    assert judged.verdict.verdict == "FAIL"
    edited = tmp_path / "edited" / "verdict.json"
    edited.parent.mkdir()
    edited.write_text(judged.path.read_text().replace('"verdict": "FAIL"', '"verdict": "PASS"'))
    refused = CliRunner().invoke(promote, [str(edited), "--registry", str(tmp_path)], standalone_mode=False)
    assert "its runs give FAIL, not the PASS it says, judged again" in str(refused.exception)


def test_a_shadow_folder_is_judged_alone(tmp_path: Path) -> None:
    folder = _record(tmp_path / "a", _traffic(10, 4))
    other = _record(tmp_path / "b", _traffic(10, 4))
    refused = CliRunner().invoke(compare, [str(folder), str(other)], standalone_mode=False)
    assert str(refused.exception) == (f"{folder} is a shadow record folder: it holds both arms and is judged alone "
                                      "(dfserve compare DIR)")


def test_arms_whose_engines_differ_or_are_unknown_are_refused_unless_forced(
        tmp_path: Path, engines: dict[str, dict[str, object]]) -> None:
    engines["http://engine-b"]["model_path"] = "Qwen/Qwen3-4B"
    folder = _record(tmp_path / "a", _traffic(10, 4))
    with pytest.raises(Untrusted, match="server model_path: Qwen/Qwen3-8B vs Qwen/Qwen3-4B"):
        compare_shadow(folder, None, None, False, tmp_path / "v")
    forced = compare_shadow(folder, None, None, True, tmp_path / "v").verdict
    assert forced.forced and forced.mismatches == ["server model_path: Qwen/Qwen3-8B vs Qwen/Qwen3-4B"]
    del engines["http://engine-b"]
    with pytest.raises(Untrusted, match="arm inhouse: its /server_info was not recorded"):
        compare_shadow(_record(tmp_path / "b", _traffic(10, 4)), None, None, False, tmp_path / "v")


def test_an_arm_serving_the_primarys_drafter_is_judged_only_forced(tmp_path: Path) -> None:
    """The secondary named the candidate, or a mirror whose engine serves the primary's drafter: a PASS would be the
    baseline's drafter over itself."""
    traffic = _traffic(30, cand_verify=16, mirrors=("inhouse", "zlab2")) + [exchanged(rid, "zlab2", True)
                                                                           for rid in range(30)]
    folder = _record(tmp_path, traffic, secondary="zlab2")
    line = "both sides serve drafter 'z-lab/dflash': the candidate would be judged against the baseline's own drafter"
    with pytest.raises(Untrusted, match=re.escape(line)):
        compare_shadow(folder, "zlab2", None, False, tmp_path / "v")
    forced = compare_shadow(folder, "zlab2", None, True, tmp_path / "v").verdict
    assert forced.forced and forced.mismatches == [line]


def test_mirrors_cut_by_the_gateways_stop_leave_their_folder_judged_only_forced(tmp_path: Path) -> None:
    """The stop cuts the answers still under way, the slowest: judged on the rest, a slow candidate would look fast.
    A client that left is no such cut."""
    traffic = _traffic(20, cand_verify=4)
    left = [exchanged(20 + rid, arm, arm == "inhouse", error="client_disconnect") for rid in range(3)
            for arm in ("zlab", "inhouse")]
    kept = compare_shadow(_record(tmp_path / "left", traffic + left), None, None, False, tmp_path / "v").verdict
    assert not kept.forced
    cut = [e for rid in range(20, 23) for e in (exchanged(rid, "zlab", False),
                                                exchanged(rid, "inhouse", True, error="cancelled"))]
    folder = _record(tmp_path / "cut", traffic + cut)
    with pytest.raises(Untrusted, match="or cut short by the gateway's stop"):
        compare_shadow(folder, None, None, False, tmp_path / "v")
    forced = compare_shadow(folder, None, None, True, tmp_path / "v")
    assert forced.verdict.forced and any("(3 of zlab)" in note and "the gateway stopped" in note
                                         for note in forced.notes)


def test_shadow_config_needs_shadow_mode_and_a_mirrored_secondary() -> None:
    arms = {"a": {"weight": 1, "replicas": ["http://127.0.0.1:1"]}, "b": {"weight": 1, "replicas": ["http://127.0.0.1:2"]}}
    with pytest.raises(UserError, match="need mode: shadow"):
        load_config(None, {"routing.arms": arms, "shadow.dir": "/tmp/x"})
    with pytest.raises(UserError, match=r"shadow\.secondary"):
        load_config(None, {"routing.arms": arms, "routing.mode": "shadow", "routing.primary": "a",
                           "shadow.dir": "/tmp/x", "shadow.secondary": "a"})
    config = load_config(None, {"routing.arms": arms, "routing.mode": "shadow", "routing.primary": "a",
                                "shadow.dir": "/tmp/x", "shadow.secondary": "b", "capture.dir": "/tmp/c"})
    assert config.shadow is not None and config.shadow.secondary == "b" and config.capture is not None


def test_a_stream_of_deltas_is_read_whole_by_the_tester_and_left_unhashed_by_the_recorder() -> None:
    """With `--incremental-streaming-output` each native event holds only what is new: the tester, which reads
    every event, joins them; the gateway, which keeps only a stream's last events, cannot know the output, and
    leaves it unhashed rather than hash the last delta (losslessness is then not applicable, and says why)."""
    events = native_stream(64, incremental=True)
    relay, client = relayed(events, 100.0)
    exchange = replace(exchanged(3, "zlab", False, streamed=True, answer=relay.tail), pieces=relay.pieces)
    record = shadow_record(exchange, 100.0)
    sent = Sent("zlab", record.task_id, 3, False, None, 3.0, 3.0, 103.0, "native")
    tester = derive(100.0, Finished(sent, 200, client, None))
    assert tester.error_kind is None and tester.output_sha256 == hashlib.sha256((' é"\\x' * 64).encode()).hexdigest()
    assert record.error_kind is None and record.output_sha256 is None
    assert (record.chunk_times_s, record.chunk_tokens) == (tester.chunk_times_s, tester.chunk_tokens)
    assert shadow_record(replace(exchange, pieces=None), 100.0).output_sha256 is None  # the last event alone
    cumulative = relayed(native_stream(64), 100.0)[0]
    whole = shadow_record(replace(exchange, answer=cumulative.tail, pieces=cumulative.pieces), 100.0)
    assert whole.output_sha256 == tester.output_sha256


def test_greedy_streams_of_deltas_never_pass_losslessness_on_outputs_the_gateway_cannot_know(tmp_path: Path) -> None:
    """Both arms stream deltas with identical outputs: hashing each stream's last delta would call them identical
    (and different outputs ending alike too); the records have no hash, so the rule does not apply, and says why."""
    relay, _ = relayed(native_stream(64, incremental=True), 100.0)
    traffic = [replace(exchanged(rid, arm, mirror, streamed=True, answer=relay.tail), pieces=relay.pieces)
               for rid in range(30) for arm, mirror in (("zlab", False), ("inhouse", True))]
    judged = compare_shadow(_record(tmp_path, traffic), None, None, False, tmp_path / "v")
    notes = [note for note in judged.notes if "one read with the next" not in note]  # `relayed` reads some so
    assert notes == [NO_HASH] and "--incremental-streaming-output" in NO_HASH
    lossless = judged.verdict.judgement.lossless
    assert lossless is not None and (lossless.pairs, lossless.identical) == (0, 0)  # unknown outputs never match
    rule = next(r for r in judged.verdict.judgement.rules if r.metric == "lossless_fraction")
    assert rule.status == "NOT_APPLICABLE" and rule.detail == NOT_JUDGED
    page = (judged.path.parent / "report.html").read_text()  # the verdict's page says what the terminal says
    assert "live traffic mirrored by the gateway" in page and html.escape(NO_HASH) in page
    assert "No pair's outputs could be compared" in page


def test_a_folder_whose_records_were_edited_is_judged_only_forced(tmp_path: Path) -> None:
    """A lossy candidate made lossless by copying the primary's output hashes onto its records: no count or figure
    of summary.json changes, its seal of requests.jsonl does."""
    folder = _record(tmp_path, _traffic(12, 4, cand_text="other"))
    requests = folder / "requests.jsonl"
    records = [json.loads(line) for line in requests.read_text().splitlines()]
    primary = {r["index"]: r["output_sha256"] for r in records if r["arm"] == "zlab"}
    requests.write_text("".join(json.dumps({**r, "output_sha256": primary[r["index"]]}) + "\n" for r in records))
    with pytest.raises(Untrusted, match=r"requests\.jsonl is not as its writer left it"):
        compare_shadow(folder, None, None, False, tmp_path / "v")
    forced = compare_shadow(folder, None, None, True, tmp_path / "v").verdict
    assert forced.forced and any("not as its writer left it" in line for line in forced.incomplete)


def test_a_candidate_whose_records_are_the_primarys_is_never_judged_unforced(tmp_path: Path) -> None:
    """The primary's answers relabelled as the candidate's (every time to the microsecond): a drafter judged against
    itself would pass any gate at exactly 0%."""
    traffic = [replace(e, outcome=replace(e.outcome, ttft_s=0.01, e2e_s=0.1)) for e in _traffic(24, 4)]
    folder = _record(tmp_path, traffic)
    with pytest.raises(Untrusted, match="the records of inhouse are those of zlab, to the microsecond"):
        compare_shadow(folder, None, None, False, tmp_path / "v")
    forced = compare_shadow(folder, None, None, True, tmp_path / "v").verdict
    assert forced.forced and any("to the microsecond" in line for line in forced.incomplete)
    assert compare_shadow(_record(tmp_path / "apart", _traffic(24, 4)), None, None, False, tmp_path / "v").verdict


def test_a_folder_whose_config_was_edited_is_judged_only_forced(tmp_path: Path) -> None:
    """config.json names the folder's primary and secondary: an edit there would judge other arms than recorded."""
    folder = _record(tmp_path, _traffic(12, 4))
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"run_id"', ' "run_id"', 1))
    with pytest.raises(Untrusted, match=r"config\.json is not as its writer left it"):
        compare_shadow(folder, None, None, False, tmp_path / "v")
