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

from dfserve._relay import read_marks
from dfserve.errors import ProtocolError

SIM_CHUNK_SENT_KEY = "dfserve_sim_chunk_sent_unix_s"
"""meta_info key, written only by dfserve's simulator, with the wall-clock time it sent each chunk of a stream."""

SIM_CHUNK_DUE_KEY = "dfserve_sim_chunk_due_unix_s"
"""Beside SIM_CHUNK_SENT_KEY: when the simulator's model scheduled each chunk; sent minus due is its own lateness."""

SIM_TIMES_COMMENT = b": dfserve-sim-times "
"""Starts the SSE comment a simulated OpenAI stream ends with under --record-chunk-times (its final chunk has no
`meta_info` to carry them): a JSON object with SIM_CHUNK_SENT_KEY, SIM_CHUNK_DUE_KEY and `queue_time`. Comments
are ignored by SSE clients, so the stream stays what an OpenAI client expects."""

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


@dataclass(frozen=True)
class RequestInfo:
    """What a proxy reads from a client's request body before routing it."""

    body: dict[str, Any]
    stream: bool
    user: str | None
    return_meta_info: bool


def inspect_request(body: bytes) -> RequestInfo:
    """Read `stream`, the OpenAI `user` field and `return_meta_info` from a request body (any of the three APIs)."""
    data = _json(body, "request body")
    if not isinstance(data, dict):
        raise ProtocolError("request body: expected a JSON object")
    user = data.get("user")
    return RequestInfo(
        body=data,
        stream=data.get("stream") is True,
        user=user if isinstance(user, str) and user else None,
        return_meta_info=data.get("return_meta_info") is True,
    )


def with_return_meta_info(request: dict[str, Any]) -> bytes:
    """A non-streamed chat request body that also asks SGLang for `meta_info` (the only way to its spec fields)."""
    return json.dumps({**request, "return_meta_info": True}, ensure_ascii=False, separators=(",", ":")).encode()


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
    sim_chunk_due_unix_s: tuple[float, ...] | None = None

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


def _times(value: Any, key: str) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in value):
        raise ProtocolError(f"meta_info.{key}: expected a list of numbers, got {value!r}")
    return tuple(float(x) for x in value)


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
    due = meta.get(SIM_CHUNK_DUE_KEY)
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
        sim_chunk_sent_unix_s=_times(sent, SIM_CHUNK_SENT_KEY),
        sim_chunk_due_unix_s=_times(due, SIM_CHUNK_DUE_KEY),
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


def error_body(message: str, kind: str, code: int) -> bytes:
    """An OpenAI-style error object, `{"error": {"message", "type", "param", "code"}}`, as SGLang's clients read it."""
    error = {"message": message, "type": kind, "param": None, "code": code}
    return json.dumps({"error": error}, ensure_ascii=False, separators=(",", ":")).encode()


def stream_error_events(message: str, kind: str, code: int) -> bytes:
    """The well-formed end of a stream that failed after its first byte: an error event, then `[DONE]`."""
    return b"data: " + error_body(message, kind, code) + b"\n\ndata: [DONE]\n\n"


@dataclass(frozen=True)
class ServerInfo:
    """The `/server_info` fields that shape a run's numbers (the whole document is recorded verbatim beside it)."""

    model_path: str | None
    speculative_algorithm: str | None
    draft_model_path: str | None
    max_running_requests: int | None
    version: str | None
    simulated: bool


def parse_server_info(info: dict[str, Any]) -> ServerInfo:
    def text(key: str) -> str | None:
        value = info.get(key)
        return str(value) if value is not None else None

    running = info.get("max_running_requests")
    return ServerInfo(
        model_path=text("model_path"),
        speculative_algorithm=text("speculative_algorithm"),
        draft_model_path=text("speculative_draft_model_path"),
        max_running_requests=running if isinstance(running, int) and not isinstance(running, bool) else None,
        version=text("version"),
        simulated=bool(info.get(SIM_MARKER_KEY, False)),
    )


def first_model_id(models: Any) -> str | None:
    """The first `id` of a `GET /v1/models` list: the name an OpenAI body must carry."""
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return str(data[0]["id"])
    return None


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


# Byte-level reading of whole events for a relay's hot path: no JSON decoding per chunk. Safe because JSON escapes
# quotes and newlines inside strings, so a key's quoted name followed by a colon only occurs as a key. The reading
# itself is in C (`dfserve._relay.read_marks`), where the relay applies it to every piece it passes on.


@dataclass(frozen=True)
class TokenMarks:
    """JSON keys whose values show a stream's output. `cumulative`: the integer after the last key is a running
    total (native `meta_info` repeats the request's counts in every event); else each key with a non-empty string
    value is one chunk of text (OpenAI deltas)."""

    keys: tuple[bytes, ...]
    cumulative: bool

    def read(self, events: bytes) -> int | None:
        """The last running total in `events` (None if none), or the chunks of text counted in them."""
        return read_marks(events, self.keys, self.cumulative)


NATIVE_TOKENS = TokenMarks((b'"completion_tokens":',), cumulative=True)
CONTENT_CHUNKS = TokenMarks((b'"content":', b'"reasoning_content":', b'"text":'), cumulative=False)
_SPEC_VERIFY_CT = TokenMarks((b'"spec_verify_ct":',), cumulative=True)


def count_content_events(events: bytes) -> int:
    """Streamed chat/completions events in `events` (whole events only) that carry text, reasoning included."""
    return CONTENT_CHUNKS.read(events) or 0


def last_completion_tokens(events: bytes) -> int | None:
    """The cumulative `completion_tokens` of the last native event in `events`, None if none is there."""
    return NATIVE_TOKENS.read(events)


def last_spec_verify_ct(events: bytes) -> int | None:
    """The cumulative `spec_verify_ct` of the last native event in `events` that has one; None where speculative
    decoding is off (SGLang then leaves the key out)."""
    return _SPEC_VERIFY_CT.read(events)


def mentions_usage(events: bytes) -> bool:
    """True when an event in `events` carries a non-null `usage` object (the final chunk with include_usage)."""
    return b'"usage":{' in events or b'"usage": {' in events


def last_data_event(events: bytes) -> str | None:
    """The `data` of the last event in `events` other than `[DONE]` (single-line data, as SGLang sends)."""
    end = len(events)
    while end > 0:
        start = events.rfind(b"\ndata:", 0, end) + 1
        if start == 0 and not events.startswith(b"data:"):
            return None
        line_end = events.find(b"\n", start)
        payload = events[start + 5 : line_end if line_end >= 0 else len(events)].strip()
        if payload != DONE.encode():
            return payload.decode("utf-8", "replace")
        end = start - 1
    return None


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


# ---------------------------------------------------------------------------------------------------------------
# Engine side: requests as an SGLang server reads them and the bodies it answers (used by dfserve's simulator).
# Shapes follow python/sglang/srt/managers/io_struct.py (GenerateReqInput), sampling_params.py (verify),
# entrypoints/http_server.py and entrypoints/openai/{protocol,serving_chat,serving_completions}.py.


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


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON, as SGLang sends it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying a JSON object, as SGLang frames it."""
    return b"data: " + json_bytes(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


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


@dataclass(frozen=True)
class SimStreamTimes:
    """A simulated stream's chunk times (--record-chunk-times): when each chunk was sent and due, and how long the
    request queued; the engine received it at `due_unix_s[0]` minus its prefill minus `queue_time_s`."""

    sent_unix_s: tuple[float, ...]
    due_unix_s: tuple[float, ...]
    queue_time_s: float


def sim_times_comment(times: SimStreamTimes) -> bytes:
    """The SSE comment that carries a simulated OpenAI stream's chunk times, inserted before `data: [DONE]`."""
    return SIM_TIMES_COMMENT + json_bytes({SIM_CHUNK_SENT_KEY: times.sent_unix_s, SIM_CHUNK_DUE_KEY: times.due_unix_s,
                                           "queue_time": times.queue_time_s}) + b"\n\n"


def parse_sim_times_comment(events: bytes) -> SimStreamTimes | None:
    """The chunk times a simulated OpenAI stream ended with, from its last events; None when there are none."""
    start = events.rfind(b"\n" + SIM_TIMES_COMMENT) + 1
    if start == 0 and not events.startswith(SIM_TIMES_COMMENT):
        return None
    end = events.find(b"\n", start)
    payload = events[start + len(SIM_TIMES_COMMENT) : end if end >= 0 else len(events)]
    obj = _event_json(payload.decode("utf-8", "replace"), "sim times comment")
    sent = _times(obj.get(SIM_CHUNK_SENT_KEY), SIM_CHUNK_SENT_KEY)
    due = _times(obj.get(SIM_CHUNK_DUE_KEY), SIM_CHUNK_DUE_KEY)
    queue = _opt_float(obj, "queue_time")
    if sent is None or due is None or queue is None:
        raise ProtocolError("sim times comment: sent, due and queue_time are all required")
    return SimStreamTimes(sent, due, queue)


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
