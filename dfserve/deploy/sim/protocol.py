"""SGLang's wire protocol from the engine's side: requests as an SGLang server reads them, and the bodies it answers.

Used by dfserve's simulator only; what a client reads (and the types both sides share) is `dfserve.sglang`. Shapes
follow SGLang 0.5.23: ``python/sglang/srt/managers/io_struct.py`` (GenerateReqInput), ``sampling/sampling_params.py``
(``verify``), ``entrypoints/http_server.py`` and ``entrypoints/openai/{protocol,serving_chat,serving_completions}.py``.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dfserve.errors import ProtocolError
from dfserve.sglang import (
    SIM_CHUNK_DUE_KEY,
    SIM_CHUNK_SENT_KEY,
    SIM_MARKER_KEY,
    SIM_TIMES_COMMENT,
    SSE_DONE,
    Api,
    FinishReason,
    SimStreamTimes,
    SpecStats,
    accept_length,
    json_bytes,
)

Stage = Literal["body", "contract", "engine"]
"""Where SGLang refuses a request, which decides the answer's shape (`error_answer`):
- `body`: FastAPI reading the body into its model (not JSON, a field of the wrong type, an OpenAI field validator):
  400 with an `ErrorResponse` (``http_server.validation_exception_handler``);
- `contract`: native `/generate`'s schema gate (an unknown `sampling_params` key, a value of the wrong JSON type):
  400 with `{"error": "<serde's text>"}` (``http_server.generate_request``, ``api_contract.generate_contract_error``);
- `engine`: the tokenizer manager (``SamplingParams.verify``, ``TokenizerManager._validate_one_request``): for a
  streamed native request, in band in a 200 stream; else 400."""


class RequestError(ProtocolError):
    """A request SGLang refuses; the message is worded like SGLang's, `stage` says where it is refused."""

    def __init__(self, message: str, stage: Stage = "body") -> None:
        super().__init__(message)
        self.stage: Stage = stage


@dataclass(frozen=True)
class EngineRequest:
    """One prompt as an engine sees it, from any of the three APIs."""

    api: Api
    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None
    input_ids: tuple[int, ...] | None
    max_new_tokens: int | None
    temperature: float
    top_p: float
    sampling_key: str
    """The parameters that change sampled tokens, canonical JSON; empty at temperature 0 (greedy)."""
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    no_stop_trim: bool
    stream: bool
    rid: str | None
    model: str | None
    return_meta_info: bool = False
    return_spec_tokens_details: bool = False
    include_usage: bool = False


NATIVE_MAX_NEW_TOKENS = 128
"""`max_new_tokens` of a native request that sets none (``SamplingParams`` in ``sampling/sampling_params.py``)."""

COMPLETIONS_MAX_TOKENS = 16
"""`max_tokens` of a `/v1/completions` request that sets none (``CompletionRequest`` in ``openai/protocol.py``)."""

SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
"""The keys native `sampling_params` may carry: any other is refused (``_FIELDS_SamplingParams`` in
``sglang/api/v1/api_types.py``, the schema SGLang's Rust and Python servers share)."""

_INTEGERS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed", "beam_width")
_NUMBERS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_BOOLEANS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_TOKEN_SHAPING = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "sampling_seed", "seed", "n")


def _request_json(body: bytes) -> dict[str, Any]:
    """The body as FastAPI reads it; what it refuses is answered as a `RequestValidationError` is."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        detail = getattr(exc, "msg", str(exc))
        raise RequestError(f"[{{'type': 'json_invalid', 'loc': ('body', {getattr(exc, 'pos', 0)}), "
                           f"'msg': 'JSON decode error', 'input': {{}}, 'ctx': {{'error': '{detail}'}}}}]") from None
    if not isinstance(data, dict):
        raise RequestError("[{'type': 'model_attributes_type', 'loc': ('body',), "
                           "'msg': 'Input should be a valid dictionary or object to extract fields from'}]")
    return data


def _unexpected(value: Any) -> str:
    """serde's `Unexpected` wording of a JSON value, as the contract gate reports it."""
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map" if isinstance(value, dict) else "null"


def _contract(params: dict[str, Any]) -> None:
    """The schema gate of native `sampling_params` (``decode_SamplingParams``): unknown keys and wrong JSON types."""
    for key, value in params.items():
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{name}`" for name in SAMPLING_FIELDS)
            raise RequestError(f"unknown field `{key}`, expected one of {listed}", "contract")
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        expected, fits = (
            ("i64", number and isinstance(value, int)) if key in _INTEGERS else
            ("f64", number) if key in _NUMBERS else
            ("a boolean", isinstance(value, bool)) if key in _BOOLEANS else ("", True)
        )
        if not fits:
            raise RequestError(f"invalid type: {_unexpected(value)}, expected {expected}", "contract")


def _openai_field(data: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """One field as pydantic reads an OpenAI request (wrong types are a `body` error)."""
    value = data.get(key, default)
    if value is None or value is default:
        return value
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise RequestError(f"[{{'type': '{kind.__name__}_type', 'loc': ('body', '{key}'), "
                       f"'msg': 'Input should be a valid {kind.__name__}', 'input': {value!r}}}]")


def _string_list(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise RequestError(f"{key} must be a string or a list of strings")


def _sampling(params: dict[str, Any], max_new: int | None) -> dict[str, Any]:
    """The sampling fields an engine request carries; their values are checked later (`verify`), as SGLang does."""
    temperature = params.get("temperature")
    top_p = params.get("top_p")
    stop_ids = params.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids)):
        raise RequestError("stop_token_ids must be a list of integers")
    temperature = 1.0 if temperature is None else float(temperature)
    shaping = {k: params[k] for k in _TOKEN_SHAPING if params.get(k) is not None}
    return {
        "max_new_tokens": max_new,
        "temperature": temperature,
        "top_p": 1.0 if top_p is None else float(top_p),
        "sampling_key": "" if temperature == 0 else json.dumps(shaping, sort_keys=True),
        "stop": _string_list(params.get("stop"), "stop"),
        "stop_token_ids": tuple(stop_ids),
        "ignore_eos": params.get("ignore_eos") is True,
        "no_stop_trim": params.get("no_stop_trim") is True,
    }


def verify(request: EngineRequest) -> None:
    """The checks of SGLang's ``SamplingParams.verify`` the simulator's requests can fail, worded like SGLang's; an
    `engine` error, so a streamed native request gets it in band."""
    if not request.temperature >= 0 or request.temperature == float("inf"):
        raise RequestError(f"temperature must be a non-negative finite number, got {request.temperature}.", "engine")
    if not 0.0 < request.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {request.top_p}.", "engine")
    if request.max_new_tokens is not None and request.max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {request.max_new_tokens}.", "engine")


def context_error(context_length: int, prompt_tokens: int, max_new_tokens: int | None) -> RequestError | None:
    """``TokenizerManager._validate_one_request``: the prompt alone, then prompt plus `max_new_tokens` (when the
    request set it), must fit the context length."""
    if prompt_tokens >= context_length:
        return RequestError(f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                            f"({context_length} tokens).", "engine")
    if max_new_tokens is not None and prompt_tokens + max_new_tokens > context_length:
        return RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. You "
            f"requested a total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from the input "
            f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in the "
            f"input messages or the completion to fit within the limit.", "engine")
    return None


def parse_generate_request(body: bytes) -> EngineRequest:
    """Native `POST /generate` with one prompt (`text` or `input_ids`); batched input is refused."""
    data = _request_json(body)
    text, ids = data.get("text"), data.get("input_ids")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise RequestError("Batched requests (a list of prompts) are not supported by this server")
    if text is None and ids is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.", "engine")
    if text is not None and not isinstance(text, str):
        raise RequestError(f"invalid type: {_unexpected(text)}, expected a value or an array of values for "
                           "StringOrList", "contract")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise RequestError(f"invalid type: {_unexpected(ids)}, expected a value or an array of values for "
                           "TokenIdsOrList", "contract")
    params = data.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError(f"invalid type: {_unexpected(params)}, expected struct SamplingParams", "contract")
    _contract(params)
    rid = data.get("rid")
    max_new = params.get("max_new_tokens")
    return EngineRequest(
        api="native", prompt=text, messages=None, input_ids=tuple(ids) if ids is not None else None,
        stream=data.get("stream") is True, rid=str(rid) if rid is not None else None, model=None,
        **_sampling(params, NATIVE_MAX_NEW_TOKENS if max_new is None else max_new),
    )


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(p for p in parts if isinstance(p, str))
    raise RequestError("messages: content must be a string or a list of content parts")


def _openai_common(data: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """The fields chat and completions share, typed as their pydantic models type them."""
    if _openai_field(data, "n", int, 1) != 1:
        raise RequestError("n > 1 is not supported by this server")
    for key in ("temperature", "top_p"):
        _openai_field(data, key, float, None)
    options = data.get("stream_options")
    stream = _openai_field(data, "stream", bool, False) is True
    model = data.get("model")
    return {
        "stream": stream,
        "model": model if isinstance(model, str) else None,
        "rid": str(data["rid"]) if data.get("rid") is not None else None,
        "include_usage": stream and isinstance(options, dict) and options.get("include_usage") is True,
        "return_spec_tokens_details": _openai_field(data, "return_spec_tokens_details", bool, False) is True,
        **_sampling(data, max_tokens),
    }


def _positive_max_tokens(data: dict[str, Any], key: str, default: int | None) -> int | None:
    """`max_tokens`/`max_completion_tokens`: SGLang's field validators refuse values of 0 or less."""
    value = _openai_field(data, key, int, default)
    if value is not None and value <= 0:
        raise RequestError(f"[{{'type': 'value_error', 'loc': ('body', '{key}'), "
                           f"'msg': 'Value error, {key} must be positive', 'input': {value}}}]")
    return value


def parse_chat_request(body: bytes) -> EngineRequest:
    """`POST /v1/chat/completions`; `return_meta_info` with streaming is refused, as SGLang does."""
    data = _request_json(body)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required'}]")
    turns = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError("messages: each message needs a 'role'")
        turns.append((message["role"], _content_text(message.get("content"))))
    max_tokens = _positive_max_tokens(data, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _positive_max_tokens(data, "max_tokens", None)
    common = _openai_common(data, max_tokens)
    return_meta = _openai_field(data, "return_meta_info", bool, False) is True
    if return_meta and common["stream"]:
        raise RequestError("return_meta_info is not supported with streaming", "engine")
    return EngineRequest(api="chat", prompt=None, messages=tuple(turns), input_ids=None,
                         return_meta_info=return_meta, **common)


def parse_completions_request(body: bytes) -> EngineRequest:
    """`POST /v1/completions` with one string prompt; `max_tokens` defaults to 16 and must be positive."""
    data = _request_json(body)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("[{'type': 'missing', 'loc': ('body', 'prompt'), 'msg': 'Field required'}]")
    if not prompt:
        raise RequestError("Prompt cannot be empty", "engine")
    max_tokens = _positive_max_tokens(data, "max_tokens", COMPLETIONS_MAX_TOKENS)
    return EngineRequest(api="completions", prompt=prompt, messages=None, input_ids=None,
                         **_openai_common(data, max_tokens))


def finish_reason_body(finish: FinishReason | None) -> dict[str, Any] | None:
    """Native `finish_reason` (``BaseFinishReason.to_json`` and its subclasses in ``managers/schedule_batch.py``):
    `{"type": "stop", "matched": ...}`, `{"type": "length", "length": N}`,
    `{"type": "abort", "message", "status_code", "err_type"}`."""
    if finish is None:
        return None
    body: dict[str, Any] = {"type": finish.kind}
    if finish.kind == "length":
        body["length"] = finish.length
    elif finish.kind == "abort":
        body.update(message=finish.message, status_code=finish.status_code, err_type=finish.err_type)
    else:
        body["matched"] = finish.matched
    return body


def spec_details_body(completion_tokens: int, spec: SpecStats) -> dict[str, Any]:
    """The spec fields SGLang adds to a finished request that ran verify rounds, in its order
    (``TokenizerManager._calculate_spec_decoding_metrics``); also the fields of `sglext.spec_tokens_details`. The
    histogram (one count per number of correct drafts, as long as the largest seen) is left out while empty."""
    body: dict[str, Any] = {
        "spec_accept_rate": spec.accept_rate or 0.0,
        "spec_accept_length": accept_length(completion_tokens, spec.verify_ct),
        "spec_num_correct_drafts": spec.num_correct_drafts,
        "spec_num_proposed_drafts": spec.num_proposed_drafts,
        "spec_verify_ct": spec.verify_ct,
    }
    if spec.correct_drafts_histogram:
        body["spec_correct_drafts_histogram"] = list(spec.correct_drafts_histogram)
    return body


def meta_info_body(
    *,
    rid: str,
    finish: FinishReason | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    weight_version: str = "default",
    queue_time_s: float | None = None,
    e2e_latency_s: float | None = None,
    spec: SpecStats | None = None,
    simulated: bool = False,
) -> dict[str, Any]:
    """A native `meta_info` in SGLang 0.5.23's order (``TokenizerManager._handle_batch_output``); `e2e_latency_s`
    and `spec` belong on the final chunk only, and spec fields only where a verify round ran."""
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": finish_reason_body(finish), "prompt_tokens": prompt_tokens,
        "weight_version": weight_version, "num_retractions": 0,
    }
    if queue_time_s is not None:
        meta["queue_time"] = queue_time_s
    meta.update(reasoning_tokens=0, completion_tokens=completion_tokens, cached_tokens=cached_tokens)
    if e2e_latency_s is not None:
        meta["e2e_latency"] = e2e_latency_s
    if spec is not None and spec.verify_ct > 0:
        meta.update(spec_details_body(completion_tokens, spec))
    if simulated:
        meta[SIM_MARKER_KEY] = True
    return meta


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying a JSON object, as SGLang frames it."""
    return b"data: " + json_bytes(obj) + b"\n\n"



def generate_response_body(text: str, output_ids: Sequence[int], meta: dict[str, Any]) -> dict[str, Any]:
    """Native `/generate` answer for one prompt; also the shape of each streamed chunk."""
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}


class NativeStreamEncoder:
    """The events of one native `/generate` stream, byte for byte what `sse_event(generate_response_body(...))` gives.

    SGLang's chunks repeat the whole text and ids so far unless `--incremental-streaming-output` is set; this
    encoder escapes and encodes each delta once and extends the bytes it sent before, instead of re-encoding the
    whole text per chunk. It only appends: a final chunk whose text was trimmed (a stop string) uses the builder.
    """

    def __init__(self, incremental: bool) -> None:
        self._incremental = incremental
        self._text = b""
        self._ids = b""
        self._sent = b""
        self._sent_count = 0

    def event(self, text_delta: str, new_ids: Sequence[int], meta: dict[str, Any]) -> bytes:
        text = json.dumps(text_delta, ensure_ascii=False)[1:-1].encode()
        ids = ",".join(map(str, new_ids)).encode()
        if not self._incremental:
            self._text += text
            self._ids = self._ids + b"," + ids if self._ids and ids else self._ids or ids
            text, ids = self._text, self._ids
        return b"".join((b'data: {"text":"', text, b'","output_ids":[', ids, b'],"meta_info":', json_bytes(meta),
                         b"}\n\n"))

    def with_sent_times(self, event: bytes, sent_unix_s: Sequence[float]) -> bytes:
        """`event` with SIM_CHUNK_SENT_KEY added last to its `meta_info` (the event's last key).

        The simulator encodes a final chunk before it is due and adds the send times as it sends it; times encoded
        by `encode_sent_times` beforehand are reused, so only the last one is formatted then.
        """
        end = b"}}\n\n"
        if not event.endswith(end):
            raise ValueError("not a native event whose last key is meta_info")
        self.encode_sent_times(sent_unix_s)
        return b"".join((event[: -len(end)], b',"', SIM_CHUNK_SENT_KEY.encode(), b'":[', self._sent, b"]", end))

    def encode_sent_times(self, sent_unix_s: Sequence[float]) -> None:
        """Format the send times not formatted yet (a stream's times only grow); each float costs a third of a µs."""
        new = ",".join(map(float.__repr__, sent_unix_s[self._sent_count :])).encode()
        self._sent = self._sent + b"," + new if self._sent and new else self._sent or new
        self._sent_count = len(sent_unix_s)



def sim_times_comment(times: SimStreamTimes) -> bytes:
    """The SSE comment that carries a simulated OpenAI stream's chunk times, inserted before `data: [DONE]`."""
    return SIM_TIMES_COMMENT + json_bytes({SIM_CHUNK_SENT_KEY: times.sent_unix_s, SIM_CHUNK_DUE_KEY: times.due_unix_s,
                                           "queue_time": times.queue_time_s}) + b"\n\n"



def openai_finish_reason(finish: FinishReason | None) -> tuple[str | None, str | int | None]:
    """OpenAI `finish_reason` and SGLang's `matched_stop` for a native finish reason."""
    if finish is None:
        return None, None
    return finish.kind, finish.matched


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """``UsageInfo`` as ``UsageProcessor.calculate_token_usage`` fills it (no cache report, no reasoning parser)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None, "reasoning_tokens": 0,
            "completion_tokens_details": None}


@dataclass(frozen=True)
class ResponseHead:
    """The fields every OpenAI response and chunk of one request repeats."""

    id: str
    created: int
    model: str

    def fields(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def _sglext(completion_tokens: int, spec: SpecStats | None) -> dict[str, Any]:
    """`sglext` with `spec_tokens_details` (``SpecTokensDetails``, all fields), when there is anything to say."""
    if spec is None or spec.verify_ct <= 0:
        return {}
    details = {"spec_cap_length": 0.0, "spec_block_accept_length": 0.0, "spec_cap_lens_histogram": [],
               "spec_correct_drafts_histogram": [], **spec_details_body(completion_tokens, spec)}
    order = ("spec_accept_rate", "spec_accept_length", "spec_cap_length", "spec_block_accept_length",
             "spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_verify_ct", "spec_correct_drafts_histogram",
             "spec_cap_lens_histogram")
    return {"sglext": {"spec_tokens_details": {key: details[key] for key in order}}}


def chat_completion_body(
    head: ResponseHead, *, text: str, finish: FinishReason | None, prompt_tokens: int,
    completion_tokens: int, meta: dict[str, Any] | None = None, spec: SpecStats | None = None,
    weight_version: str = "default",
) -> dict[str, Any]:
    """Whole `/v1/chat/completions` answer (``ChatCompletionResponse``); `meta` (the native meta_info) only when the
    client set return_meta_info, `spec` only with return_spec_tokens_details."""
    reason, matched = openai_finish_reason(finish)
    choice: dict[str, Any] = {
        "index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None},
        "logprobs": None, "finish_reason": reason, "matched_stop": matched,
    }
    if meta is not None:
        choice["meta_info"] = meta
    return {**head.fields("chat.completion"), "choices": [choice], "usage": usage_body(prompt_tokens, completion_tokens),
            "metadata": {"weight_version": weight_version}, **_sglext(completion_tokens, spec)}


def chat_chunk_body(
    head: ResponseHead, *, content: str | None, finish: FinishReason | None = None, first: bool = False,
) -> dict[str, Any]:
    """One streamed chat chunk as ``sse_utils.build_sse_content`` encodes it (defaults left out, `reasoning_content`
    always there): the first carries the role, the last only the finish reason."""
    reason, matched = openai_finish_reason(finish)
    delta: dict[str, Any] = {"reasoning_content": None}
    if first:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
    return {**head.fields("chat.completion.chunk"), "choices": [choice]}


def completion_body(
    head: ResponseHead, *, text: str, finish: FinishReason | None, prompt_tokens: int,
    completion_tokens: int, spec: SpecStats | None = None,
) -> dict[str, Any]:
    """Whole `/v1/completions` answer (``CompletionResponse``)."""
    reason, matched = openai_finish_reason(finish)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
    return {**head.fields("text_completion"), "choices": [choice], "usage": usage_body(prompt_tokens, completion_tokens),
            "metadata": None, **_sglext(completion_tokens, spec)}


def completion_chunk_body(head: ResponseHead, *, text: str, finish: FinishReason | None = None) -> dict[str, Any]:
    """One streamed `/v1/completions` chunk (``CompletionStreamResponse``): the last carries the finish reason."""
    reason, matched = openai_finish_reason(finish)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
    return {**head.fields("text_completion"), "choices": [choice], "usage": None}


def stream_end_chunks(head: ResponseHead, *, obj: str, prompt_tokens: int, completion_tokens: int,
                      spec: SpecStats | None, include_usage: bool) -> list[dict[str, Any]]:
    """The chunks with `choices: []` that end an OpenAI stream before `[DONE]`: `sglext` with the spec details
    (return_spec_tokens_details), then usage (include_usage), as ``_generate_chat_stream`` sends them."""
    chunks = []
    sglext = _sglext(completion_tokens, spec)
    if sglext:
        chunks.append({**head.fields(obj), "choices": [], "usage": None, **sglext})
    if include_usage:
        chunks.append({**head.fields(obj), "choices": [], "usage": usage_body(prompt_tokens, completion_tokens)})
    return chunks


def models_body(served_model_name: str, model_path: str, created: int, max_model_len: int) -> dict[str, Any]:
    """`GET /v1/models` (``ModelList``)."""
    card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "sglang",
            "root": model_path, "parent": None, "max_model_len": max_model_len}
    return {"object": "list", "data": [card]}


def model_info_body(model_path: str, model_type: str, architectures: Sequence[str]) -> dict[str, Any]:
    """`GET /model_info`."""
    return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": model_type, "architectures": list(architectures)}


def server_info_body(
    server_args: dict[str, Any], *, avg_spec_accept_length: float | None, last_gen_throughput: float,
    version: str, simulated: bool = False,
) -> dict[str, Any]:
    """`GET /server_info` (``http_server.get_server_info``): resolved server args, one `internal_states` entry
    (DP rank 0), the version. `avg_spec_accept_length` is there once the first decode-log interval has passed."""
    state: dict[str, Any] = {"last_gen_throughput": last_gen_throughput}
    if avg_spec_accept_length is not None:
        state["avg_spec_accept_length"] = avg_spec_accept_length
    info = {**server_args, "internal_states": [state], "version": version, "frontend": "python"}
    if simulated:
        info[SIM_MARKER_KEY] = True
    return info


def error_response(message: str, kind: str, code: int) -> dict[str, Any]:
    """SGLang's ``ErrorResponse``: what its OpenAI routes and FastAPI's validation handler answer."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


STREAM_ERROR_TYPE = "invalid_request_error"
"""`type` of the error event a streamed native request that fails validation gets (``generate_request``)."""


def native_error_event(message: str, code: int = 400) -> bytes:
    """The in-band end of a streamed native request refused by the engine: the error event, then `[DONE]`."""
    error = {"message": message, "type": STREAM_ERROR_TYPE, "code": code, "retryable": False}
    return sse_event({"error": error}) + SSE_DONE


def openai_error_event(message: str, kind: str, code: int) -> bytes:
    """The error event of an OpenAI stream aborted with a status (``create_streaming_error_response``)."""
    return b"data: " + json.dumps({"error": error_response(message, kind, code)}).encode() + b"\n\n"


@dataclass(frozen=True)
class Answer:
    """A whole HTTP answer: status, body, and whether the body is an event stream."""

    status: int
    body: bytes
    stream: bool = False


def authorized(method: str, path: str, authorization: str | None, api_key: str | None) -> bool:
    """SGLang's check of `--api-key` (`decide_request_auth` in `srt/utils/auth.py`): health, readiness and metrics
    paths and OPTIONS are open; anything else needs `Authorization: Bearer KEY` (scheme case-insensitive)."""
    if api_key is None or method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return True
    scheme, sep, token = (authorization or "").partition(" ")
    return bool(sep) and scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


UNAUTHORIZED = Answer(401, json_bytes({"error": "Unauthorized"}))
"""SGLang's refusal of a request without the API key (an `ORJSONResponse`, not an OpenAI error)."""


def error_answer(api: Api, error: RequestError, stream: bool) -> Answer:
    """How SGLang answers a request refused at `error.stage` (see `Stage`)."""
    message = str(error)
    if error.stage == "contract":
        return Answer(400, json_bytes({"error": message}))
    if error.stage == "body":
        return Answer(400, json_bytes(error_response(message, "Bad Request", 400)))
    if api != "native":
        return Answer(400, json_bytes(error_response(message, "BadRequestError", 400)))
    if stream:
        return Answer(200, native_error_event(message), stream=True)
    return Answer(400, json_bytes({"error": {"message": message}}))


def failure_answer(api: Api, message: str, status: int) -> Answer:
    """A request the engine fails with an HTTP status before answering it: a 400 from the native route
    (``_create_error_response``), else an ``ErrorResponse`` typed by the status (the `HTTPException` that
    ``TokenizerManager._handle_abort_finish_reason`` raises, as the OpenAI routes and the app's handler answer it)."""
    if api == "native" and status == 400:
        return Answer(status, json_bytes({"error": {"message": message}}))
    return Answer(status, json_bytes(error_response(message, str(status), status)))
