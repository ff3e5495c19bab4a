"""The C relay and its pure-Python twin, run on the same generated inputs, must do the same: the same payload
pieces, the same bytes written to the client, the same counts, gaps and errors (type and message), read after read,
also on chunked framing that was broken on purpose (bytes flipped, inserted, deleted), on events longer than the
relay's cap, with spec details cut out of events (whole, beside other fields, malformed, or quoted in text), with
the pieces an alarm key marks (error events, aborts, the key quoted in text), and with what is kept for a record of
the stream (the pieces, or each event's changed running total where totals are
cumulative: several events to a piece, totals that go back, events with none).

`make test` runs this file twice: as part of the suite (a few hundred inputs per test, the same ones every run) and
under AddressSanitizer and UBSan, with more inputs (`DFSERVE_FUZZ_EXAMPLES`), as a bounded fuzz of the C code.
"""

from __future__ import annotations

import itertools
import os
from types import ModuleType
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dfserve import _relay, _relay_py, sglang

EXAMPLES = int(os.environ.get("DFSERVE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

KEYS = [sglang.NATIVE_TOKENS, sglang.CONTENT_CHUNKS]
NOISE = b'\r\n\n"0123456789:; {}\tdata,abcfF-'
SPEC = sglang.SPEC_DETAILS_KEY
STRIPS = [None, SPEC]
ALARMS = [None, sglang.OPENAI_ALARM]
SPEC_VALUES = [b'{"spec_verify_ct":4,"spec_correct_drafts_histogram":[1,0,3]}', b'[{"a":1},{"b":"}]\\""}]', b"7",
               b"null", b" {} ", b"", b'{"a":', b'"x', b'{"a":\n1}', b'"\\\\"']
"""Spec details as SGLang sends them (one object, or a list for n > 1), and values that do not end or cross a line."""


def sglext_event(draw: st.DrawFn) -> bytes:
    """A chunk with `sglext`: the spec details alone, among the other fields SGLang puts there, or not in `sglext`."""
    value = draw(st.sampled_from(SPEC_VALUES))
    members = [b'"routed_experts":"AAE="', b'"cached_tokens_details":{"device":3}', SPEC + value,
               b'"input_ids":[1,2]', b'"output_ids":[[3]]']
    chosen = [m for m in members if m.startswith(SPEC) or draw(st.booleans())]
    spaced = draw(st.sampled_from([b",", b", ", b" ,\t"])).join(chosen)
    where = draw(st.sampled_from([b'"sglext":{%b}', b'"sglext": { %b }', b"%b", b'"choices":[%b]']))
    return b'data: {"id":"c","choices":[],"usage":null,' + where % spaced + b"}"


@st.composite
def events(draw: st.DrawFn) -> bytes:
    """A server-sent-event stream as SGLang writes one (native or OpenAI), with comments, odd line ends, noise
    and perhaps an unfinished event at the end."""
    parts = []
    total = 0
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["native", "chat", "sglext", "error", "comment", "done", "noise"]))
        total += draw(st.integers(0, 4))
        if kind == "native":
            number = draw(st.sampled_from([str(total), "null", " 12", "0" * 25 + "7", "1" + "0" * 18,
                                           str(2**63 - 1), "9223372036854775790", "9" * 19, "9" * 20]))  # int64's end
            body = b'data: {"text":"t","meta_info":{"completion_tokens":%b}}' % number.encode()
        elif kind == "chat":
            text = draw(st.sampled_from([b"a", b"", b'\\"q', b"def f():", b'\\"sglext\\":{\\"spec_tokens_details\\":1}',
                                         b'\\"spec_tokens_details\\":{}}']))
            body = b'data: {"choices":[{"delta":{"content":"%b"}}]}' % text
        elif kind == "sglext":
            body = sglext_event(draw)
        elif kind == "error":
            body = draw(st.sampled_from([b'data: {"error":{"message":"x","code":503}}', b'data: {"error": "x"}',
                                         b'data: {"choices":[{"delta":{},"finish_reason":"abort"}]}',
                                         b'data: {"choices":[{"delta":{"content":"\\"error\\":"}}]}']))
        elif kind == "comment":
            body = b": ping"
        elif kind == "done":
            body = b"data: [DONE]"
        else:
            body = draw(st.binary(max_size=40)) + bytes(draw(st.lists(st.sampled_from(NOISE), max_size=30)))
        parts.append(body + draw(st.sampled_from([b"\n\n", b"\r\n\r\n", b"\n\r\n", b"\n", b""])))
    return b"".join(parts)


@st.composite
def chunked(draw: st.DrawFn, payload: bytes) -> bytes:
    """`payload` framed as an HTTP/1.1 chunked body (sizes in either case, extensions, trailers), then maybe broken:
    bytes flipped, inserted or deleted, the body's end cut off, or bytes after it."""
    out, at = [], 0
    while at < len(payload):
        size = draw(st.integers(1, max(1, len(payload) - at)))
        # the last two: a size one digit past the largest taken, and the largest taken
        digits = draw(st.sampled_from([b"%x" % size, b"%X" % size, b"0%x" % size, b"%x" % size, b"%X" % size,
                                       b"4" + b"0" * 15, b"3" + b"f" * 15]))
        extension = draw(st.sampled_from([b"", b";a=b", b" ", b"\t;x", b";" + b"e" * 4096]))  # the last: too long
        out.append(digits + extension + b"\r\n" + payload[at:at + size] + b"\r\n")
        at += size
    long_trailers = [b"X: " + b"a" * (4096 - 5) + b"\r\n", b"X: " + b"a" * (4096 - 4) + b"\r\n"]  # at the limit, past it
    out.append(b"0\r\n" + draw(st.sampled_from([b"", b"X-Trailer: 1\r\n", *long_trailers])) + b"\r\n")
    body = bytearray(b"".join(out))
    for _ in range(draw(st.integers(0, 3))):
        where = draw(st.integers(0, len(body)))
        byte = draw(st.sampled_from(list(b"\r\n0123456789abcdefxyz;: G")))
        action = draw(st.sampled_from(["flip", "insert", "delete"]))
        if action == "insert" or where == len(body):
            body[where:where] = bytes([byte])
        elif action == "flip":
            body[where] = byte
        else:
            del body[where]
    ending = draw(st.sampled_from(["whole", "cut", "after"]))
    if ending == "cut" and body:
        del body[draw(st.integers(0, len(body) - 1)):]
    elif ending == "after":
        body += b"HTTP/1.1 200 OK\r\n"
    return bytes(body)


def cuts(draw: st.DrawFn, data: bytes) -> list[bytes]:
    points = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=10))))
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def outcome(call: Any) -> object:
    try:
        return call()
    except Exception as exc:
        return type(exc).__name__, str(exc)


class Owner:
    """A connection's protocol, as the de-chunker sees it: it takes its transport back at the end, as http1 does."""

    def __init__(self) -> None:
        self.calls: list[object] = []
        self.dechunker: Any = None

    def body_done(self) -> None:
        self.calls.append("done")
        self.dechunker.owner = None

    def body_failed(self, exc: Exception) -> None:
        self.calls.append((type(exc).__name__, str(exc)))
        self.dechunker.owner = None


def relay_state(relay: Any) -> tuple[object, ...]:
    pieces = relay.pieces
    return (relay.pending, relay.tail, relay.stripped, relay.alarmed, relay.tokens, relay.first, relay.chunk_gaps,
            relay.token_gaps, relay.last_chunk_written, None if pieces is None else list(pieces))


def through_relay(impl: ModuleType, reads: list[bytes], marks: sglang.TokenMarks, chunked_out: bool,
                  bounds: tuple[float, ...], max_event_bytes: int | None, as_protocol: bool,
                  strip: bytes | None, keep_pieces: bool, alarm: tuple[bytes, ...] | None) -> list[object]:
    """Every read through a de-chunker into a relay; what each read did, and the state after it."""
    written: list[bytes] = []
    relay = impl.EventRelay(written.append, chunked_out, marks.keys, marks.cumulative, bounds, max_event_bytes,
                            strip, keep_pieces, alarm)
    ticks = itertools.count()
    dechunker = impl.Dechunker(relay, lambda: next(ticks) / 7)
    owner = Owner()
    if as_protocol:
        owner.dechunker, dechunker.owner = dechunker, owner
    trace: list[object] = []
    for n, read in enumerate(reads):
        if as_protocol:
            result = outcome(lambda read=read: dechunker.data_received(read))
        else:
            result = outcome(lambda n=n, read=read: dechunker.feed(n / 3, read))
        trace.append((result, list(owner.calls), list(written), relay_state(relay), dechunker.done, dechunker.overrun,
                      dechunker.last_read))
    return trace


@FUZZ
@given(st.data())
def test_chunked_bodies_through_dechunker_and_relay(data: st.DataObject) -> None:
    body = data.draw(chunked(data.draw(events())))
    reads = cuts(data.draw, body)
    marks = data.draw(st.sampled_from(KEYS))
    bounds = data.draw(st.sampled_from([(), (0.5,), (0.1, 0.2, 1.0, 5.0)]))
    max_event_bytes = data.draw(st.sampled_from([None, 1, 16, 64, 1 << 20]))
    chunked_out, as_protocol = data.draw(st.booleans()), data.draw(st.booleans())
    args = (reads, marks, chunked_out, bounds, max_event_bytes, as_protocol, data.draw(st.sampled_from(STRIPS)),
            data.draw(st.booleans()), data.draw(st.sampled_from(ALARMS)))
    assert through_relay(_relay, *args) == through_relay(_relay_py, *args)


class Pieces:
    def __init__(self) -> None:
        self.pieces: list[tuple[float, bytes]] = []

    def received(self, now: float, data: bytes) -> None:
        self.pieces.append((now, data))


def through_sink(impl: ModuleType, reads: list[bytes]) -> list[object]:
    sink = Pieces()
    dechunker = impl.Dechunker(sink, lambda: 0.0)
    return [(outcome(lambda n=n, read=read: dechunker.feed(float(n), read)), list(sink.pieces), dechunker.done,
             dechunker.overrun) for n, read in enumerate(reads)]


@FUZZ
@given(st.data())
def test_chunked_bodies_into_any_sink(data: st.DataObject) -> None:
    reads = cuts(data.draw, data.draw(chunked(data.draw(st.binary(max_size=200)))))
    assert through_sink(_relay, reads) == through_sink(_relay_py, reads)


def fed_directly(impl: ModuleType, pieces: list[tuple[bytes, bool]], marks: sglang.TokenMarks,
                 max_event_bytes: int | None, strip: bytes | None, keep_pieces: bool,
                 alarm: tuple[bytes, ...] | None) -> list[object]:
    written: list[bytes] = []
    relay = impl.EventRelay(written.append, True, marks.keys, marks.cumulative, (0.25, 1.0), max_event_bytes, strip,
                            keep_pieces, alarm)
    return [(outcome(lambda n=n, piece=piece, last=last: relay.received(n * 0.3, piece, last)), list(written),
             relay_state(relay)) for n, (piece, last) in enumerate(pieces)]


@FUZZ
@given(st.data())
def test_events_fed_to_a_relay_piece_by_piece(data: st.DataObject) -> None:
    stream = data.draw(events())
    pieces = [(piece, data.draw(st.booleans())) for piece in cuts(data.draw, stream)]
    marks = data.draw(st.sampled_from(KEYS))
    max_event_bytes = data.draw(st.sampled_from([None, 2, 40, 200]))
    args = (pieces, marks, max_event_bytes, data.draw(st.sampled_from(STRIPS)), data.draw(st.booleans()),
            data.draw(st.sampled_from(ALARMS)))
    assert fed_directly(_relay, *args) == fed_directly(_relay_py, *args)


@FUZZ
@given(st.data())
def test_token_marks_and_framing(data: st.DataObject) -> None:
    keys = data.draw(st.sampled_from([*(marks.keys for marks in KEYS), (b'"a":', b'"a":1'), (b":",)]))
    text = data.draw(events()) + bytes(data.draw(st.lists(st.sampled_from(NOISE + b'"a"'), max_size=60)))
    for cumulative in (True, False):
        assert _relay.read_marks(text, keys, cumulative) == _relay_py.read_marks(text, keys, cumulative)
    assert outcome(lambda: _relay.frame(text)) == outcome(lambda: _relay_py.frame(text))
