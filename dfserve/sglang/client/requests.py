"""Request bodies dfserve sends (native `/generate`, the OpenAI routes), and what a proxy reads from a client's."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dfserve.errors import ProtocolError
from dfserve.sglang.wire import decode_json, lax_bool

Api = Literal["native", "chat", "completions"]


ROUTES: dict[str, str] = {"native": "/generate", "chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class SamplingParams:
    """The sampling settings dfserve sends; they shape every figure, so runs record them."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def native(self) -> dict[str, Any]:
        """`sampling_params` of native `/generate`."""
        return self._params("max_new_tokens")

    def openai(self) -> dict[str, Any]:
        """Top-level sampling fields of an OpenAI body (SGLang accepts `ignore_eos` there too)."""
        return self._params("max_tokens")

    def _params(self, max_tokens_key: str) -> dict[str, Any]:
        params: dict[str, Any] = {
            max_tokens_key: self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.ignore_eos:
            params["ignore_eos"] = True
        return params


def generate_body(
    text: str, sampling: SamplingParams, *, stream: bool, rid: str | None = None
) -> dict[str, Any]:
    """Body of native `POST /generate` for one prompt."""
    body: dict[str, Any] = {"text": text, "sampling_params": sampling.native(), "stream": stream}
    if rid is not None:
        body["rid"] = rid
    return body


def generate_ids_body(input_ids: Sequence[int], sampling: SamplingParams) -> dict[str, Any]:
    """Body of native `POST /generate` for one tokenized prompt; the answer carries `output_ids`, so no text is
    tokenized twice (offline references are token ids, not text)."""
    return {"input_ids": list(input_ids), "sampling_params": sampling.native(), "stream": False}


def chat_body(
    model: str,
    messages: Sequence[dict[str, Any]],
    sampling: SamplingParams,
    *,
    stream: bool,
    return_meta_info: bool = False,
    return_spec_tokens_details: bool = False,
    include_usage: bool = False,
) -> dict[str, Any]:
    """Body of `POST /v1/chat/completions`; `return_meta_info` is refused by SGLang when streaming, while
    `return_spec_tokens_details` gives a request's spec fields streamed or not (SGLang 0.5.23)."""
    if stream and return_meta_info:
        raise ValueError("SGLang refuses return_meta_info with streaming")
    body: dict[str, Any] = {"model": model, "messages": list(messages), "stream": stream, **sampling.openai()}
    if return_meta_info:
        body[RETURN_META_INFO] = True
    if return_spec_tokens_details:
        body[RETURN_SPEC_DETAILS] = True
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def completions_body(
    model: str,
    prompt: str,
    sampling: SamplingParams,
    *,
    stream: bool,
    return_spec_tokens_details: bool = False,
    include_usage: bool = False,
) -> dict[str, Any]:
    """Body of `POST /v1/completions` for one prompt."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "stream": stream, **sampling.openai()}
    if return_spec_tokens_details:
        body[RETURN_SPEC_DETAILS] = True
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


RETURN_META_INFO = "return_meta_info"
"""Non-streamed chat: the whole native `meta_info` on each choice (``ChatCompletionRequest.return_meta_info``)."""


RETURN_SPEC_DETAILS = "return_spec_tokens_details"
"""Chat and completions, streamed or not: a request's spec fields in `sglext.spec_tokens_details`
(``CompletionRequest``/``ChatCompletionRequest.return_spec_tokens_details`` in ``entrypoints/openai/protocol.py``;
in a stream, an extra chunk with `choices: []` before the usage chunk, ``OpenAIServingChat._generate_chat_stream``)."""


SPEC_DETAILS_KEY = b'"spec_tokens_details":'
"""The key a relay cuts from a stream whose client did not ask for spec details (`EventRelay`'s `strip`). SGLang
0.5.23 puts them only in `sglext`, and `sglext` only in one chunk with `choices: []` and `"usage":null` before the
usage chunk, beside the other `sglext` fields the request asked for (routed experts, cached-token details, token
ids); with none of those the chunk is sent for the spec details alone, and goes whole
(``_generate_chat_stream``, ``OpenAIServingCompletion._generate_completion_stream``)."""


@dataclass(frozen=True)
class RequestInfo:
    """What a proxy reads from a client's request body before routing it."""

    body: dict[str, Any]
    stream: bool
    user: str | None
    return_meta_info: bool
    return_spec_tokens_details: bool


def asks_several_outputs(body: Mapping[str, Any]) -> bool:
    """A native `/generate` body that asks for several outputs (`sampling_params.n` above 1, or a batch of prompts):
    SGLang interleaves their events in one stream, each with its own running counts."""
    params, ids = body.get("sampling_params"), body.get("input_ids")
    n = params.get("n") if isinstance(params, dict) else None
    return ((isinstance(n, int) and not isinstance(n, bool) and n > 1) or isinstance(params, list)
            or isinstance(body.get("text"), list) or (isinstance(ids, list) and any(isinstance(i, list) for i in ids)))


def inspect_request(body: bytes) -> RequestInfo:
    """Read `stream`, the OpenAI `user` field and the flags that ask for spec fields from a request body (any of the
    three APIs); the spec details flag as SGLang's OpenAI models read it (`"true"` asks too)."""
    data = decode_json(body, "request body")
    if not isinstance(data, dict):
        raise ProtocolError("request body: expected a JSON object")
    user = data.get("user")
    return RequestInfo(
        body=data,
        stream=data.get("stream") is True,
        user=user if isinstance(user, str) and user else None,
        return_meta_info=data.get(RETURN_META_INFO) is True,
        return_spec_tokens_details=lax_bool(data.get(RETURN_SPEC_DETAILS)) is True,
    )


def without_request_id(request: dict[str, Any], spec_details: bool) -> bytes | None:
    """A copy of a request for another replica, less the client's `rid` (SGLang refuses a second request of one id,
    and an arm sharing a server, or its ids, with the first would fail for it), asking for the spec fields where
    `spec_details`; None when the request names no id."""
    if "rid" not in request:
        return None
    copied = {key: value for key, value in request.items() if key != "rid"}
    return with_spec_details(copied) if spec_details else json.dumps(copied, separators=(",", ":")).encode()


def with_spec_details(request: dict[str, Any]) -> bytes:
    """An OpenAI request body that also asks SGLang for the request's spec fields (`RETURN_SPEC_DETAILS`); in ASCII,
    so that text with a lone surrogate (valid JSON escapes, no valid UTF-8) goes on as the client escaped it."""
    return json.dumps({**request, RETURN_SPEC_DETAILS: True}, separators=(",", ":")).encode()
