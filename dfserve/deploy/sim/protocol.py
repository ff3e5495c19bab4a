"""SGLang's wire protocol from the engine's side: requests as an SGLang server reads them, and the bodies it answers.

Used by dfserve's simulator only; what a client reads (and the types both sides share) is `dfserve.sglang`. Shapes
follow SGLang 0.5.23: ``python/sglang/srt/managers/io_struct.py`` (GenerateReqInput), ``sampling/sampling_params.py``
(``verify``), ``entrypoints/http_server.py`` and ``entrypoints/openai/{protocol,serving_chat,serving_completions}.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dfserve.errors import ProtocolError
from dfserve.sglang import (
    SIM_CHUNK_DUE_KEY,
    SIM_CHUNK_SENT_KEY,
    SIM_MARKER_KEY,
    SIM_TIMES_COMMENT,
    Api,
    FinishReason,
    SimStreamTimes,
    SpecStats,
    accept_length,
    json_bytes,
)


class RequestError(ProtocolError):
    """A request an SGLang server refuses with 400; the message is worded like SGLang's."""


@dataclass(frozen=True)
class EngineRequest:
    """One prompt as an engine sees it, from any of the three APIs."""

    api: Api
    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None
    input_ids: tuple[int, ...] | None
    max_new_tokens: int | None
    temperature: float
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
    include_usage: bool = False


_TOKEN_SHAPING = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "sampling_seed", "seed", "n")


def _request_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError("The request body must be a JSON object")
    return data


def _number(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{key} must be a number, got {value!r}")
    return float(value)


def _string_list(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise RequestError(f"{key} must be a string or a list of strings")


def _sampling(params: dict[str, Any], max_tokens_key: str) -> dict[str, Any]:
    """Checks of SGLang's `SamplingParams.verify`, shared by every API."""
    max_new = params.get(max_tokens_key)
    if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int)):
        raise RequestError(f"{max_tokens_key} must be an integer, got {max_new!r}")
    if max_new is not None and max_new < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.")
    temperature = _number(params, "temperature", 1.0)
    if temperature < 0:
        raise RequestError(f"temperature must be non-negative, got {temperature}.")
    top_p = _number(params, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
    stop_ids = params.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids)):
        raise RequestError("stop_token_ids must be a list of integers")
    shaping = {k: params[k] for k in _TOKEN_SHAPING if params.get(k) is not None}
    return {
        "max_new_tokens": max_new,
        "temperature": temperature,
        "sampling_key": "" if temperature == 0 else json.dumps(shaping, sort_keys=True),
        "stop": _string_list(params.get("stop"), "stop"),
        "stop_token_ids": tuple(stop_ids),
        "ignore_eos": params.get("ignore_eos") is True,
        "no_stop_trim": params.get("no_stop_trim") is True,
    }


def parse_generate_request(body: bytes) -> EngineRequest:
    """Native `POST /generate` with one prompt (`text` or `input_ids`); batched input is refused."""
    data = _request_json(body)
    text, ids = data.get("text"), data.get("input_ids")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise RequestError("Batched requests (a list of prompts) are not supported by this server")
    if text is None and ids is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if text is not None and not isinstance(text, str):
        raise RequestError("text must be a string")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise RequestError("input_ids must be a list of integers")
    params = data.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError("sampling_params must be an object")
    rid = data.get("rid")
    return EngineRequest(
        api="native", prompt=text, messages=None, input_ids=tuple(ids) if ids is not None else None,
        stream=data.get("stream") is True, rid=str(rid) if rid is not None else None, model=None,
        **_sampling(params, "max_new_tokens"),
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


def _openai_common(data: dict[str, Any]) -> dict[str, Any]:
    if data.get("n", 1) != 1:
        raise RequestError("n > 1 is not supported by this server")
    options = data.get("stream_options")
    stream = data.get("stream") is True
    max_key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    return {
        "stream": stream,
        "model": data.get("model") if isinstance(data.get("model"), str) else None,
        "rid": str(data["rid"]) if data.get("rid") is not None else None,
        "include_usage": stream and isinstance(options, dict) and options.get("include_usage") is True,
        **_sampling(data, max_key),
    }


def parse_chat_request(body: bytes) -> EngineRequest:
    """`POST /v1/chat/completions`; `return_meta_info` with streaming is refused, as SGLang does."""
    data = _request_json(body)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: Field required (a non-empty list)")
    turns = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError("messages: each message needs a 'role'")
        turns.append((message["role"], _content_text(message.get("content"))))
    common = _openai_common(data)
    return_meta = data.get("return_meta_info") is True
    if return_meta and common["stream"]:
        raise RequestError("return_meta_info is not supported with streaming")
    return EngineRequest(api="chat", prompt=None, messages=tuple(turns), input_ids=None,
                         return_meta_info=return_meta, **common)


def parse_completions_request(body: bytes) -> EngineRequest:
    """`POST /v1/completions` with one string prompt."""
    data = _request_json(body)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("prompt: Field required (one string)")
    return EngineRequest(api="completions", prompt=prompt, messages=None, input_ids=None, **_openai_common(data))


def finish_reason_body(finish: FinishReason | None) -> dict[str, Any] | None:
    """Native `finish_reason`: `{"type": "stop", "matched": ...}`, `{"type": "length", "length": N}`, abort."""
    if finish is None:
        return None
    body: dict[str, Any] = {"type": finish.kind}
    if finish.kind == "length":
        body["length"] = finish.length
    elif finish.kind == "abort":
        body["message"] = finish.message
    else:
        body["matched"] = finish.matched
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
    """A native `meta_info`; `spec` and `e2e_latency_s` belong on the final chunk only, as SGLang sends them."""
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": finish_reason_body(finish), "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "cached_tokens": cached_tokens, "weight_version": weight_version,
        "num_retractions": 0, "reasoning_tokens": 0,
    }
    if queue_time_s is not None:
        meta["queue_time"] = queue_time_s
    if e2e_latency_s is not None:
        meta["e2e_latency"] = e2e_latency_s
    if spec is not None:
        length = accept_length(completion_tokens, spec.verify_ct)
        meta.update({
            "spec_verify_ct": spec.verify_ct, "spec_accept_length": length or 0,
            "spec_accept_rate": spec.accept_rate or 0.0,
            "spec_num_correct_drafts": spec.num_correct_drafts, "spec_num_proposed_drafts": spec.num_proposed_drafts,
            "spec_correct_drafts_histogram": list(spec.correct_drafts_histogram or ()),
            "spec_accepted_drafts": spec.num_correct_drafts, "spec_proposed_drafts": spec.num_proposed_drafts,
            "spec_accept_histogram": list(spec.correct_drafts_histogram or ()),
        })
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


def _usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": None, "reasoning_tokens": 0}


@dataclass(frozen=True)
class ResponseHead:
    """The fields every OpenAI response and chunk of one request repeats."""

    id: str
    created: int
    model: str

    def fields(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def chat_completion_body(
    head: ResponseHead, *, text: str, finish: FinishReason | None, prompt_tokens: int,
    completion_tokens: int, meta: dict[str, Any] | None = None, weight_version: str = "default",
) -> dict[str, Any]:
    """Whole `/v1/chat/completions` answer; `meta` (the native meta_info) only when the client set return_meta_info."""
    reason, matched = openai_finish_reason(finish)
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None},
        "logprobs": None, "finish_reason": reason, "matched_stop": matched,
    }
    if meta is not None:
        choice["meta_info"] = meta
    return {**head.fields("chat.completion"), "choices": [choice],
            "usage": _usage_body(prompt_tokens, completion_tokens), "metadata": {"weight_version": weight_version}}


def chat_chunk_body(
    head: ResponseHead, *, content: str | None, finish: FinishReason | None = None,
    first: bool = False,
) -> dict[str, Any]:
    """One streamed chat chunk: the first carries the role, the last the finish reason."""
    reason, matched = openai_finish_reason(finish)
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
    return {**head.fields("chat.completion.chunk"), "choices": [choice], "usage": None}


def completion_body(
    head: ResponseHead, *, text: str, finish: FinishReason | None, prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """Whole `/v1/completions` answer."""
    reason, matched = openai_finish_reason(finish)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
    return {**head.fields("text_completion"), "choices": [choice],
            "usage": _usage_body(prompt_tokens, completion_tokens)}


def completion_chunk_body(head: ResponseHead, *, text: str, finish: FinishReason | None = None) -> dict[str, Any]:
    """One streamed `/v1/completions` chunk."""
    reason, matched = openai_finish_reason(finish)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
    return {**head.fields("text_completion"), "choices": [choice], "usage": None}


def usage_chunk_body(head: ResponseHead, *, obj: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, only usage."""
    return {**head.fields(obj), "choices": [], "usage": _usage_body(prompt_tokens, completion_tokens)}


def models_body(served_model_name: str, model_path: str, created: int, max_model_len: int) -> dict[str, Any]:
    """`GET /v1/models`."""
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
    """`GET /server_info`: resolved server args, one `internal_states` entry (DP rank 0), version, status."""
    state: dict[str, Any] = {"last_gen_throughput": last_gen_throughput}
    if avg_spec_accept_length is not None:
        state["avg_spec_accept_length"] = avg_spec_accept_length
    info = {**server_args, "internal_states": [state], "version": version, "status": "ready"}
    if simulated:
        info[SIM_MARKER_KEY] = True
    return info


def engine_error_body(api: Api, message: str, status: int) -> dict[str, Any]:
    """What SGLang answers a refused request: native `{"error": {"message"}}`, OpenAI routes an ErrorResponse."""
    if api == "native":
        return {"error": {"message": message}}
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}
