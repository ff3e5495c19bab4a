"""Records derived cheaply (SGLang's framing split in one pass, content chunks read through `ChunkTemplate`) are the
records that decoding every event whole gives, field by field, on SGLang-shaped streams read in any pieces."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

import pytest

from dfserve import sglang
from dfserve.loadtest.client import Finished, Sent, derive, ended
from dfserve.loadtest.records import impossible
from dfserve.loadtest.routes import ROUTE_FOR
from dfserve.loadtest.stream import StreamRead
from dfserve.sglang import server as engine
from tests import FIXTURES

HEAD = engine.ResponseHead("5f1d2c0a9b8e4f7aa1b2c3d4e5f60718", 1764460000, "Qwen/Qwen3.6-27B")
SPEC = sglang.SpecStats(verify_ct=3, num_correct_drafts=12, num_proposed_drafts=45, accept_rate=12 / 45,
                        correct_drafts_histogram=(0, 0, 1, 1, 1))
TRICKY = ['say "hi"', '"content":"x"', '"finish_reason":"stop"}', '\\"error\\":', 'é—✓ 🙂', "a\nb\tc\\", '"}]}\n\n']


def chat(text: str | None, finish: bool | str = False, first: bool = False, head: engine.ResponseHead = HEAD) -> bytes:
    reason = sglang.FinishReason(kind=finish if isinstance(finish, str) else "stop") if finish else None
    return engine.sse_event(engine.chat_chunk_body(head, content=text, finish=reason, first=first))


def chat_end(tokens: int, spec: bool = True) -> bytes:
    """Usage and spec details: a verify round for each token at most."""
    chunks = engine.stream_end_chunks(HEAD, obj="chat.completion.chunk", prompt_tokens=4, completion_tokens=tokens,
                                      spec=replace(SPEC, verify_ct=min(SPEC.verify_ct, tokens)) if spec else None,
                                      include_usage=True)
    return b"".join(engine.sse_event(chunk) for chunk in chunks) + sglang.SSE_DONE


def native(text: str, tokens: int, final: bool = False) -> bytes:
    finish = sglang.FinishReason(kind="length", length=tokens) if final else None
    meta = engine.meta_info_body(rid="r", finish=finish, prompt_tokens=4, completion_tokens=tokens,
                                 e2e_latency_s=0.5 if final else None, spec=SPEC if final else None)
    return engine.sse_event(engine.generate_response_body(text, list(range(tokens)), meta))


def native_of(index: int, text: str, tokens: int, final: bool = False) -> bytes:
    """An event of output `index` of several (n > 1): SGLang adds its index to the event."""
    return native(text, tokens, final).replace(b'data: {', b'data: {"index":%d,' % index, 1)


def spaced(event: bytes) -> bytes:
    """An event as a server that writes JSON with Python's default separators sends it (`"content": "x"`)."""
    return b"data: " + json.dumps(json.loads(event[len(b"data: "):])).encode() + b"\n\n"


def thinking(text: str) -> bytes:
    """A reasoning model's chunk of its thinking (SGLang's --reasoning-parser): `reasoning_content`, no content."""
    quoted = json.dumps(text).encode()
    return chat(text).replace(b'"reasoning_content":null,"content":' + quoted,
                              b'"reasoning_content":' + quoted + b',"content":null')


def second(text: str | None, finish: bool = False, first: bool = False) -> bytes:
    """A chunk of the second choice (n = 2): SGLang sends each choice's chunks as events of their own."""
    return chat(text, finish=finish, first=first).replace(b'"index":0', b'"index":1')


ERROR = engine.openai_error_event("retracted", "SERVICE_UNAVAILABLE", 503)
SIM_TIMES = sglang.sim_times_comment(sglang.SimStreamTimes((1.0, 2.0), (0.5, 1.5), 0.01))
STREAMS: dict[str, tuple[sglang.Api, bytes]] = {
    "chat": ("chat", chat("", first=True) + b"".join(chat(f" tok{i}") for i in range(40))
             + chat(None, finish=True) + chat_end(41)),
    "chat escapes and key names in content": ("chat", chat("", first=True) + b"".join(map(chat, TRICKY))
                                              + chat("!", finish=True) + chat_end(8, spec=False)),
    "chat error in band, then usage": ("chat", chat("", first=True) + chat("a") + chat("b") + ERROR + chat_end(3)),
    "chat cut before [DONE]": ("chat", chat("", first=True) + chat("a") + chat("b")[:-1]),
    "chat with empty and null content": ("chat", chat("", first=True) + chat("a") + chat("") + chat(None)
                                         + chat("b") + chat("c", finish=True) + chat_end(3)),
    "chat whose finish reason changes": ("chat", chat("a", finish=True) + chat(None, finish="length")
                                         + chat("b", finish=True) + chat_end(2)),
    "chat whose id changes": ("chat", chat("a") + chat("b", head=engine.ResponseHead("other", 1, "m")) + chat("c")
                              + chat(None, finish=True) + chat_end(3)),
    "chat with a comment, as the simulator ends it": ("chat", b": ping\n\n" + chat("a") + chat("b")
                                                      + chat(None, finish=True) + chat_end(2)[:-14] + SIM_TIMES
                                                      + sglang.SSE_DONE),
    "chat in CRLF framing": ("chat", (chat("a") + chat("b") + chat(None, finish=True) + chat_end(2))
                             .replace(b"\n", b"\r\n")),
    "chat with multi-line data": ("chat", chat("a") + b'data: {"choices":[{"index":0,\ndata: "delta":{"content":"b"}}]}'
                                  b"\n\n" + chat(None, finish=True) + chat_end(2)),
    "chat without a finish reason": ("chat", chat("a") + chat("b") + chat_end(2)),
    "chat with invalid JSON": ("chat", chat("a") + b'data: {"choices":[{"delta":{"content":"b"}}]\n\n' + chat_end(2)),
    "chat with a bad escape in a fitting chunk": ("chat", chat("a") + chat("b").replace(b'"b"', b'"\\q"')
                                                  + chat(None, finish=True) + chat_end(2)),
    "chat with a raw control character in a fitting chunk": ("chat", chat("a") + chat("b").replace(b'"b"', b'"b\tc"')
                                                             + chat(None, finish=True) + chat_end(2)),
    "chat with a short unicode escape in a fitting chunk": ("chat", chat("a") + chat("b").replace(b'"b"', b'"\\u12"')
                                                            + chat(None, finish=True) + chat_end(2)),
    "chat with escaped surrogates, paired and alone": ("chat", chat("a") + chat("b").replace(b'"b"', b'"\\ud83d\\ude00"')
                                                       + chat("c").replace(b'"c"', b'"\\ud83d"')
                                                       + chat("d").replace(b'"d"', b'"\\ude00x"')
                                                       + chat(None, finish=True) + chat_end(4)),
    "chat with invalid UTF-8 in content": ("chat", chat("a") + chat("b").replace(b'"b"', b'"b\xff\xc3"')
                                           + chat("\u00e9") + chat(None, finish=True) + chat_end(3)),
    "chat with a quote that ends content early": ("chat", chat("a") + chat("b").replace(b'"b"', b'"b","x":"y"')
                                                  + chat(None, finish=True) + chat_end(2)),
    "chat with a field after data": ("chat", chat("a") + b"event: x\n\n" + chat("b") + chat(None, finish=True)
                                     + chat_end(2)),
    "chat with spaces after colons and commas": ("chat", b"".join(spaced(chat(t)) for t in ("a", '"b": "c"', "d"))
                                                 + spaced(chat(None, finish=True)) + chat_end(3)),
    "chat with data without its space": ("chat", chat("a") + chat("b").replace(b"data: ", b"data:")
                                         + chat(None, finish=True) + chat_end(2)),
    "chat with an extra blank line": ("chat", chat("a") + b"\n" + chat("b") + chat(None, finish=True) + chat_end(2)),
    "chat of a reasoning model": ("chat", chat("", first=True) + b"".join(thinking(f"t{i} ") for i in range(5))
                                  + chat("a") + chat("b", finish=True) + chat_end(7)),
    "chat of two choices interleaved": ("chat", chat("", first=True) + second("", first=True) + chat("a") + chat("b")
                                        + second("x") + chat("c") + second("y") + second("z") + chat(None, finish=True)
                                        + second(None, finish=True) + chat_end(6)),
    "native of two outputs at their own paces": ("native", native_of(0, "a", 1) + native_of(1, "x", 2)
                                                 + native_of(1, "xy", 5) + native_of(0, "ab", 3)
                                                 + native_of(1, "xyz", 7, final=True) + native_of(0, "abc", 7, final=True)
                                                 + sglang.SSE_DONE),
    "chat with more verify rounds than tokens": ("chat", chat("a") + chat("b", finish=True)
                                                 + chat_end(3).replace(b'"completion_tokens":3', b'"completion_tokens":2')),
    "chat whose choices are not a list": ("chat", chat("a") + chat("b").replace(b'"choices":[', b'"choices":5,"x":[')
                                          + chat(None, finish=True) + chat_end(2)),
    "chat with a negative token count": ("chat", chat("a") + chat("b", finish=True)
                                         + chat_end(2).replace(b'"completion_tokens":2', b'"completion_tokens":-2')),
    "native with a count past any context": ("native", native("a", 1) + native("ab", 3).replace(b'"completion_tokens":3',
                                            b'"completion_tokens":30000000') + sglang.SSE_DONE),
    "native": ("native", native("a", 1) + native("ab\u00e9", 3) + native('ab\u00e9"q"', 7, final=True)
               + sglang.SSE_DONE),
    "chat with content after [DONE]": ("chat", chat("a") + chat("b", finish=True) + chat_end(2) + chat("c")
                                       + chat("d")),
    "chat with [DONE] twice": ("chat", chat("a") + chat("b", finish=True) + chat_end(2) + sglang.SSE_DONE),
    "native with an event after [DONE]": ("native", native("a", 1) + native("ab", 3, final=True) + sglang.SSE_DONE
                                          + native("abc", 4, final=True)),
}
FIXTURE_STREAMS: dict[str, tuple[sglang.Api, bytes]] = {path.name: ("chat" if path.name.startswith("chat") else "native", path.read_bytes())
                   for path in sorted((FIXTURES / "sglang").glob("*.sse"))}


def cuts(body: bytes, how: str) -> list[bytes]:
    """The body as a reader might get it: one event a read, several merged, or split anywhere (UTF-8 included)."""
    if how == "events":
        events = body.split(b"\n\n")
        return [event + b"\n\n" for event in events[:-1]] + ([events[-1]] if events[-1] else [])
    if how == "whole":
        return [body]
    size = int(how)
    return [body[at : at + size] for at in range(0, len(body), size)]


def finished(pieces: list[bytes], api: sglang.Api = "chat") -> Finished:
    stamped = [(10.0 + 0.013 * n, piece) for n, piece in enumerate(pieces)]
    return Finished(Sent("a", "t", 0, False, None, 0.1, 0.1, 11.0, api), 200, stamped, None)


def both_ways(api: sglang.Api, pieces: list[bytes]) -> tuple[dict[str, Any], dict[str, Any]]:
    done = finished(pieces, api)
    return (derive(10.0, done).model_dump(), derive(10.0, done, decode_all=True).model_dump())


@pytest.mark.parametrize("how", ["events", "whole", "1", "3", "7", "100", "1000"])
@pytest.mark.parametrize("name", [*STREAMS, *FIXTURE_STREAMS])
def test_records_are_those_of_decoding_every_event(name: str, how: str) -> None:
    api, body = {**STREAMS, **FIXTURE_STREAMS}[name]
    cheap, whole = both_ways(api, cuts(body, how))
    assert {k: v for k, v in cheap.items() if v != whole[k]} == {}


def test_the_cases_cover_what_the_records_must_show() -> None:
    records = {name: both_ways(api, cuts(body, "7"))[1] for name, (api, body) in STREAMS.items()}
    assert records["chat"]["acceptance"] == "exact" and len(records["chat"]["chunk_times_s"]) == 40
    assert records["chat escapes and key names in content"]["error_kind"] is None
    assert len(records["chat escapes and key names in content"]["chunk_times_s"]) == len(TRICKY) + 1
    assert records["chat error in band, then usage"]["error_kind"] == "stream_error"
    assert records["chat cut before [DONE]"]["error_kind"] == "disconnect"
    assert records["chat with invalid JSON"]["error_kind"] == "protocol"
    assert records["chat with a bad escape in a fitting chunk"]["error_kind"] == "protocol"
    assert records["chat without a finish reason"]["error_kind"] == "protocol"
    assert records["chat whose finish reason changes"]["finish_reason"] == "stop"
    thought = records["chat of a reasoning model"]
    assert thought["error_kind"] is None and len(thought["chunk_times_s"]) == 7  # the thinking's chunks are tokens
    assert thought["output_sha256"] == hashlib.sha256("".join([*(f"t{i} " for i in range(5)), "ab"]).encode()).hexdigest()
    for hostile in ("chat with more verify rounds than tokens", "chat whose choices are not a list",
                    "chat with a negative token count", "native with a count past any context",
                    "chat with content after [DONE]", "chat with [DONE] twice", "native with an event after [DONE]"):
        assert records[hostile]["error_kind"] == "protocol" and records[hostile]["acceptance"] == "unknown", hostile
    assert all(r["error_kind"] is None for name, r in records.items() if name in (
        "chat", "chat with a comment, as the simulator ends it", "chat in CRLF framing", "native"))
    escaped = both_ways("chat", cuts(STREAMS["chat escapes and key names in content"][1], "events"))[1]
    assert escaped["output_sha256"] == hashlib.sha256(("".join(TRICKY) + "!").encode()).hexdigest()


def test_only_the_chunks_that_do_not_fit_the_template_are_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[str] = []
    parse = sglang.parse_openai_event

    def counted(data: str) -> sglang.OpenAIChunk | sglang.StreamError:
        decoded.append(data)
        return parse(data)

    monkeypatch.setattr(sglang, "parse_openai_event", counted)
    spaced_stream = derive(10.0, finished(cuts(STREAMS["chat with spaces after colons and commas"][1], "events")))
    assert spaced_stream.ok and len(decoded) == 4  # the first content chunk, then its end: not `"b": "c"`'s
    decoded.clear()
    record = derive(10.0, finished(cuts(STREAMS["chat"][1], "events")))
    assert record.ok and len(record.chunk_times_s) == 40
    assert [json.loads(data)["choices"] for data in decoded[:2]] == [
        [{"index": 0, "delta": {"reasoning_content": None, "role": "assistant", "content": ""}, "logprobs": None,
          "finish_reason": None, "matched_stop": None}],
        [{"index": 0, "delta": {"reasoning_content": None, "content": " tok0"}, "logprobs": None,
          "finish_reason": None, "matched_stop": None}]]
    assert len(decoded) == 5  # then only the finish reason, sglext and usage


@pytest.mark.parametrize("how", ["events", "whole", "1", "5", "64"])
def test_plain_framing_gives_the_decoders_events_and_the_reads_that_completed_them(how: str) -> None:
    body = STREAMS["chat with a comment, as the simulator ends it"][1] + b"data: {\"incomplete"
    pieces = cuts(body, how)
    framed = sglang.plain_events(pieces)
    assert framed is not None
    decoder = sglang.SSEDecoder()
    expected = [(n, event) for n, piece in enumerate(pieces) for event in decoder.feed(piece)]
    assert list(zip(framed[1], framed[0], strict=True)) == expected
    assert json.loads(framed[0][0])["choices"][0]["delta"]["content"] == "a"


@pytest.mark.parametrize("body", [b"data: a\r\n\r\n", b"data: a\ndata: b\n\n", b"data: a\n\n\ndata: b\n\n",
                                  b"event: x\ndata: a\n\n", b"data:a\n\n", b"id: 1\n\n"])
def test_other_framing_is_left_to_the_decoder(body: bytes) -> None:
    assert sglang.plain_events([body]) is None


def test_more_verify_rounds_than_tokens_fail_only_where_the_tokens_were_counted() -> None:
    """Spec details without a usage chunk (or an accept length to count tokens from) say nothing of the tokens."""
    def read(**counts: object) -> str | None:
        stream = ended(StreamRead(done=True, finish_reason="stop", verify_ct=3, **counts))  # type: ignore[arg-type]
        return stream.failure[0] if stream.failure else None

    assert read(completion_tokens=0) is None
    assert read(completion_tokens=2) == "protocol"
    assert read(completion_tokens=0, counted=True) == "protocol"
    assert read(completion_tokens=3) is None


def test_a_native_answer_of_no_tokens_and_verify_rounds_is_impossible() -> None:
    """Every native event counts the tokens so far: 0 of them after 3 verify rounds is a count, not its absence."""
    meta = engine.meta_info_body(rid="r", finish=sglang.FinishReason(kind="stop"), prompt_tokens=4,
                                 completion_tokens=0, spec=SPEC)
    body = engine.sse_event(engine.generate_response_body("", [], meta)) + sglang.SSE_DONE
    record = derive(10.0, finished([body], "native"))
    assert record.error_kind == "protocol" and "spec_verify_ct 3 is more than completion_tokens 0" in (
        record.error_message or "")


def test_a_stream_whose_spec_details_are_of_other_tokens_than_its_usage_has_no_acceptance() -> None:
    """A streamed completion of a batch of prompts: SGLang's one spec details object is the first prompt's."""
    body = chat("a") + chat("b", finish=True) + chat_end(3)
    exact = both_ways("chat", cuts(body, "events"))[1]
    assert exact["acceptance"] == "exact" and exact["spec_verify_ct"] == 3
    other = both_ways("chat", cuts(body.replace(b'"completion_tokens":3', b'"completion_tokens":6'), "events"))[1]
    assert other["error_kind"] is None and other["completion_tokens"] == 6
    assert other["spec_verify_ct"] is None and other["acceptance"] != "exact"


def test_an_openai_stream_without_usage_has_no_token_count() -> None:
    """A server that leaves out the usage the tester asked for has not said it generated 0 tokens."""
    record = derive(10.0, finished(cuts(chat("", first=True) + chat("a") + chat("b", finish=True) + sglang.SSE_DONE,
                                        "events")))
    assert record.ok and len(record.chunk_times_s) == 2
    assert record.completion_tokens is None and record.acceptance == "unknown"
    counted = derive(10.0, finished(cuts(STREAMS["chat"][1], "events")))
    assert counted.completion_tokens == 41


LONE = rb"busy \ud800 now"
"""A server's words holding JSON's escape of half a surrogate pair: valid JSON, which no UTF-8 document can hold."""


@pytest.mark.parametrize("where", ["error event", "finish reason", "error status"])
def test_a_lone_surrogate_in_a_servers_words_is_recorded_escaped(where: str) -> None:
    """A record keeps a server's error message and finish reason: one lone surrogate in them must not stop the
    run's record writer, which writes each record as UTF-8 JSON."""
    status, body = 200, rb'data: {"error": {"message": "' + LONE + rb'", "code": 503}}' + b"\n\n" + sglang.SSE_DONE
    if where == "finish reason":
        body = native("a", 1, final=True).replace(b'"type":"length"', b'"type":"' + LONE + b'"') + sglang.SSE_DONE
        assert LONE in body
    elif where == "error status":
        status, body = 503, b'{"error": {"message": "' + LONE + b'"}}'
    done = finished([body], "native")
    record = derive(10.0, Finished(done.sent, status, done.pieces, None))
    written = record.model_dump_json()
    assert rb"busy \\ud800 now" in written.encode()  # the escape as text: a backslash, then u, d, 8, 0, 0


def test_an_answer_counting_more_tokens_than_the_request_allows_is_a_protocol_error() -> None:
    """SGLang cuts each output at its max new tokens; a count past it would make every figure of the request
    nonsense (an accept length of millions, one per-token latency sample per claimed token)."""
    body = native("a", 1) + native("ab", 3) + native("abc", 4_000_000, final=True) + sglang.SSE_DONE
    done = finished(cuts(body, "events"), "native")
    record = derive(10.0, Finished(replace(done.sent, output_budget=64), 200, done.pieces, None))
    assert record.error_kind == "protocol" and record.acceptance == "unknown"
    assert record.error_message == "completion_tokens 4000000 is more than the request's 64 new tokens at most"
    within = native("a", 1) + native("abc", 64, final=True) + sglang.SSE_DONE
    done = finished(cuts(within, "events"), "native")
    assert derive(10.0, Finished(replace(done.sent, output_budget=64), 200, done.pieces, None)).ok


@pytest.mark.parametrize(("api", "body", "budget"), [
    ("native", {"text": "p", "sampling_params": {"max_new_tokens": 64}}, 64),
    ("native", {"text": "p", "sampling_params": {"max_new_tokens": 64, "n": 3}}, 192),
    ("native", {"text": "p"}, None),
    ("chat", {"messages": [], "max_tokens": 32, "n": 2}, 64),
    ("chat", {"messages": [], "max_completion_tokens": 16}, 16),
    ("completions", {"prompt": "p", "max_tokens": "32"}, None),
    ("chat", {"messages": [], "max_tokens": True}, None),
])
def test_an_answers_token_budget_is_its_requests(api: sglang.Api, body: dict[str, Any], budget: int | None) -> None:
    assert ROUTE_FOR[api].output_budget(body) == budget


def test_records_no_recorder_writes_are_named() -> None:
    done = finished(cuts(STREAMS["native"][1], "events"), "native")
    good = derive(10.0, done)
    assert impossible(good) is None
    assert impossible(good.model_copy(update={"chunk_times_s": [1.0, float("inf")]})) == "a time that is not a finite number"
    assert impossible(good.model_copy(update={"sent_s": float("nan")})) == "a time that is not a finite number"
    assert impossible(good.model_copy(update={"chunk_tokens": [1, -1]})) == "a count below 0"
    assert "more than completion_tokens" in (impossible(good.model_copy(update={"spec_verify_ct": 99})) or "")
    assert impossible(good.model_copy(update={"server_e2e_latency_s": float("nan")})) is None  # the server's word


def test_an_answer_of_two_choices_is_each_choices_output_in_index_order_however_they_interleave() -> None:
    """SGLang interleaves the choices' events as each is generated: read in arrival order, the same outputs would
    hash differently from one server's timing to another's, and greedy pairs fail losslessness."""
    def text(body: bytes) -> str:
        stream = StreamRead()
        ROUTE_FOR["chat"].read(stream, [e[6:].decode() for e in body.split(b"\n\n") if e.startswith(b"data: ")],
                               [0.0] * body.count(b"\n\n"), False)
        return stream.text
    one = chat("a") + second("x") + chat("b") + chat("c") + second("y") + chat_end(5)
    other = second("x") + second("y") + chat("a") + chat("b") + chat("c") + chat_end(5)
    assert text(one) == text(other) == "abc\x00xy"
    assert text(chat("a") + chat("b") + chat_end(2)) == "ab"
    whole = {"choices": [{"index": 1, "message": {"content": "xy"}}, {"index": 0, "message": {"content": "abc"}}]}
    assert sglang.parse_openai_response(json.dumps(whole)).text == "abc\x00xy"


def test_a_native_answer_of_two_outputs_counts_both_each_at_its_own_pace() -> None:
    """SGLang interleaves the outputs' events, each with its own running total: read as one total, the second
    output's lower count was 'went backwards', a protocol error on an answer SGLang completed."""
    events = (native_of(0, "a", 1) + native_of(1, "x", 2) + native_of(1, "xy", 5) + native_of(0, "ab", 3)
              + native_of(1, "xyz", 7, final=True) + native_of(0, "abc", 7, final=True) + sglang.SSE_DONE)
    stream = StreamRead()
    datas = [e[6:].decode() for e in events.split(b"\n\n") if e.startswith(b"data: ")]
    ROUTE_FOR["native"].read(stream, datas, [0.1 * i for i in range(len(datas))], False)
    assert ended(stream).failure is None
    assert (stream.completion_tokens, stream.chunk_tokens, stream.verify_ct) == (14, [1, 2, 3, 2, 2, 4], 6)
    assert stream.text == "abc\x00xyz"


@pytest.mark.parametrize("api", ["native", "chat"])
def test_several_outputs_finish_as_the_first_output_did_whichever_ends_last(api: sglang.Api) -> None:
    if api == "native":
        first = native_of(0, "ab", 2, final=True).replace(b'"type":"length"', b'"type":"stop"')
        other = native_of(1, "xy", 2, final=True)
        assert b'"type":"stop"' in first and b'"type":"length"' in other
    else:
        first, other = chat("a", finish="stop"), second("x").replace(b'"finish_reason":null', b'"finish_reason":"length"')
        assert b'"finish_reason":"length"' in other
    reasons = set()
    for events in (first + other, other + first):
        stream = StreamRead()
        datas = [e[6:].decode() for e in (events + sglang.SSE_DONE).split(b"\n\n") if e.startswith(b"data: ")]
        ROUTE_FOR[api].read(stream, datas, [0.1 * i for i in range(len(datas))], False)
        reasons.add(stream.finish_reason)
    assert reasons == {"stop"}
