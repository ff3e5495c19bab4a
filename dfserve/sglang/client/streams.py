"""Streamed answers as server-sent events: the decoder, the byte-level token marks a relay reads as a stream
passes, the content chunks a load tester reads without decoding them, and the in-band errors and ends of a stream."""

from __future__ import annotations

import json
import operator
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, islice, repeat

from dfserve.errors import ProtocolError
from dfserve.relay_core import read_marks
from dfserve.sglang.client.meta import (
    FinishReason,
    MetaInfo,
    SpecStats,
    StreamError,
    parse_finish_reason,
    parse_meta_info,
    stream_error,
)
from dfserve.sglang.client.responses import (
    Usage,
    choice_index,
    generated_text,
    parse_sglext_spec,
    parse_usage,
)
from dfserve.sglang.wire import DONE, MAX_GENERATED, event_json, int_field

_BOM = b"\xef\xbb\xbf"


class SSEDecoder:
    """Incremental server-sent-events decoder: feed it bytes as they arrive, get each event's `data`.

    Handles events split across reads, `\\r\\n` line endings, comment lines (keep-alives such as `: ping`),
    multi-line data, fields other than `data`, and a byte order mark that starts the stream (which the SSE standard
    drops). Returns the `[DONE]` sentinel as the string `DONE`. Each byte is searched for a line's end once, however
    many reads a long event comes in.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._scanned = 0
        """Bytes at the buffer's start known to hold no line's end."""
        self._started = False
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        buffer = self._buffer
        buffer += chunk
        if not self._started:
            if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
                return []  # perhaps the start of one
            self._started = True
            if buffer.startswith(_BOM):
                del buffer[: len(_BOM)]
        events: list[str] = []
        start = 0
        while True:
            newline = buffer.find(b"\n", max(start, self._scanned))
            if newline < 0:
                del buffer[:start]
                self._scanned = len(buffer)
                return events
            line = bytes(buffer[start:newline])
            start = newline + 1
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


NATIVE_OUTPUTS = TokenMarks((b'"text":',), cumulative=False)
"""A native stream of several outputs (`asks_several_outputs`): each event with text is a chunk. Their running
totals are each output's own, interleaved, which a relay reading one total cannot add up."""


CONTENT_CHUNKS = TokenMarks((b'"content":', b'"reasoning_content":', b'"text":', b'"name":', b'"arguments":'),
                            cumulative=False)
"""The keys of an OpenAI event's generated text (`generated_text`): a tool call's function name and arguments are
generated too (an event's `"name"` is only ever a function's)."""


_SPEC_VERIFY_CT = TokenMarks((b'"spec_verify_ct":',), cumulative=True)


def last_spec_verify_ct(events: bytes) -> int | None:
    """The cumulative `spec_verify_ct` of the last native event in `events` that has one; None where speculative
    decoding is off (SGLang then leaves the key out)."""
    return _SPEC_VERIFY_CT.read(events)


_IN_BAND_ERROR = (b'"error":', b'"status_code":', b'"type":"abort"')
"""Keys that occur in a stream's events only where it reports an error in band: an error event, or (native) a final
chunk whose finish reason is an abort. JSON escapes quotes inside strings, so generated text cannot contain them."""


def ends_with_done(events: bytes) -> bool:
    """Whether the last event of `events` (whole events) is `[DONE]`, as `SSEDecoder` reads events: by their `data`
    lines, comments and blocks without data aside. SGLang ends every stream with it, one that failed in band too:
    a stream whose body ends without it was cut short, however well its framing ends. Read from the end, without
    copying a native stream's long last event."""
    end = len(events)
    while True:
        while end and events[end - 1] in b"\r\n":
            end -= 1
        if not end:
            return False
        lf, crlf = events.rfind(b"\n\n", 0, end), events.rfind(b"\n\r\n", 0, end)
        start = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
        data = [line.rstrip(b"\r") for line in events[start:end].split(b"\n") if line.startswith(b"data:")]
        if data:
            return data in ([b"data: [DONE]"], [b"data:[DONE]"])
        end = start


def ends_whole(tail: bytes) -> bool:
    """Whether a stream's last bytes (`tail`, any amount of it holding its `[DONE]`) end it whole: `[DONE]` the last
    event, and nothing after its blank line but whitespace or whole comments (half an event after it is a cut)."""
    lf, crlf = tail.rfind(b"\n\n"), tail.rfind(b"\n\r\n")
    end = max(lf + 2 if lf >= 0 else -1, crlf + 3 if crlf >= 0 else -1)
    return end > 0 and not tail[end:].strip() and ends_with_done(tail[:end])


def native_stream_error(events: bytes) -> StreamError | None:
    """The in-band error a native stream ended with, read from its last events; None when it ended well.

    SGLang 0.5.23 answers a streamed `/generate` that fails validation with HTTP 200, then
    `data: {"error": {"message", "type", "code", "retryable"}}`, then `data: [DONE]` (``http_server.generate_request``,
    ``stream_results``); an abort after the stream started is its last chunk, whose `finish_reason` is the abort,
    with the status it carries if any (``TokenizerManager._handle_abort_finish_reason``; none after
    `/abort_request`). Byte searches settle the usual case without decoding JSON.
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


NATIVE_ALARM = _IN_BAND_ERROR
"""What marks a native event as one a stream of several outputs is read with wherever it came (`EventRelay.alarmed`):
an output's error or abort, after which SGLang goes on streaming the other outputs."""


def native_outputs_error(events: bytes) -> StreamError | None:
    """The first in-band error among the events of a native stream of several outputs (each ends with its own
    finish reason); None when every output ended well."""
    if not any(key in events for key in _IN_BAND_ERROR):
        return None
    for data in SSEDecoder().feed(events):
        if data == DONE:
            continue
        event = parse_native_event(data)
        if isinstance(event, StreamError):
            return event
        if event.meta.finish_reason is not None and event.meta.finish_reason.error is not None:
            return event.meta.finish_reason.error
    return None


@dataclass(frozen=True)
class OpenAIStreamEnd:
    """What the last events of a chat/completions stream show: an in-band error, the usage chunk, the spec details."""

    error: StreamError | None = None
    usage: Usage | None = None
    spec: SpecStats | None = None
    finished: bool = False
    """A choice's finish reason came (read with the alarm's pieces: `OPENAI_FINISH_ALARM`): a stream of one choice
    without one did not end as SGLang ends one, whatever `[DONE]` says."""


OPENAI_ALARM = (b'"error":', b'"finish_reason":"abort"', b'"finish_reason": "abort"', b'"spec_tokens_details":')
"""What marks an OpenAI stream's event as one its end is read with, wherever it came: an error or an abort, which
SGLang follows with closing chunks (the usage chunk, spec details) and `[DONE]`, and the spec details, which SGLang
writes before the usage chunk and `[DONE]`. Those may come in reads of their own and push it out of a stream's last
pieces, so a relay keeps the pieces it occurs in (`EventRelay.alarmed`: the first and the latest) to be read with
them (`openai_stream_end`)."""

OPENAI_FINISH_ALARM = (*OPENAI_ALARM, b'"finish_reason":"', b'"finish_reason": "')
"""`OPENAI_ALARM` and any finish reason, for a stream of one choice: its finish (or its error) is the first piece the
relay keeps. Not for several choices: one's `stop` would hold the first place, and another's abort, in the latest,
could be pushed out by a later finish."""

_OPENAI_END_KEYS = (*(key.decode() for key in OPENAI_FINISH_ALARM), '"usage":{', '"usage": {', '"sglext":')


def openai_stream_end(events: bytes) -> OpenAIStreamEnd:
    """Read a chat/completions stream's last events; only those that may carry an error, an abort, usage or `sglext`
    are decoded. After an error event SGLang still sends the usage chunk (with include_usage) and `[DONE]`
    (``OpenAIServingChat._generate_chat_stream``); an abort without a status (`/abort_request`) is a final chunk
    with `finish_reason: "abort"`, then the same closing chunks."""
    error, usage, spec, finished = None, None, None, False
    for data in SSEDecoder().feed(events):
        if data == DONE or not any(key in data for key in _OPENAI_END_KEYS):
            continue
        event = parse_openai_event(data)
        if isinstance(event, StreamError):
            error = event
            continue
        if event.finish_reason is not None:
            finished = True
            error = error or event.finish_reason.error
        usage = event.usage or usage
        spec = event.spec or spec
    return OpenAIStreamEnd(error, usage, spec, finished)


@dataclass(frozen=True)
class NativeChunk:
    """One streamed `/generate` event: text (cumulative unless incremental output is on) and cumulative counts."""

    text: str
    meta: MetaInfo
    incremental: bool = False
    """The event holds fewer `output_ids` than its `completion_tokens`: the server streams deltas
    (`--incremental-streaming-output`), so `text` is only what is new. A stream's first event cannot tell. SGLang
    0.5.23 sends text and ids alike, whole or new (`tokenizer_manager.py`); older releases that sent new ids with
    the whole text would be read as deltas, and their outputs joined wrongly."""
    index: int = 0
    """Which output it is of a request for several (`sampling_params.n`, a batch of prompts): SGLang interleaves
    their events, each with its own counts (`TokenizerManager._stream_batch_responses`)."""


def parse_native_event(data: str) -> NativeChunk | StreamError:
    obj = event_json(data, "/generate stream")
    error = stream_error(obj)
    if error is not None:
        return error
    if "meta_info" not in obj:
        raise ProtocolError("/generate stream: event without 'meta_info'")
    text, ids, meta = obj.get("text", ""), obj.get("output_ids"), parse_meta_info(obj["meta_info"])
    return NativeChunk(text=text if isinstance(text, str) else "", meta=meta,
                       incremental=isinstance(ids, list) and len(ids) < meta.completion_tokens,
                       index=choice_index(obj, "/generate stream"))


@dataclass(frozen=True, slots=True)
class NativeStreamEnd:
    """What a native stream's last event shows, read alone (`native_stream_end`)."""

    text: str
    """The whole output, unless `incremental` (then only the last delta)."""
    incremental: bool
    finish_reason: FinishReason | None
    error: StreamError | None
    """The last event was an error event."""
    done: bool
    """`[DONE]` followed it."""


def native_stream_end(events: bytes) -> NativeStreamEnd:
    """Read a native stream's end (`events`: its last pieces): its last event and the `[DONE]` after it. SGLang
    repeats the whole output in every event, so the last holds it; only what an end needs is read of it (the text,
    the ids' count against `completion_tokens`, the finish reason), not the spec fields, which the relay read."""
    datas = SSEDecoder().feed(events)
    done = bool(datas) and datas[-1] == DONE
    while datas and datas[-1] == DONE:
        datas.pop()
    if not datas:
        return NativeStreamEnd("", False, None, None, done)
    obj = event_json(datas[-1], "/generate stream")
    error = stream_error(obj)
    if error is not None:
        return NativeStreamEnd("", False, None, error, done)
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        raise ProtocolError("/generate stream: event without 'meta_info'")
    text, ids = obj.get("text", ""), obj.get("output_ids")
    incremental = isinstance(ids, list) and len(ids) < int_field(meta, "completion_tokens", most=MAX_GENERATED)
    return NativeStreamEnd(text if isinstance(text, str) else "", incremental,
                           parse_finish_reason(meta.get("finish_reason")), None, done)


@dataclass(frozen=True)
class OpenAIChunk:
    """One streamed chat/completions event: its choice's generated text (`generated_text`, or a completion's),
    finish reason and index (SGLang sends one choice an event, n > 1 included), and usage or spec details (`sglext`)
    if present."""

    text: str
    finish_reason: FinishReason | None
    usage: Usage | None
    spec: SpecStats | None = None
    index: int = 0


def parse_openai_event(data: str) -> OpenAIChunk | StreamError:
    obj = event_json(data, "OpenAI stream")
    error = stream_error(obj)
    if error is not None:
        return error
    choices = obj.get("choices") or []
    if not isinstance(choices, list):
        raise ProtocolError(f"OpenAI stream: choices: expected a list, got {type(choices).__name__}")
    text, finish, index = "", None, 0
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        index = choice_index(choice, "OpenAI stream")
        delta, completion = choice.get("delta"), choice.get("text")
        text = generated_text(delta) if isinstance(delta, dict) else completion if isinstance(completion, str) else ""
        finish = parse_finish_reason(choice.get("finish_reason"))
    return OpenAIChunk(text=text, finish_reason=finish, usage=parse_usage(obj.get("usage")),
                       spec=parse_sglext_spec(obj.get("sglext")), index=index)


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
        if (not event.text or event.index or event.finish_reason is not None or event.usage is not None
                or event.spec is not None or '"text":' in data):
            return
        at = _once(data, '"content":')
        while at >= 0 and data.startswith(" ", at):  # `"content": "`: json.dumps' default separators
            at += 1
        if at < 0 or not data.startswith('"', at):
            return
        text, end = _scanstring(data, at + 1)
        if text == event.text:
            self.prefix, self.suffix = data[: at + 1], data[end:]
