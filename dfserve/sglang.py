"""SGLang's wire protocol: the one module that knows its JSON.

Request bodies for native `POST /generate` and the OpenAI routes, parsing of their responses (whole or streamed as
server-sent events), and acceptance math. No I/O: callers hand in bytes or decoded JSON and get typed results.

Field names and shapes follow SGLang's code (``python/sglang/srt/managers/tokenizer_manager.py``,
``_handle_batch_output`` and ``_calculate_spec_decoding_metrics``; ``python/sglang/srt/entrypoints/openai/``).

Acceptance length counts the bonus token: one request's is ``completion_tokens / spec_verify_ct``; over many
requests it is ``sum(completion_tokens) / sum(spec_verify_ct)``, never the mean of per-request ratios.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dfserve.errors import ProtocolError

SIM_CHUNK_SENT_KEY = "dfserve_sim_chunk_sent_unix_s"
"""meta_info key, written only by dfserve's simulator, with the wall-clock time it sent each chunk of a stream."""

SIM_MARKER_KEY = "dfserve_simulated"
"""Key in `/server_info` (and every simulated `meta_info`) that marks an engine as dfserve's simulator."""

Api = Literal["native", "chat", "completions"]
ROUTES: dict[str, str] = {"native": "/generate", "chat": "/v1/chat/completions", "completions": "/v1/completions"}


# ---------------------------------------------------------------------------------------------------------------
# Request bodies


@dataclass(frozen=True)
class SamplingParams:
    """The sampling settings dfserve sends; they shape every figure, so runs record them."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def native(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.ignore_eos:
            params["ignore_eos"] = True
        return params

    def openai(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_tokens": self.max_new_tokens,
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


def chat_body(
    model: str,
    messages: Sequence[dict[str, Any]],
    sampling: SamplingParams,
    *,
    stream: bool,
    return_meta_info: bool = False,
    include_usage: bool = False,
) -> dict[str, Any]:
    """Body of `POST /v1/chat/completions`; `return_meta_info` is refused by SGLang when streaming."""
    if stream and return_meta_info:
        raise ValueError("SGLang refuses return_meta_info with streaming")
    body: dict[str, Any] = {"model": model, "messages": list(messages), "stream": stream, **sampling.openai()}
    if return_meta_info:
        body["return_meta_info"] = True
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def completions_body(
    model: str, prompt: str, sampling: SamplingParams, *, stream: bool, include_usage: bool = False
) -> dict[str, Any]:
    """Body of `POST /v1/completions`."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "stream": stream, **sampling.openai()}
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


# ---------------------------------------------------------------------------------------------------------------
# meta_info


@dataclass(frozen=True)
class FinishReason:
    """SGLang's `finish_reason`: `{"type": "stop"|"length"|"abort", "matched"|"length"|"message": ...}`."""

    kind: str
    matched: str | int | None = None
    length: int | None = None
    message: str | None = None


@dataclass(frozen=True)
class SpecStats:
    """Speculative-decoding fields of a finished request's meta_info."""

    verify_ct: int
    num_correct_drafts: int | None = None
    num_proposed_drafts: int | None = None
    accept_rate: float | None = None
    correct_drafts_histogram: tuple[int, ...] | None = None


@dataclass(frozen=True)
class MetaInfo:
    """SGLang's per-request `meta_info`, typed. Spec fields and `e2e_latency` exist only once finished."""

    id: str | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    e2e_latency_s: float | None = None
    queue_time_s: float | None = None
    weight_version: str | None = None
    spec: SpecStats | None = None
    simulated: bool = False
    sim_chunk_sent_unix_s: tuple[float, ...] | None = None

    @property
    def accept_length(self) -> float | None:
        """Tokens per verify round (bonus included); None when the server ran without speculation."""
        if self.spec is None:
            return None
        return accept_length(self.completion_tokens, self.spec.verify_ct)


def _int(obj: dict[str, Any], key: str, default: int | None = None) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        if value is None and default is not None:
            return default
        raise ProtocolError(f"meta_info.{key}: expected an integer, got {value!r}")
    return value


def _opt_float(obj: dict[str, Any], key: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"meta_info.{key}: expected a number, got {value!r}")
    return float(value)


def parse_finish_reason(raw: Any) -> FinishReason | None:
    """Native finish_reason is a dict; OpenAI's is a plain string. Both map to one type."""
    if raw is None:
        return None
    if isinstance(raw, str):
        return FinishReason(kind=raw)
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ProtocolError(f"finish_reason: expected an object with a 'type', got {raw!r}")
    length = raw.get("length")
    message = raw.get("message")
    return FinishReason(
        kind=raw["type"],
        matched=raw.get("matched"),
        length=length if isinstance(length, int) else None,
        message=message if isinstance(message, str) else None,
    )


def _parse_spec(meta: dict[str, Any]) -> SpecStats | None:
    if meta.get("spec_verify_ct") is None:
        return None
    verify_ct = _int(meta, "spec_verify_ct")
    correct = meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts"))
    proposed = meta.get("spec_num_proposed_drafts", meta.get("spec_proposed_drafts"))
    histogram = meta.get("spec_correct_drafts_histogram", meta.get("spec_accept_histogram"))
    if histogram is not None and not (
        isinstance(histogram, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in histogram)
    ):
        raise ProtocolError(f"meta_info.spec_correct_drafts_histogram: expected a list of integers, got {histogram!r}")
    return SpecStats(
        verify_ct=verify_ct,
        num_correct_drafts=correct if isinstance(correct, int) else None,
        num_proposed_drafts=proposed if isinstance(proposed, int) else None,
        accept_rate=_opt_float(meta, "spec_accept_rate"),
        correct_drafts_histogram=tuple(histogram) if histogram is not None else None,
    )


def parse_meta_info(meta: Any) -> MetaInfo:
    """Type one `meta_info` object, old and new spec field names alike."""
    if not isinstance(meta, dict):
        raise ProtocolError(f"meta_info: expected an object, got {type(meta).__name__}")
    sent = meta.get(SIM_CHUNK_SENT_KEY)
    raw_id = meta.get("id")
    weight_version = meta.get("weight_version")
    return MetaInfo(
        id=str(raw_id) if raw_id is not None else None,
        finish_reason=parse_finish_reason(meta.get("finish_reason")),
        prompt_tokens=_int(meta, "prompt_tokens"),
        completion_tokens=_int(meta, "completion_tokens"),
        cached_tokens=_int(meta, "cached_tokens", 0),
        e2e_latency_s=_opt_float(meta, "e2e_latency"),
        queue_time_s=_opt_float(meta, "queue_time"),
        weight_version=str(weight_version) if weight_version is not None else None,
        spec=_parse_spec(meta),
        simulated=bool(meta.get(SIM_MARKER_KEY, False)),
        sim_chunk_sent_unix_s=tuple(float(x) for x in sent) if isinstance(sent, list) else None,
    )


# ---------------------------------------------------------------------------------------------------------------
# Whole (non-streamed) responses


def _json(body: bytes | str | Any, what: str) -> Any:
    if not isinstance(body, bytes | str):
        return body
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"{what}: invalid JSON ({exc})") from None


@dataclass(frozen=True)
class GenerateResult:
    """One prompt's answer from native `/generate`."""

    text: str
    meta: MetaInfo
    output_ids: tuple[int, ...] | None = None


def parse_generate_response(body: bytes | str | Any) -> list[GenerateResult]:
    """Native `/generate` answers an object for one prompt and a list for a batch; both come back as a list."""
    data = _json(body, "/generate response")
    items = data if isinstance(data, list) else [data]
    results = []
    for item in items:
        if not isinstance(item, dict) or "meta_info" not in item:
            raise ProtocolError("/generate response: expected an object with 'text' and 'meta_info'")
        text = item.get("text", "")
        if not isinstance(text, str):
            raise ProtocolError(f"/generate response: 'text' must be a string, got {type(text).__name__}")
        ids = item.get("output_ids")
        results.append(
            GenerateResult(
                text=text,
                meta=parse_meta_info(item["meta_info"]),
                output_ids=tuple(ids) if isinstance(ids, list) else None,
            )
        )
    return results


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


def _parse_usage(raw: Any) -> Usage | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError(f"usage: expected an object, got {raw!r}")
    return Usage(prompt_tokens=_int(raw, "prompt_tokens", 0), completion_tokens=_int(raw, "completion_tokens", 0))


@dataclass(frozen=True)
class OpenAIResult:
    """First choice of an OpenAI chat or completions response; `meta` only with `return_meta_info`."""

    text: str
    finish_reason: FinishReason | None
    usage: Usage | None
    meta: MetaInfo | None


def parse_openai_response(body: bytes | str | Any) -> OpenAIResult:
    """A whole `/v1/chat/completions` or `/v1/completions` response (first choice)."""
    data = _json(body, "OpenAI response")
    if not isinstance(data, dict):
        raise ProtocolError("OpenAI response: expected an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ProtocolError("OpenAI response: expected a non-empty 'choices' list")
    choice = choices[0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    meta = choice.get("meta_info")
    return OpenAIResult(
        text=text if isinstance(text, str) else "",
        finish_reason=parse_finish_reason(choice.get("finish_reason")),
        usage=_parse_usage(data.get("usage")),
        meta=parse_meta_info(meta) if meta is not None else None,
    )


def strip_meta_info(body: bytes) -> bytes:
    """Remove `meta_info` from each choice of an OpenAI response (added upstream by a proxy, not asked by the client)."""
    data = _json(body, "OpenAI response")
    if isinstance(data, dict) and isinstance(data.get("choices"), list):
        for choice in data["choices"]:
            if isinstance(choice, dict):
                choice.pop("meta_info", None)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def parse_error_message(body: bytes | str) -> str:
    """The human-readable message of an SGLang/OpenAI error body, or the raw text when it has none."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
        if isinstance(data.get("message"), str):
            return data["message"]
    return text.strip()[:500]


# ---------------------------------------------------------------------------------------------------------------
# Server-sent events


DONE = "[DONE]"


class SSEDecoder:
    """Incremental server-sent-events decoder: feed it bytes as they arrive, get each event's `data`.

    Handles events split across reads, `\\r\\n` line endings, comment lines (keep-alives such as `: ping`),
    multi-line data, and fields other than `data`. Returns the `[DONE]` sentinel as the string `DONE`.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return events
            line = self._buffer[:newline]
            self._buffer = self._buffer[newline + 1 :]
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b":"):
                continue
            name, _, value = line.partition(b":")
            if name == b"data":
                self._data.append(value.removeprefix(b" ").decode("utf-8", "replace"))

    @property
    def pending(self) -> bool:
        """True when bytes of an unfinished event remain (a stream cut mid-event)."""
        return bool(self._buffer.strip()) or bool(self._data)


def _event_json(data: str, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"{what}: invalid JSON in SSE data ({exc})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: SSE data is not an object")
    return obj


@dataclass(frozen=True)
class NativeChunk:
    """One streamed `/generate` event: text (cumulative unless incremental output is on) and cumulative counts."""

    text: str
    meta: MetaInfo


@dataclass(frozen=True)
class StreamError:
    """An error event inside a stream (SGLang sends `{"error": {...}}` as data when a request fails mid-stream)."""

    message: str


def parse_native_event(data: str) -> NativeChunk | StreamError:
    obj = _event_json(data, "/generate stream")
    if "error" in obj:
        return StreamError(message=parse_error_message(data))
    if "meta_info" not in obj:
        raise ProtocolError("/generate stream: event without 'meta_info'")
    text = obj.get("text", "")
    return NativeChunk(text=text if isinstance(text, str) else "", meta=parse_meta_info(obj["meta_info"]))


@dataclass(frozen=True)
class OpenAIChunk:
    """One streamed chat/completions event: the first choice's delta text, finish reason, and usage if present."""

    text: str
    finish_reason: FinishReason | None
    usage: Usage | None
    has_choice: bool


def parse_openai_event(data: str) -> OpenAIChunk | StreamError:
    obj = _event_json(data, "OpenAI stream")
    if "error" in obj or obj.get("object") == "error":
        return StreamError(message=parse_error_message(data))
    choices = obj.get("choices") or []
    text = ""
    finish = None
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        text = content if isinstance(content, str) else ""
        finish = parse_finish_reason(choice.get("finish_reason"))
    return OpenAIChunk(text=text, finish_reason=finish, usage=_parse_usage(obj.get("usage")), has_choice=bool(choices))


# ---------------------------------------------------------------------------------------------------------------
# Acceptance math


def accept_length(completion_tokens: int, verify_ct: int) -> float | None:
    """One request's acceptance length; None when no verify round ran (nothing to divide by)."""
    if verify_ct <= 0:
        return None
    return completion_tokens / verify_ct


def round_token_deltas(cumulative_completion_tokens: Iterable[int]) -> list[int]:
    """Tokens each stream chunk added, from the cumulative `completion_tokens` of successive native chunks.

    The first delta is the prefill token (plus whatever the first round added if chunks were merged); with SGLang's
    default stream interval each later delta is one verify round's accepted tokens, bonus included. Chunks that
    added nothing (a detokenizer flush) are dropped.
    """
    deltas = []
    previous = 0
    for cumulative in cumulative_completion_tokens:
        if cumulative < previous:
            raise ProtocolError(f"completion_tokens went backwards in a stream: {previous} -> {cumulative}")
        if cumulative > previous:
            deltas.append(cumulative - previous)
        previous = cumulative
    return deltas


@dataclass(frozen=True)
class AcceptanceTotals:
    """Sums that aggregate acceptance exactly: Σ completion_tokens / Σ spec_verify_ct."""

    completion_tokens: int = 0
    verify_ct: int = 0
    requests: int = 0

    def add(self, completion_tokens: int, verify_ct: int) -> AcceptanceTotals:
        return AcceptanceTotals(self.completion_tokens + completion_tokens, self.verify_ct + verify_ct, self.requests + 1)

    @property
    def accept_length(self) -> float | None:
        return accept_length(self.completion_tokens, self.verify_ct)


def aggregate_accept_length(pairs: Iterable[tuple[int, int]]) -> float | None:
    """Σ completion_tokens / Σ spec_verify_ct over (completion_tokens, verify_ct) pairs; None without data."""
    totals = AcceptanceTotals()
    for completion_tokens, verify_ct in pairs:
        totals = totals.add(completion_tokens, verify_ct)
    return totals.accept_length


@dataclass(frozen=True)
class ChatAcceptanceEstimate:
    """Streamed chat exposes no spec fields: tokens per content chunk is an estimate, labelled as such."""

    completion_tokens: int
    content_chunks: int
    estimated: bool = field(default=True, init=False)

    @property
    def accept_length(self) -> float | None:
        return accept_length(self.completion_tokens, self.content_chunks)
