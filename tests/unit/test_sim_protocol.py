"""The engine side of SGLang's protocol (`dfserve.sglang.server`): its builders round-trip through the
parsers every client uses (`dfserve.sglang`), and it refuses bad requests as SGLang does."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dfserve import sglang as proto
from dfserve.sglang import server as engine

# --- builders (engine side) round-trip through the parsers (client side) ------------------------------------


def test_meta_info_round_trip_with_spec_and_simulator_keys() -> None:
    spec = proto.SpecStats(verify_ct=4, num_correct_drafts=30, num_proposed_drafts=60, accept_rate=0.5,
                           correct_drafts_histogram=(0,) * 7 + (2, 2), accept_length=34 / 4)
    meta = engine.meta_info_body(rid="r", finish=proto.FinishReason(kind="length", length=34), prompt_tokens=3,
                                completion_tokens=34, queue_time_s=0.25, e2e_latency_s=1.5, spec=spec, simulated=True)
    meta[proto.SIM_CHUNK_SENT_KEY] = [1.0, 2.0]
    meta[proto.SIM_CHUNK_DUE_KEY] = [0.5, 1.5]
    parsed = proto.parse_meta_info(json.loads(proto.json_bytes(meta)))
    assert parsed.spec == spec and parsed.accept_length == 34 / 4 and parsed.simulated
    assert parsed.finish_reason == proto.FinishReason(kind="length", length=34)
    assert parsed.queue_time_s == 0.25 and parsed.e2e_latency_s == 1.5
    assert parsed.sim_chunk_sent_unix_s == (1.0, 2.0) and parsed.sim_chunk_due_unix_s == (0.5, 1.5)
    assert meta["spec_accept_length"] == 8.5 and "spec_accepted_drafts" not in meta  # 0.5.23 sends new names only
    assert list(meta)[:8] == ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
                              "queue_time", "reasoning_tokens", "completion_tokens"]
    running = proto.parse_meta_info(engine.meta_info_body(rid="r", finish=None, prompt_tokens=3, completion_tokens=1))
    assert running.finish_reason is None and running.spec is None and not running.simulated
    no_round = engine.meta_info_body(rid="r", finish=proto.FinishReason(kind="length", length=1), prompt_tokens=3,
                                     completion_tokens=1, e2e_latency_s=0.1, spec=proto.SpecStats(verify_ct=0))
    assert not [key for key in no_round if key.startswith("spec_")]  # no verify round: no spec keys at all


def test_openai_bodies_round_trip() -> None:
    head = engine.ResponseHead("r", 1, "m")
    stop = proto.FinishReason(kind="stop", matched="\n\n")
    chat = engine.chat_completion_body(head, text="hi", finish=stop, prompt_tokens=2, completion_tokens=3,
                                      meta=engine.meta_info_body(rid="r", finish=stop, prompt_tokens=2,
                                                                completion_tokens=3))
    parsed = proto.parse_openai_response(proto.json_bytes(chat))
    assert parsed.text == "hi" and parsed.usage == proto.Usage(2, 3) and parsed.meta is not None
    assert chat["choices"][0]["matched_stop"] == "\n\n"
    first = proto.parse_openai_event(engine.sse_event(engine.chat_chunk_body(head, content="", first=True))[6:-2]
                                     .decode())
    assert isinstance(first, proto.OpenAIChunk) and first.text == "" and first.finish_reason is None
    last = proto.parse_openai_event(json.dumps(engine.chat_chunk_body(head, content=None, finish=stop)))
    assert isinstance(last, proto.OpenAIChunk) and last.finish_reason == proto.FinishReason(kind="stop")
    [usage_chunk] = engine.stream_end_chunks(head, obj="chat.completion.chunk", prompt_tokens=2, completion_tokens=3,
                                             spec=None, include_usage=True)
    usage = proto.parse_openai_event(json.dumps(usage_chunk))
    assert isinstance(usage, proto.OpenAIChunk) and usage.usage == proto.Usage(2, 3)
    text = proto.parse_openai_event(json.dumps(engine.completion_chunk_body(head, text="abc")))
    assert isinstance(text, proto.OpenAIChunk) and text.text == "abc"
    whole = proto.parse_openai_response(engine.completion_body(head, text="abc", finish=None, prompt_tokens=1,
                                                              completion_tokens=1))
    assert whole.text == "abc" and whole.finish_reason is None
    assert proto.first_model_id(engine.models_body("served", "path", 1, 100)) == "served"
    info = proto.parse_server_info(engine.server_info_body({"speculative_algorithm": "DFLASH"},
                                                          avg_spec_accept_length=9.0, last_gen_throughput=1.0,
                                                          version="v", simulated=True))
    assert info.simulated and info.speculative_algorithm == "DFLASH" and info.version == "v"
    for api in ("native", "chat"):
        assert proto.parse_error_message(engine.failure_answer(api, "bad", 400).body) == "bad"
    spec = proto.SpecStats(verify_ct=2, num_correct_drafts=5, num_proposed_drafts=30, accept_rate=5 / 30,
                           correct_drafts_histogram=(0, 0, 1, 1))
    with_spec = proto.parse_openai_response(proto.json_bytes(engine.completion_body(
        head, text="abc", finish=stop, prompt_tokens=1, completion_tokens=7, spec=spec)))
    assert with_spec.acceptance is not None and with_spec.acceptance[0] == 7 and with_spec.acceptance[1].verify_ct == 2
    ends = engine.stream_end_chunks(head, obj="chat.completion.chunk", prompt_tokens=1, completion_tokens=7, spec=spec,
                                    include_usage=True)
    end = proto.openai_stream_end(b"".join(engine.sse_event(chunk) for chunk in ends) + proto.SSE_DONE)
    assert end.spec is not None and end.spec.verify_ct == 2 and end.usage == proto.Usage(1, 7)


def test_request_bodies_round_trip_into_engine_requests() -> None:
    sampling = proto.SamplingParams(max_new_tokens=7, temperature=0.0, stop=("\n\n",), ignore_eos=True)
    native = engine.parse_generate_request(proto.json_bytes(proto.generate_body("p", sampling, stream=True, rid="x")))
    assert (native.prompt, native.max_new_tokens, native.stop, native.ignore_eos, native.stream, native.rid) == (
        "p", 7, ("\n\n",), True, True, "x")
    assert native.sampling_key == ""  # greedy: sampling parameters cannot change the tokens
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    chat = engine.parse_chat_request(proto.json_bytes(proto.chat_body("m", messages, sampling, stream=False,
                                                                      return_meta_info=True)))
    assert chat.messages == (("user", "hi"),) and chat.return_meta_info and chat.max_new_tokens == 7
    completions = engine.parse_completions_request(proto.json_bytes({"model": "m", "prompt": "p", "stream": True, **proto.SamplingParams(temperature=0.7).openai(),
                          "stream_options": {"include_usage": True}}))
    assert completions.include_usage and completions.sampling_key != "" and completions.max_new_tokens == 256


@pytest.mark.parametrize(
    ("parse", "body", "message", "stage"),
    [
        (engine.parse_generate_request, b'{"text": ["a", "b"]}', "Batched", "body"),
        (engine.parse_generate_request, b'{"text": "a", "sampling_params": {"n": 2}}', "n > 1", "body"),  # one came
        (engine.parse_generate_request, b"not json", "json_invalid", "body"),
        (engine.parse_generate_request, b'{"text": "a", "x": ' + b"9" * 5000 + b"}", "json_invalid", "body"),
        (engine.parse_generate_request, b"[" * 990 + b"]" * 990, "json_invalid", "body"),
        (engine.parse_generate_request, b'{"text": "a", "sampling_params": {"max_tokens": 8}}',
         "unknown field `max_tokens`, expected one of `max_new_tokens`", "contract"),
        (engine.parse_generate_request, b'{"text": "a", "sampling_params": {"max_new_tokens": 1.5}}',
         "invalid type: floating point `1.5`, expected i64", "contract"),
        (engine.parse_generate_request, b'{"input_ids": "abc"}', 'string "abc"', "contract"),
        (engine.parse_generate_request, b'{"text": "a", "stream": "true"}',
         'invalid type: string "true", expected a boolean', "contract"),
        (engine.parse_generate_request, b'{"text": "a", "stream": 1}', "invalid type: integer `1`, expected a boolean",
         "contract"),
        (engine.parse_chat_request, b'{"messages": []}', "messages", "body"),
        (engine.parse_chat_request, b'{"messages": [{"content": "x"}]}', "role", "body"),
        (engine.parse_chat_request, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
         "max_tokens must be positive", "body"),
        (engine.parse_chat_request, b'{"messages": [{"role": "user", "content": "x"}], "stream": true, '
         b'"return_meta_info": true}', "not supported with streaming", "engine"),
        (engine.parse_completions_request, b'{"prompt": 3}', "prompt", "body"),
        (engine.parse_completions_request, b'{"prompt": "x", "n": 2}', "n > 1", "body"),
        (engine.parse_completions_request, b'{"prompt": "x", "max_tokens": -1}', "max_tokens must be positive", "body"),
    ],
)
def test_engine_side_parsing_refuses_bad_requests(parse: Any, body: bytes, message: str, stage: str) -> None:
    with pytest.raises(engine.RequestError, match=message) as refused:
        parse(body)
    assert refused.value.stage == stage


@pytest.mark.parametrize(("flag", "read"), [(True, True), ("true", True), (1, True), ("yes", True), ("off", False),
                                           (0.0, False)])
def test_openai_flags_are_read_as_sglangs_pydantic_models_read_them(flag: object, read: bool) -> None:
    """SGLang 0.5.23's ChatCompletionRequest takes `"stream": "true"` (lax pydantic), so a client's flag written so
    asks as `true` does: in the simulator, and in what the gateway reads of a request."""
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": flag,
                       "return_spec_tokens_details": flag}).encode()
    request = engine.parse_chat_request(body)
    assert (request.stream, request.return_spec_tokens_details) == (read, read)
    assert proto.inspect_request(body).return_spec_tokens_details is read
    with pytest.raises(engine.RequestError, match="valid bool"):
        engine.parse_chat_request(body.replace(json.dumps(flag).encode(), b'"maybe"', 1))


@pytest.mark.parametrize(
    ("body", "error", "pos"),
    [
        (rb'{"text": "\ud800"}', "no low surrogate in string", 10),
        (rb'{"text": "\uD800x"}', "no low surrogate in string", 10),
        (rb'{"text": "\ud800\u0041"}', "invalid low surrogate in string", 10),
        (rb'{"text": "a\udc00b"}', "invalid high surrogate in string", 11),
        ('{"text": "é\\ud800"}'.encode(), "no low surrogate in string", 11),
    ],
)
def test_a_lone_surrogate_is_refused_as_sglangs_orjson_refuses_it(body: bytes, error: str, pos: int) -> None:
    with pytest.raises(engine.RequestError) as refused:
        engine.parse_generate_request(body)
    assert refused.value.stage == "body"
    assert str(refused.value) == (f"[{{'type': 'json_invalid', 'loc': ('body', {pos}), 'msg': 'JSON decode error', "
                                  f"'input': {{}}, 'ctx': {{'error': '{error}'}}}}]")
    answer = engine.error_answer("native", refused.value, stream=True)
    assert (answer.status, answer.stream) == (400, False)
    assert json.loads(answer.body) == {"object": "error", "message": str(refused.value), "type": "Bad Request",
                                       "param": None, "code": 400}


def test_surrogate_pairs_and_escaped_backslashes_are_text() -> None:
    assert engine.parse_generate_request(rb'{"text": "\ud83d\ude00"}').prompt == "\N{GRINNING FACE}"
    assert engine.parse_generate_request(rb'{"text": "\\ud800"}').prompt == "\\ud800"
    with pytest.raises(engine.RequestError, match="no low surrogate in string"):
        engine.parse_chat_request(rb'{"messages": [{"role": "user", "content": "\ud800"}]}')


def test_values_are_checked_after_parsing_as_sglang_verifies_them() -> None:
    """temperature, top_p and max_new_tokens pass the schema and fail in the tokenizer manager: for a streamed
    native request SGLang answers them in band, so they must be an `engine` error, not a 400 at parse time."""
    for params, message in [({"top_p": 0}, "top_p must be in"), ({"temperature": -1}, "temperature must be"),
                            ({"max_new_tokens": -1}, "max_new_tokens must be at least 0")]:
        request = engine.parse_generate_request(proto.json_bytes({"text": "a", "sampling_params": params}))
        with pytest.raises(engine.RequestError, match=message) as refused:
            engine.verify(request)
        assert refused.value.stage == "engine"
    assert engine.parse_completions_request(b'{"prompt": "x"}').max_new_tokens == engine.COMPLETIONS_MAX_TOKENS
    assert engine.parse_generate_request(b'{"text": "x"}').max_new_tokens == engine.NATIVE_MAX_NEW_TOKENS


def test_refusals_are_answered_in_sglang_shapes() -> None:
    context = engine.context_error(100, 40, 80)
    assert context is not None and "maximum context length of 100 tokens" in str(context)
    assert engine.context_error(100, 100, None) is not None and engine.context_error(100, 40, 60) is None
    streamed = engine.error_answer("native", context, stream=True)
    assert streamed.status == 200 and streamed.stream and streamed.body.endswith(proto.SSE_DONE)
    assert proto.native_stream_error(streamed.body) == proto.StreamError(
        str(context), code=400, kind="invalid_request_error", retryable=False)
    assert json.loads(engine.error_answer("native", context, stream=False).body) == {"error": {"message": str(context)}}
    assert json.loads(engine.error_answer("chat", context, stream=True).body)["type"] == "BadRequestError"
    contract = engine.RequestError("unknown field `x`", "contract")
    assert json.loads(engine.error_answer("native", contract, stream=True).body) == {"error": "unknown field `x`"}
    body = engine.RequestError("[{'type': 'json_invalid'}]")
    assert json.loads(engine.error_answer("chat", body, stream=False).body)["type"] == "Bad Request"


@pytest.mark.parametrize("incremental", [False, True])
def test_native_stream_encoder_matches_the_builder_byte_for_byte(incremental: bool) -> None:
    encoder = engine.NativeStreamEncoder(incremental)
    text, ids = "", []
    for delta, new_ids in [("def", [750]), ("", []), (' "é"\n', [1, 2, 3]), ("\\ x", [4])]:
        text, ids = text + delta, ids + new_ids
        meta = engine.meta_info_body(rid="r", finish=None, prompt_tokens=1, completion_tokens=len(ids))
        shown = (delta, new_ids) if incremental else (text, ids)
        assert encoder.event(delta, new_ids, meta) == engine.sse_event(engine.generate_response_body(*shown, meta))


def test_the_api_key_is_checked_as_sglang_checks_it() -> None:
    assert engine.authorized("POST", "/generate", None, None)
    assert engine.authorized("POST", "/generate", "Bearer k", "k") and engine.authorized("GET", "/x", "bearer k", "k")
    for header in (None, "", "Bearer", "Bearer  k", "Bearer K", "Basic k", "Bearerk", "k"):
        assert not engine.authorized("POST", "/v1/chat/completions", header, "k"), header
    for open_path in ("/health", "/health_generate", "/ready", "/metrics"):
        assert engine.authorized("GET", open_path, None, "k")
    assert engine.authorized("OPTIONS", "/generate", None, "k")
    assert engine.UNAUTHORIZED.status == 401 and json.loads(engine.UNAUTHORIZED.body) == {"error": "Unauthorized"}
