"""Requests as an SGLang server reads them: parsing of the three APIs' bodies, and SGLang's refusals, worded as
SGLang words them, with the stage that decides the answer's shape."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from dfserve.errors import ProtocolError
from dfserve.sglang.client.meta import FinishReason
from dfserve.sglang.client.requests import Api
from dfserve.sglang.wire import lax_bool

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


_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_ESCAPES = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)")


def _json_invalid(detail: str, pos: int) -> RequestError:
    return RequestError(f"[{{'type': 'json_invalid', 'loc': ('body', {pos}), 'msg': 'JSON decode error', "
                        f"'input': {{}}, 'ctx': {{'error': '{detail}'}}}}]")


def _lone_surrogate(text: str) -> RequestError | None:
    """SGLang reads bodies with orjson, which refuses an escaped surrogate that is not one half of a pair (Python's
    json takes it, and the tokenizer then fails); the error is orjson's, at the escape's character offset."""
    if _SURROGATE.search(text) is None:
        return None
    pending = None
    for escape in _ESCAPES.finditer(text):
        code = int(escape.group(1), 16) if escape.group(1) else None
        if pending is not None:
            if code is None or pending.end() != escape.start():
                return _json_invalid("no low surrogate in string", pending.start())
            if not 0xDC00 <= code <= 0xDFFF:
                return _json_invalid("invalid low surrogate in string", pending.start())
            pending = None
        elif code is not None and 0xD800 <= code <= 0xDBFF:
            pending = escape
        elif code is not None and 0xDC00 <= code <= 0xDFFF:
            return _json_invalid("invalid high surrogate in string", escape.start())
    return None if pending is None else _json_invalid("no low surrogate in string", pending.start())


def _request_json(body: bytes) -> dict[str, Any]:
    """The body as SGLang's FastAPI app reads it (with orjson); what it refuses is answered as a
    `RequestValidationError` is."""
    try:
        text = body.decode()
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: also an integer of over 4300 digits
        raise _json_invalid(getattr(exc, "msg", str(exc)), getattr(exc, "pos", 0)) from None
    if (refused := _lone_surrogate(text)) is not None:
        raise refused
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
    if kind is bool and (flag := lax_bool(value)) is not None:
        return flag
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
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):  # native flags are strict, unlike the OpenAI models'
        raise RequestError(f"invalid type: {_unexpected(stream)}, expected a boolean", "contract")
    params = data.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError(f"invalid type: {_unexpected(params)}, expected struct SamplingParams", "contract")
    _contract(params)
    if params.get("n") not in (None, 1):  # SGLang makes it a batch of outputs, which this server does not model
        raise RequestError("n > 1 is not supported by this server")
    rid = data.get("rid")
    max_new = params.get("max_new_tokens")
    return EngineRequest(
        api="native", prompt=text, messages=None, input_ids=tuple(ids) if ids is not None else None,
        stream=stream is True, rid=str(rid) if rid is not None else None, model=None,
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


@dataclass(frozen=True)
class AbortRequest:
    """`POST /abort_request` (``AbortReq`` in ``managers/io_struct.py``): the request whose `rid` it names, or every
    request (`abort_all`). SGLang ignores an empty `rid` without `abort_all`, and a `rid` it does not hold."""

    rid: str
    abort_all: bool


ABORTED = FinishReason(kind="abort", message="Aborted")
"""How a running request that `/abort_request` aborts finishes (``FINISH_ABORT()``: no status, no error type): its
last chunk or whole answer, HTTP 200, not an error event."""


ABORTED_WAITING = FinishReason(kind="abort", message="Abort in waiting queue")
"""How a request still waiting for a slot finishes when aborted (``TokenizerManager._handle_abort_req``)."""


def parse_abort_request(body: bytes) -> AbortRequest:
    data = _request_json(body)
    rid = _openai_field(data, "rid", str, None)
    return AbortRequest(rid=rid or "", abort_all=_openai_field(data, "abort_all", bool, False) is True)
