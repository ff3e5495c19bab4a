"""dfserve.sglang on fixtures shaped like SGLang's own output (each fixture names its source file), and
round trips from the builders the simulator uses to the parsers every client uses."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from dfserve import sglang as proto
from dfserve.errors import ProtocolError
from dfserve.sglang import server
from tests import FIXTURES

SGLANG_FIXTURES = FIXTURES / "sglang"


def fixture_body(name: str) -> Any:
    data = json.loads((SGLANG_FIXTURES / name).read_text())
    assert data["source"].startswith("python/sglang/")
    return data["body"]


def sse_events(name: str, read_size: int | None = None) -> tuple[list[str], bool]:
    raw = (SGLANG_FIXTURES / name).read_bytes()
    assert raw.startswith(b": source: python/sglang/")
    decoder = proto.SSEDecoder()
    size = read_size or len(raw)
    events = [e for start in range(0, len(raw), size) for e in decoder.feed(raw[start : start + size])]
    return events, decoder.pending


@pytest.mark.parametrize("read_size", [None, 1, 7, 64])
def test_dflash_native_stream_gives_per_round_deltas_and_exact_acceptance(read_size: int | None) -> None:
    events, pending = sse_events("native_stream_dflash.sse", read_size)
    assert events[-1] == proto.DONE and not pending
    chunks = [proto.parse_native_event(e) for e in events[:-1]]
    assert all(isinstance(c, proto.NativeChunk) for c in chunks)
    metas = [c.meta for c in chunks if isinstance(c, proto.NativeChunk)]
    assert [m.completion_tokens for m in metas] == [1, 9, 17]
    assert all(m.spec is None and m.finish_reason is None for m in metas[:-1])
    final = metas[-1]
    assert final.finish_reason == proto.FinishReason(kind="stop", matched=151645)
    assert final.spec == proto.SpecStats(verify_ct=2, num_correct_drafts=15, num_proposed_drafts=30, accept_rate=0.5,
                                         correct_drafts_histogram=(0, 0, 0, 0, 0, 0, 0, 1, 1), accept_length=8.5)
    assert final.accept_length == 8.5 and final.e2e_latency_s == pytest.approx(0.4123) and not final.simulated


def test_a_stream_without_spec_fields_is_valid_with_unknown_acceptance() -> None:
    events, _ = sse_events("native_stream_no_spec.sse")
    final = proto.parse_native_event(events[-2])
    assert isinstance(final, proto.NativeChunk)
    assert final.meta.spec is None and final.meta.accept_length is None
    assert final.meta.finish_reason == proto.FinishReason(kind="length", length=3)


def test_a_truncated_stream_leaves_a_pending_event_and_no_done() -> None:
    events, pending = sse_events("native_stream_truncated.sse", 5)
    assert pending and proto.DONE not in events and len(events) == 2
    assert all(isinstance(proto.parse_native_event(e), proto.NativeChunk) for e in events)


def test_a_malformed_event_raises_protocol_error() -> None:
    events, _ = sse_events("native_stream_malformed.sse")
    assert isinstance(proto.parse_native_event(events[0]), proto.NativeChunk)
    with pytest.raises(ProtocolError, match="invalid JSON"):
        proto.parse_native_event(events[1])


def test_a_native_stream_refused_in_band_is_an_error_with_its_status() -> None:
    """SGLang 0.5.23 answers a streamed /generate over the context length with HTTP 200, an error event, [DONE]."""
    events, _ = sse_events("native_stream_error.sse")
    error = proto.parse_native_event(events[0])
    assert isinstance(error, proto.StreamError) and "context length" in error.message
    assert (error.code, error.kind, error.retryable) == (400, "invalid_request_error", False)
    raw = (SGLANG_FIXTURES / "native_stream_error.sse").read_bytes()
    assert proto.native_stream_error(raw) == error
    assert proto.native_stream_error((SGLANG_FIXTURES / "native_stream_dflash.sse").read_bytes()) is None


def test_a_native_abort_with_a_status_is_an_in_band_error() -> None:
    """An abort after the stream started is its last chunk: a finish reason with the status, not an error event."""
    events, _ = sse_events("native_stream_abort.sse")
    final = proto.parse_native_event(events[-2])
    assert isinstance(final, proto.NativeChunk) and final.meta.finish_reason is not None
    assert final.meta.finish_reason.error == proto.StreamError(
        "Retracted under decode memory pressure without a KV backup. Retry later.", code=503)
    assert proto.native_stream_error((SGLANG_FIXTURES / "native_stream_abort.sse").read_bytes()) is not None


def test_an_abort_through_abort_request_is_an_in_band_error_without_a_code() -> None:
    """`POST /abort_request` ends a request as if it had finished (HTTP 200, no status, no error event), but cut
    short: native, a final chunk whose finish reason is the abort; OpenAI, `finish_reason: "abort"`, then the closing
    chunks."""
    assert server.ABORTED.error == proto.StreamError("Aborted")
    meta = server.meta_info_body(rid="r", finish=server.ABORTED_WAITING, prompt_tokens=3, completion_tokens=0)
    native = server.sse_event(server.generate_response_body("", [], meta)) + proto.SSE_DONE
    assert native.count(b'"status_code":') == 1 and proto.native_stream_error(native) == proto.StreamError(
        "Abort in waiting queue")
    assert proto.native_stream_error(native.replace(b'"status_code":null,', b"")) is not None  # found by its type
    head = server.ResponseHead("r", 1, "m")
    for obj, final in (("chat.completion.chunk", server.chat_chunk_body(head, content=None, finish=server.ABORTED)),
                       ("text_completion", server.completion_chunk_body(head, text="", finish=server.ABORTED))):
        closing = server.stream_end_chunks(head, obj=obj, prompt_tokens=3, completion_tokens=5, spec=None,
                                           include_usage=True)
        end = proto.openai_stream_end(b"".join(map(server.sse_event, [final, *closing])) + proto.SSE_DONE)
        assert end.error == proto.StreamError("Aborted") and end.usage == proto.Usage(3, 5)


def test_openai_stream_ends_show_errors_spec_details_and_usage() -> None:
    error_end = proto.openai_stream_end((SGLANG_FIXTURES / "chat_stream_error.sse").read_bytes())
    assert error_end.error is not None and (error_end.error.code, error_end.error.kind) == (503, "SERVICE_UNAVAILABLE")
    assert error_end.usage == proto.Usage(prompt_tokens=12, completion_tokens=9)  # SGLang still sends usage after it
    spec_end = proto.openai_stream_end((SGLANG_FIXTURES / "chat_stream_spec_details.sse").read_bytes())
    assert spec_end.error is None and spec_end.usage == proto.Usage(prompt_tokens=12, completion_tokens=17)
    assert spec_end.spec is not None and spec_end.spec.verify_ct == 2 and spec_end.spec.accept_length == 8.5
    assert proto.spec_completion_tokens(spec_end.spec, None) == 17
    plain = proto.openai_stream_end((SGLANG_FIXTURES / "chat_stream_usage.sse").read_bytes())
    assert plain.spec is None and plain.error is None and plain.usage is not None


def test_whole_openai_answers_give_exact_acceptance_from_spec_details_and_strip_them() -> None:
    body = proto.json_bytes(fixture_body("chat_completion_spec_details.json"))
    result = proto.parse_openai_response(body)
    assert result.acceptance is not None and result.acceptance[0] == 17 and result.acceptance[1].verify_ct == 2
    stripped = json.loads(proto.strip_spec_details(body))
    assert "sglext" not in stripped and stripped["choices"] == fixture_body("chat_completion_spec_details.json")["choices"]
    assert proto.parse_openai_response(fixture_body("completion.json")).acceptance is None


def test_spec_details_of_other_tokens_than_the_usage_counts_give_no_acceptance() -> None:
    """A completion of two prompts (SGLang 0.5.23): 8 tokens each, but one spec details object, the first prompt's
    (7 rounds, 8/7), beside a usage of 16: read as exact, its accept length was 16/7."""
    body = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": i, "text": "x" * 8, "finish_reason": "length"} for i in range(2)],
            "usage": {"prompt_tokens": 10, "completion_tokens": 16, "total_tokens": 26},
            "sglext": {"spec_tokens_details": {"spec_verify_ct": 7, "spec_accept_length": 8 / 7}}}
    assert proto.parse_openai_response(json.dumps(body)).acceptance is None
    one = {**body, "choices": body["choices"][:1], "usage": {**body["usage"], "completion_tokens": 8}}
    acceptance = proto.parse_openai_response(json.dumps(one)).acceptance
    assert acceptance is not None and acceptance[0] == 8 and acceptance[1].verify_ct == 7
    spec = proto.SpecStats(verify_ct=7, num_correct_drafts=None, num_proposed_drafts=None, accept_rate=None,
                           correct_drafts_histogram=None, accept_length=8 / 7)
    assert proto.spec_completion_tokens(spec, proto.Usage(10, 16)) is None
    assert proto.spec_completion_tokens(spec, proto.Usage(10, 8)) == proto.spec_completion_tokens(spec, None) == 8


def test_old_spec_field_names_parse_like_new_ones() -> None:
    result = proto.parse_generate_response(fixture_body("native_generate_old_names.json"))[0]
    assert result.meta.spec is not None
    assert result.meta.spec.num_correct_drafts == 15 and result.meta.spec.num_proposed_drafts == 30
    assert result.meta.spec.correct_drafts_histogram is not None and sum(result.meta.spec.correct_drafts_histogram) == 2
    assert result.meta.finish_reason == proto.FinishReason(kind="stop", matched="\n\n")


def test_chat_with_return_meta_info_exposes_spec_fields() -> None:
    result = proto.parse_openai_response(fixture_body("chat_completion_meta_info.json"))
    assert result.meta is not None and result.meta.accept_length == 17 / 2
    assert result.usage == proto.Usage(prompt_tokens=12, completion_tokens=17)
    assert result.text.startswith("def add") and result.finish_reason == proto.FinishReason(kind="stop")


@pytest.mark.parametrize("read_size", [None, 3])
def test_streamed_chat_with_crlf_keepalives_and_usage(read_size: int | None) -> None:
    events, pending = sse_events("chat_stream_usage.sse", read_size)
    assert events[-1] == proto.DONE and not pending
    chunks = [proto.parse_openai_event(e) for e in events[:-1]]
    assert all(isinstance(c, proto.OpenAIChunk) for c in chunks)
    typed = [c for c in chunks if isinstance(c, proto.OpenAIChunk)]
    assert "".join(c.text for c in typed) == "def add(a, b):"
    assert [c.finish_reason for c in typed if c.finish_reason] == [proto.FinishReason(kind="stop")]
    assert typed[-1].usage == proto.Usage(prompt_tokens=12, completion_tokens=17)
    assert proto.estimated_accept_length(17, sum(1 for c in typed if c.text)) == 8.5


def test_tool_calls_are_generated_text_streamed_or_whole_without_their_ids() -> None:
    """A coding agent's turn is often only a tool call: its name and arguments are the output (two drafters that
    differ there are not lossless), and each of its chunks is one (TTFT, ITL, the estimate); SGLang's call id is
    made up per request, so it is no part of the output."""
    events, _ = sse_events("chat_stream_tool_calls.sse")
    chunks = [c for c in map(proto.parse_openai_event, events[:-1]) if isinstance(c, proto.OpenAIChunk)]
    assert [c.text for c in chunks] == ["", "run_tests", '{"path": "', 'tests/"}', "", ""]
    assert chunks[-2].finish_reason == proto.FinishReason(kind="tool_calls")
    raw = (SGLANG_FIXTURES / "chat_stream_tool_calls.sse").read_bytes()
    assert proto.CONTENT_CHUNKS.read(raw) == 3
    whole = proto.parse_openai_response(fixture_body("chat_completion_tool_calls.json"))
    assert whole.text == "".join(c.text for c in chunks) == 'run_tests{"path": "tests/"}'
    other_id = json.loads(json.dumps(fixture_body("chat_completion_tool_calls.json")))
    other_id["choices"][0]["message"]["tool_calls"][0]["id"] = "call_0000"
    assert proto.parse_openai_response(other_id).text == whole.text


def test_completion_errors_and_server_info() -> None:
    completion = proto.parse_openai_response(fixture_body("completion.json"))
    assert completion.text == " return a + b" and completion.meta is None
    assert "not supported with streaming" in proto.parse_error_message(json.dumps(fixture_body("error_openai.json")))
    assert proto.parse_error_message(json.dumps(fixture_body("error_native.json"))).startswith("max_new_tokens")
    assert proto.parse_error_message(json.dumps(fixture_body("error_contract.json"))).startswith("unknown field")
    assert proto.parse_error_message(b"<html>502 Bad Gateway</html>") == "<html>502 Bad Gateway</html>"
    info = proto.parse_server_info(fixture_body("server_info_dflash.json"))
    assert info.speculative_algorithm == "DFLASH" and info.max_running_requests == 48 and not info.simulated


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1, 2]", b'{"text": "x"}', b'{"meta_info": {"prompt_tokens": 1}}',
     b'{"meta_info": {"prompt_tokens": 1, "completion_tokens": "3"}}',
     b'{"meta_info": {"prompt_tokens": 1, "completion_tokens": 3, "spec_verify_ct": 1, '
     b'"spec_correct_drafts_histogram": "x"}}'],
)
def test_malformed_whole_responses_raise_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        proto.parse_generate_response(body)


@pytest.mark.parametrize("times", [["soon"], [1.5, True], [1.5, None], [[1.5]], {"0": 1.5}, 1.5,
                                   [1.5, math.nan], [math.inf], [10**400]])
def test_malformed_simulator_chunk_times_raise_protocol_error(times: Any) -> None:
    meta = {"prompt_tokens": 1, "completion_tokens": 1, proto.SIM_CHUNK_SENT_KEY: times}
    with pytest.raises(ProtocolError, match=proto.SIM_CHUNK_SENT_KEY):
        proto.parse_meta_info(meta)


@pytest.mark.parametrize("value", [math.nan, -math.inf, 10**400])
def test_a_number_no_record_can_hold_is_a_protocol_error(value: float) -> None:
    """Python's JSON reads NaN, Infinity and 1e400; a record written with one is read back as null, or not at all."""
    meta = {"prompt_tokens": 1, "completion_tokens": 1, "e2e_latency": value}
    with pytest.raises(ProtocolError, match=r"meta_info\.e2e_latency: expected a finite number"):
        proto.parse_meta_info(meta)


def test_simulator_chunk_times_are_read_as_floats() -> None:
    meta = {"prompt_tokens": 1, "completion_tokens": 1, proto.SIM_CHUNK_SENT_KEY: [1, 2.5], proto.SIM_CHUNK_DUE_KEY: []}
    parsed = proto.parse_meta_info(meta)
    assert parsed.sim_chunk_sent_unix_s == (1.0, 2.5) and type(parsed.sim_chunk_sent_unix_s[0]) is float
    assert parsed.sim_chunk_due_unix_s == ()


def test_acceptance_length_needs_a_verify_round() -> None:
    assert proto.accept_length(34, 4) == 8.5 and proto.accept_length(5, 0) is None


@pytest.mark.parametrize("data", ['{"text": ' + "[" * 5000 + "]" * 5000 + "}", '{"text": "\xff', '{"a": 1} x'])
def test_hostile_json_in_an_event_is_a_protocol_error(data: str) -> None:
    """Deep nesting, a cut string and trailing bytes are the server's fault, said as one: never a RecursionError."""
    with pytest.raises(ProtocolError, match="invalid JSON"):
        proto.parse_native_event(data)


def test_an_event_is_read_whenever_json_loads_reads_it() -> None:
    """The fast parser refuses a lone surrogate and nesting past 200 deep, which `json.loads` reads: so does dfserve."""
    lone = proto.parse_native_event('{"text": "\\ud800 hi", "meta_info": {"prompt_tokens": 1, "completion_tokens": 2}}')
    assert isinstance(lone, proto.NativeChunk) and lone.text == "\ud800 hi"
    deep = '{"text": "x", "nested": ' + "[" * 300 + "]" * 300 + ', "meta_info": {"prompt_tokens": 1, "completion_tokens": 2}}'
    assert isinstance(proto.parse_native_event(deep), proto.NativeChunk)
    raw = proto.parse_native_event('{"text": "\ud800", "meta_info": {"prompt_tokens": 1, "completion_tokens": 2}}')
    assert isinstance(raw, proto.NativeChunk) and raw.text == "\ud800"  # a str holding the surrogate itself
    with pytest.raises(ProtocolError, match="invalid JSON"):  # json.loads' own ValueError, over 4300 digits
        proto.parse_native_event('{"text": "x", "n": ' + "1" * 5000 + ', "meta_info": {}}')


@pytest.mark.parametrize(("events", "done"), [
    (b'data: {"a":1}\n\ndata: [DONE]\n\n', True),
    (b'data: {"a":1}\r\n\r\ndata:[DONE]\r\n\r\n', True),
    (b"data: [DONE]\n\n: keep-alive\n\n", True),  # a comment after it is no event
    (b": c\ndata: [DONE]\n\n", True),
    (b'data: {"a":1}\n\n', False),
    (b"", False),
    (b": only a comment\n\n", False),
    (b'data: [DONE]\n\ndata: {"a":1}\n\n', False),  # an event after it: the stream did not end there
    (b"data: x\ndata: [DONE]\n\n", False),  # one event whose data is "x\n[DONE]"
    (b"event: end\nid: 7\ndata: [DONE]\n\n", True),  # other fields aside, as a client reads it
    (b"data: [DONE]\n\nid: 8\n\n", True),
])
def test_a_stream_ends_well_only_with_done_as_its_last_event(events: bytes, done: bool) -> None:
    assert proto.ends_with_done(events) is done


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"error": {"code": ' + b"9" * 5000 + b"}}"])
def test_an_error_body_python_cannot_parse_is_its_own_text(body: bytes) -> None:
    """A hostile server's error body, nested too deep or with an integer over 4300 digits: shown, not raised."""
    assert proto.parse_error_message(body) == body.decode()[:500]


def test_a_servers_document_is_kept_as_utf8_can_hold_it() -> None:
    """/server_info is recorded verbatim in a run's config.json: a lone surrogate JSON escaped in it, key or value,
    becomes the escape's text; text UTF-8 holds is kept as it came."""
    document = json.loads(r'{"model_path": "m\ud800", "\udc00": ["é\ud83d\ude00", 1, null], "ok": "ü"}')
    kept = proto.printable_json(document)
    assert kept == {"model_path": "m\\ud800", "\\udc00": ["é\U0001f600", 1, None], "ok": "ü"}
    assert json.dumps(kept, ensure_ascii=False).encode()  # writable as UTF-8
    assert proto.printable("plain") == "plain"


@pytest.mark.parametrize("read_size", [1, 2, 4, 1000])
def test_a_byte_order_mark_that_starts_a_stream_is_no_part_of_its_first_event(read_size: int) -> None:
    """The SSE standard drops one at the stream's start: kept, it would make the first line a field of another name
    and lose the first event (and the stream's first token with it)."""
    body = b"\xef\xbb\xbfdata: {\"a\": 1}\n\ndata: \xef\xbb\xbfx\n\ndata: [DONE]\n\n"
    decoder = proto.SSEDecoder()
    events = [event for at in range(0, len(body), read_size) for event in decoder.feed(body[at:at + read_size])]
    assert events == ['{"a": 1}', "\ufeffx", proto.DONE] and not decoder.pending


def test_spec_details_of_every_choice_are_pooled_as_the_usage_beside_them_counts_every_choices_tokens() -> None:
    """With n > 1 SGLang sends one spec details object per choice and a usage that adds up all choices: reading
    the first choice's rounds against every choice's tokens made the acceptance about n times too high."""
    def choice(verify_ct: int, correct: int, accept_length: float, histogram: list[int]) -> dict[str, Any]:
        return {"spec_accept_rate": correct / (4 * verify_ct), "spec_accept_length": accept_length,
                "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": 4 * verify_ct,
                "spec_verify_ct": verify_ct, "spec_correct_drafts_histogram": histogram}
    body = {"id": "c", "object": "chat.completion", "choices": [
        {"index": i, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"} for i in (0, 1)],
        "usage": {"prompt_tokens": 3, "completion_tokens": 40, "total_tokens": 43},
        "sglext": {"spec_tokens_details": [choice(4, 16, 5.0, [0, 4]), choice(6, 14, 10 / 3, [2, 3, 1])]}}
    result = proto.parse_openai_response(json.dumps(body))
    assert result.acceptance is not None
    tokens, spec = result.acceptance
    assert (tokens, spec.verify_ct) == (40, 10) and proto.accept_length(tokens, spec.verify_ct) == 4.0
    assert spec.accept_length == pytest.approx(4.0) and (spec.num_correct_drafts, spec.num_proposed_drafts) == (30, 40)
    assert spec.accept_rate == pytest.approx(0.75) and spec.correct_drafts_histogram == (2, 7, 1)
    one = proto.parse_sglext_spec({"spec_tokens_details": choice(4, 16, 5.0, [0, 4])})
    assert one is not None and (one.verify_ct, one.accept_length) == (4, 5.0)
    with pytest.raises(ProtocolError, match=r"sglext.spec_tokens_details.1: expected an object"):
        proto.parse_sglext_spec({"spec_tokens_details": [choice(4, 16, 5.0, [0, 4]), 7]})


def test_every_choices_meta_info_counts_toward_a_whole_answers_acceptance() -> None:
    """With n > 1 and return_meta_info each choice carries its own meta_info: the first alone undercounted by n."""
    def choice(index: int, tokens: int, verify_ct: int) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length",
                "meta_info": {"id": "r", "finish_reason": {"type": "length", "length": tokens}, "prompt_tokens": 3,
                              "completion_tokens": tokens, "spec_verify_ct": verify_ct,
                              "spec_accept_length": tokens / verify_ct}}
    body = {"id": "c", "object": "chat.completion", "choices": [choice(0, 24, 17), choice(1, 24, 7)],
            "usage": {"prompt_tokens": 3, "completion_tokens": 48, "total_tokens": 51}}
    result = proto.parse_openai_response(json.dumps(body))
    assert result.acceptance is not None
    tokens, spec = result.acceptance
    assert (tokens, spec.verify_ct) == (48, 24) and result.meta is not None and result.meta.completion_tokens == 24
    one = proto.parse_openai_response(json.dumps({**body, "choices": [choice(0, 24, 17)]})).acceptance
    assert one is not None and (one[0], one[1].verify_ct) == (24, 17)
