"""SGLang's wire protocol from the client's side: the one module that knows how to read its JSON.

Request bodies for native `POST /generate` and the OpenAI routes, parsing of their responses (whole or streamed as
server-sent events), the byte-level token marks a relay reads as a stream passes, the content chunks a load
tester reads without decoding them (`plain_events`, `ChunkTemplate`), and acceptance math. No I/O:
callers hand in bytes or decoded JSON and get typed results. The engine's side (requests as SGLang reads them, the
bodies it answers) is the simulator's, in `dfserve.deploy.sim.protocol`, built on the types here.

Field names and shapes follow SGLang 0.5.23's code (``python/sglang/srt/managers/tokenizer_manager.py``,
``_handle_batch_output`` and ``_calculate_spec_decoding_metrics``; ``python/sglang/srt/entrypoints/openai/``).

Acceptance length counts the bonus token: one request's is ``completion_tokens / spec_verify_ct``; over many
requests it is ``sum(completion_tokens) / sum(spec_verify_ct)``, never the mean of per-request ratios.
"""

from __future__ import annotations

import json
import operator
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, islice, repeat
from typing import Any, Literal

from dfserve.errors import ProtocolError
from dfserve.relay_core import read_marks

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


def inspect_request(body: bytes) -> RequestInfo:
    """Read `stream`, the OpenAI `user` field and the flags that ask for spec fields from a request body (any of the
    three APIs)."""
    data = _json(body, "request body")
    if not isinstance(data, dict):
        raise ProtocolError("request body: expected a JSON object")
    user = data.get("user")
    return RequestInfo(
        body=data,
        stream=data.get("stream") is True,
        user=user if isinstance(user, str) and user else None,
        return_meta_info=data.get(RETURN_META_INFO) is True,
        return_spec_tokens_details=data.get(RETURN_SPEC_DETAILS) is True,
    )


def with_spec_details(request: dict[str, Any]) -> bytes:
    """An OpenAI request body that also asks SGLang for the request's spec fields (`RETURN_SPEC_DETAILS`); in ASCII,
    so that text with a lone surrogate (valid JSON escapes, no valid UTF-8) goes on as the client escaped it."""
    return json.dumps({**request, RETURN_SPEC_DETAILS: True}, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------------------------------------
# meta_info


@dataclass(frozen=True)
class FinishReason:
    """SGLang's `finish_reason`: `{"type": "stop"|"length"|"abort", "matched"|"length"|"message": ...}`.

    An abort by the scheduler also carries `status_code` and `err_type` (``FINISH_ABORT.to_json`` in
    ``managers/schedule_batch.py``): one with a status of 400 or more is an error that SGLang reports in band in a
    native stream, as the stream's last chunk (``TokenizerManager._handle_abort_finish_reason``)."""

    kind: str
    matched: str | int | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None

    @property
    def error(self) -> StreamError | None:
        """The in-band error this finish reason is, if it is one: an abort with a status code of 400 or more."""
        if self.kind != "abort" or self.status_code is None or self.status_code < 400:
            return None
        return StreamError(self.message or "Aborted", code=self.status_code, kind=self.err_type)


@dataclass(frozen=True)
class SpecStats:
    """Speculative-decoding fields of a finished request: its native `meta_info`, or the OpenAI routes'
    `sglext.spec_tokens_details` (the same names). SGLang sends them only when the request ran at least one verify
    round (``TokenizerManager._calculate_spec_decoding_metrics``), so `verify_ct` is positive."""

    verify_ct: int
    num_correct_drafts: int | None = None
    num_proposed_drafts: int | None = None
    accept_rate: float | None = None
    correct_drafts_histogram: tuple[int, ...] | None = None
    accept_length: float | None = None
    """SGLang's own `spec_accept_length`: completion tokens over verify rounds."""


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


def _int(obj: dict[str, Any], key: str, default: int | None = None, where: str = "meta_info") -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        if value is None and default is not None:
            return default
        raise ProtocolError(f"{where}.{key}: expected an integer, got {value!r}")
    return value


def _times(value: Any, key: str) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in value):
        raise ProtocolError(f"meta_info.{key}: expected a list of numbers, got {value!r}")
    return tuple(float(x) for x in value)


def _opt_float(obj: dict[str, Any], key: str, where: str = "meta_info") -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{where}.{key}: expected a number, got {value!r}")
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
    status = raw.get("status_code")
    err_type = raw.get("err_type")
    return FinishReason(
        kind=raw["type"],
        matched=raw.get("matched"),
        length=length if isinstance(length, int) else None,
        message=message if isinstance(message, str) else None,
        status_code=status if isinstance(status, int) and not isinstance(status, bool) else None,
        err_type=err_type if isinstance(err_type, str) else None,
    )


def _parse_spec(meta: dict[str, Any], where: str = "meta_info") -> SpecStats | None:
    """Spec fields, old and new names alike; None without a verify round (SGLang then sends none)."""
    if not meta.get("spec_verify_ct"):
        return None
    verify_ct = _int(meta, "spec_verify_ct", where=where)
    correct = meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts"))
    proposed = meta.get("spec_num_proposed_drafts", meta.get("spec_proposed_drafts"))
    histogram = meta.get("spec_correct_drafts_histogram", meta.get("spec_accept_histogram"))
    if histogram is not None and not (
        isinstance(histogram, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in histogram)
    ):
        raise ProtocolError(f"{where}.spec_correct_drafts_histogram: expected a list of integers, got {histogram!r}")
    return SpecStats(
        verify_ct=verify_ct,
        num_correct_drafts=correct if isinstance(correct, int) else None,
        num_proposed_drafts=proposed if isinstance(proposed, int) else None,
        accept_rate=_opt_float(meta, "spec_accept_rate", where),
        correct_drafts_histogram=tuple(histogram) if histogram is not None else None,
        accept_length=_opt_float(meta, "spec_accept_length", where),
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
    """First choice of an OpenAI chat or completions response; `meta` only with `return_meta_info`, `spec` only with
    `return_spec_tokens_details` (and a verify round)."""

    text: str
    finish_reason: FinishReason | None
    usage: Usage | None
    meta: MetaInfo | None
    spec: SpecStats | None = None

    @property
    def acceptance(self) -> tuple[int, SpecStats] | None:
        """Completion tokens and spec fields, from `meta_info` or `sglext`, whichever came; None without either."""
        if self.meta is not None and self.meta.spec is not None:
            return self.meta.completion_tokens, self.meta.spec
        tokens = spec_completion_tokens(self.spec, self.usage)
        return (tokens, self.spec) if tokens is not None and self.spec is not None else None


def _parse_sglext_spec(sglext: Any) -> SpecStats | None:
    """`sglext.spec_tokens_details`: one object, or a list with one per choice (n > 1; the first is read)."""
    if sglext is None:
        return None
    if not isinstance(sglext, dict):
        raise ProtocolError(f"sglext: expected an object, got {sglext!r}")
    details = sglext.get("spec_tokens_details")
    if isinstance(details, list):
        details = details[0] if details else None
    if details is None:
        return None
    if not isinstance(details, dict):
        raise ProtocolError(f"sglext.spec_tokens_details: expected an object, got {details!r}")
    return _parse_spec(details, "sglext.spec_tokens_details")


def spec_completion_tokens(spec: SpecStats | None, usage: Usage | None) -> int | None:
    """The completion tokens behind `sglext.spec_tokens_details` (which does not carry them): the usage's, else
    SGLang's own accept length times the rounds it divided by."""
    if spec is None:
        return None
    if usage is not None:
        return usage.completion_tokens
    return round(spec.accept_length * spec.verify_ct) if spec.accept_length is not None else None


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
        spec=_parse_sglext_spec(data.get("sglext")),
    )


def strip_spec_details(body: bytes) -> bytes:
    """Remove `sglext.spec_tokens_details` from an OpenAI response (asked upstream by a proxy, not by the client),
    and `sglext` with it when nothing else is left in it."""
    data = _json(body, "OpenAI response")
    sglext = data.get("sglext") if isinstance(data, dict) else None
    if isinstance(sglext, dict):
        sglext.pop("spec_tokens_details", None)
        if not sglext:
            del data["sglext"]
    return json_bytes(data)


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
    return json_bytes({"error": {"message": message, "type": kind, "param": None, "code": code}})


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


def plain_events(pieces: Sequence[bytes]) -> tuple[list[str], list[int]] | None:
    """The `data` of every whole event of a body read in `pieces`, and the index of the piece that completed each,
    as `SSEDecoder` fed the same pieces gives them, when the body is framed as SGLang frames it: every event one
    `data: ` line or one comment line, each ended by a blank line, LF only. None for any other framing (CRLF,
    multi-line data, other fields), which `SSEDecoder` reads. One split of the whole body instead of a pass per
    line: raw newlines occur only in the framing, since JSON escapes them inside strings."""
    body = b"".join(pieces)
    if b"\r" in body:
        return None
    lines = body[: body.rfind(b"\n\n") + 2].split(b"\n")  # the bytes after the last blank line are no event yet
    lines.pop()
    events = lines[::2]
    comments = not all(map(bytes.startswith, events, repeat(b"data: ")))
    if any(lines[1::2]) or (comments and not all(map(bytes.startswith, events, repeat((b"data: ", b":"))))):
        return None
    ends = list(map(operator.add, accumulate(map(len, events)), range(2, 2 * len(events) + 2, 2)))
    piece_ends = list(accumulate(map(len, pieces)))
    if ends == piece_ends[: len(ends)]:  # one event a piece, as a server's writes usually arrive
        owners = list(range(len(ends)))
    else:  # the piece that holds an event's last byte
        owners = list(map(bisect_left, repeat(piece_ends), ends))
    if comments:
        kept = [(event, owner) for event, owner in zip(events, owners, strict=True) if not event.startswith(b":")]
        events, owners = [event for event, _ in kept], [owner for _, owner in kept]
    return [event[6:].decode("utf-8", "replace") for event in events], owners


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



def last_spec_verify_ct(events: bytes) -> int | None:
    """The cumulative `spec_verify_ct` of the last native event in `events` that has one; None where speculative
    decoding is off (SGLang then leaves the key out)."""
    return _SPEC_VERIFY_CT.read(events)


_IN_BAND_ERROR = (b'"error":', b'"status_code":')
"""Keys that occur in a stream's events only where it reports an error in band: an error event, or (native) a final
chunk whose abort carries a status. JSON escapes quotes inside strings, so generated text cannot contain them."""


def native_stream_error(events: bytes) -> StreamError | None:
    """The in-band error a native stream ended with, read from its last events; None when it ended well.

    SGLang 0.5.23 answers a streamed `/generate` that fails validation with HTTP 200, then
    `data: {"error": {"message", "type", "code", "retryable"}}`, then `data: [DONE]` (``http_server.generate_request``,
    ``stream_results``); an abort with a status after the stream started is its last chunk, whose `finish_reason`
    carries the status (``TokenizerManager._handle_abort_finish_reason``). Two byte searches settle the usual case
    without decoding JSON.
    """
    if not any(key in events for key in _IN_BAND_ERROR):
        return None
    for data in reversed(SSEDecoder().feed(events)):
        if data == DONE:
            continue
        event = parse_native_event(data)
        if isinstance(event, StreamError):
            return event
        return event.meta.finish_reason.error if event.meta.finish_reason is not None else None
    return None


@dataclass(frozen=True)
class OpenAIStreamEnd:
    """What the last events of a chat/completions stream show: an in-band error, the usage chunk, the spec details."""

    error: StreamError | None = None
    usage: Usage | None = None
    spec: SpecStats | None = None


_OPENAI_END_KEYS = ('"error":', '"usage":{', '"usage": {', '"sglext":')


def openai_stream_end(events: bytes) -> OpenAIStreamEnd:
    """Read a chat/completions stream's last events; only those that may carry an error, usage or `sglext` are
    decoded. After an error event SGLang still sends the usage chunk (with include_usage) and `[DONE]`
    (``OpenAIServingChat._generate_chat_stream``)."""
    error, usage, spec = None, None, None
    for data in SSEDecoder().feed(events):
        if data == DONE or not any(key in data for key in _OPENAI_END_KEYS):
            continue
        event = parse_openai_event(data)
        if isinstance(event, StreamError):
            error = event
            continue
        usage = event.usage or usage
        spec = event.spec or spec
    return OpenAIStreamEnd(error, usage, spec)


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
    """An error SGLang reports inside a 200 stream: an error event (native `{"error": {"message", "type", "code",
    "retryable"}}`; OpenAI routes `{"error": {"object": "error", "message", "type", "param", "code"}}`), or a native
    final chunk whose abort carries a status (`FinishReason.error`)."""

    message: str
    code: int | None = None
    """The HTTP status SGLang would have answered (400 for validation, 503 for a retraction without backup, ...)."""
    kind: str | None = None
    retryable: bool | None = None


def _stream_error(obj: dict[str, Any]) -> StreamError | None:
    error = obj.get("error")
    if isinstance(error, str):
        return StreamError(error)
    if not isinstance(error, dict):
        if obj.get("object") != "error":
            return None
        error = obj
    message, code, kind, retryable = (error.get(k) for k in ("message", "code", "type", "retryable"))
    return StreamError(
        message=message if isinstance(message, str) else json.dumps(error),
        code=code if isinstance(code, int) and not isinstance(code, bool) else None,
        kind=kind if isinstance(kind, str) else None,
        retryable=retryable if isinstance(retryable, bool) else None,
    )


def parse_native_event(data: str) -> NativeChunk | StreamError:
    obj = _event_json(data, "/generate stream")
    error = _stream_error(obj)
    if error is not None:
        return error
    if "meta_info" not in obj:
        raise ProtocolError("/generate stream: event without 'meta_info'")
    text = obj.get("text", "")
    return NativeChunk(text=text if isinstance(text, str) else "", meta=parse_meta_info(obj["meta_info"]))


@dataclass(frozen=True)
class OpenAIChunk:
    """One streamed chat/completions event: the first choice's delta text, finish reason, and usage or spec details
    (`sglext`) if present."""

    text: str
    finish_reason: FinishReason | None
    usage: Usage | None
    has_choice: bool
    spec: SpecStats | None = None


def parse_openai_event(data: str) -> OpenAIChunk | StreamError:
    obj = _event_json(data, "OpenAI stream")
    error = _stream_error(obj)
    if error is not None:
        return error
    choices = obj.get("choices") or []
    text = ""
    finish = None
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        text = content if isinstance(content, str) else ""
        finish = parse_finish_reason(choice.get("finish_reason"))
    return OpenAIChunk(text=text, finish_reason=finish, usage=_parse_usage(obj.get("usage")), has_choice=bool(choices),
                       spec=_parse_sglext_spec(obj.get("sglext")))


def _once(data: str, key: str) -> int:
    """Where the value of `key` starts when it occurs once in `data`; -1 when it does not occur or more often."""
    at = data.find(key)
    return at + len(key) if at >= 0 and data.find(key, at + 1) < 0 else -1


_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
"""How json.loads reads a string from its opening quote on (in C): its value and where it ends; typeshed omits it."""


@dataclass(slots=True)
class ChunkTemplate:
    """Reads the delta text of OpenAI chunk events without decoding them: an event that is an earlier chunk
    (decoded whole, carrying nothing but its delta text) with another content string decodes to that chunk with
    this content, so only the string is decoded. A stream's content chunks differ only in their content, so one
    chunk decoded whole serves the rest; any other event (the role chunk, the finish reason, usage, spec fields,
    an error) does not fit and is decoded whole by `parse_openai_event`."""

    prefix: str = ""
    """The template up to its content string's opening quote; empty until `learn` found one."""
    suffix: str = ""
    """The template from its content string's closing quote on, the quote left out."""

    def read(self, events: Sequence[str], start: int) -> list[str]:
        """The delta texts of the events from `start` on that fit the template, up to the first that does not (to be
        decoded whole)."""
        prefix, suffix, at, scan = self.prefix, self.suffix, len(self.prefix), _scanstring
        texts: list[str] = []
        if not prefix:
            return texts
        for data in islice(events, start, None):
            if not data.startswith(prefix):
                break
            try:
                text, end = scan(data, at)
            except json.JSONDecodeError:
                break
            if end + len(suffix) != len(data) or not data.endswith(suffix):
                break
            texts.append(text)
        return texts

    def learn(self, data: str, event: OpenAIChunk) -> None:
        """Take `data`, decoded whole as `event`, as the template when it carries nothing but a delta text: then
        that text is the string value of its only `"content"` key (a delta's; a completion's `text` is not read)."""
        if (not event.text or event.finish_reason is not None or event.usage is not None or event.spec is not None
                or '"text":' in data):
            return
        at = _once(data, '"content":')
        if at < 0 or not data.startswith('"', at):
            return
        text, end = _scanstring(data, at + 1)
        if text == event.text:
            self.prefix, self.suffix = data[: at + 1], data[end:]


# ---------------------------------------------------------------------------------------------------------------
# Acceptance math


def accept_length(completion_tokens: int, verify_ct: int) -> float | None:
    """One request's acceptance length; None when no verify round ran (nothing to divide by)."""
    if verify_ct <= 0:
        return None
    return completion_tokens / verify_ct



def estimated_accept_length(completion_tokens: int, content_chunks: int) -> float | None:
    """Tokens per content chunk, for an OpenAI stream without spec details: an estimate, labelled as such. None for
    a request of one token: it ran no verify round (SGLang 0.5.23 then sends no spec details even when asked), so
    there is no acceptance to estimate, and its 1.0 would pull a run's figure down."""
    if completion_tokens <= 1:
        return None
    return accept_length(completion_tokens, content_chunks)


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON, as SGLang sends it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class SimStreamTimes:
    """A simulated stream's chunk times (--record-chunk-times): when each chunk was sent and due, and how long the
    request queued; the engine received it at `due_unix_s[0]` minus its prefill minus `queue_time_s`."""

    sent_unix_s: tuple[float, ...]
    due_unix_s: tuple[float, ...]
    queue_time_s: float


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
