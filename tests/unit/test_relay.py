"""The relay, in C (`dfserve._relay`) and in its pure-Python twin (`dfserve._relay_py`), each test run on both: byte
streams cut every way, de-chunking, event cutting, framing, metering, the cap on a held event, and objects whose
`__init__` never ran or failed. The stamped reader's reads are tested on sockets in
tests/integration/test_stamped_socket.py."""

from __future__ import annotations

import gc
import itertools
import json
import random
import socket
import time
import weakref
from types import ModuleType

import numpy as np
import pytest

from dfserve import _relay, _relay_py, sglang
from dfserve.relay_core import EventRelay

Relay = ModuleType


@pytest.fixture(params=[_relay, _relay_py], ids=["c", "python"])
def impl(request: pytest.FixtureRequest) -> Relay:
    """The C extension, then its twin: both must pass every test here."""
    return request.param

EVENT = b'data: {"completion_tokens":1}\n\n'
PAYLOAD = EVENT + b"data: "
BODY = (b"1a;name=value\r\n" + PAYLOAD[:26] + b"\r\n"  # an extension, and an upper-case size below
        + b"%X\r\n%b\r\n" % (len(PAYLOAD[26:]), PAYLOAD[26:])
        + b"0\r\nX-Trailer: yes\r\n\r\n")


class Pieces:
    """A sink that keeps what it is given."""

    def __init__(self) -> None:
        self.pieces: list[tuple[float, bytes]] = []
        self.ended = False

    def received(self, now: float, data: bytes) -> None:
        self.pieces.append((now, data))


def dechunk(impl: Relay, reads: list[bytes]) -> tuple[Pieces, list[bool]]:
    sink = Pieces()
    dechunker = impl.Dechunker(sink, time.perf_counter)
    done = [dechunker.feed(float(at), read) for at, read in enumerate(reads)]
    return sink, done


def test_a_body_cut_at_every_pair_of_points_gives_the_same_payload_one_piece_per_read(impl: Relay) -> None:
    for first in range(1, len(BODY)):
        for second in range(first, len(BODY)):
            reads = [BODY[:first], BODY[first:second], BODY[second:]]
            sink, done = dechunk(impl, reads)
            assert b"".join(piece for _, piece in sink.pieces) == PAYLOAD, (first, second)
            assert done == [False, False, True] if second < len(BODY) else done[-2:] == [True, True]
            assert len({at for at, _ in sink.pieces}) == len(sink.pieces)  # one piece per read at most


def test_bytes_after_the_last_chunk_are_dropped_and_noted(impl: Relay) -> None:
    sink = Pieces()
    dechunker = impl.Dechunker(sink, time.perf_counter)
    assert dechunker.feed(0.0, b"3\r\nabc\r\n0\r\n\r\n") and not dechunker.overrun
    assert dechunker.feed(1.0, b"HTTP/1.1 200 OK\r\n") and dechunker.overrun
    assert sink.pieces == [(0.0, b"abc")]


@pytest.mark.parametrize(("body", "problem"), [
    (b"zz\r\nabc\r\n", "bad chunk size"),
    (b"3 x\r\nabc\r\n", "bad chunk size"),
    (b"\r\nabc\r\n", "bad chunk size"),
    (b"3\r\nabcXY", "chunk data not followed by CRLF"),
    (b"3\nabc\r\n", "chunk line not ended by CRLF"),
    (b"3;" + b"e" * 5000 + b"\r\n", "chunk line too long"),
    (b"fffffffffffffffffff\r\n", "chunk size too large"),
])
def test_broken_framing_is_refused_by_name(impl: Relay, body: bytes, problem: str) -> None:
    with pytest.raises(impl.BadChunk, match=problem):
        dechunk(impl, [body])
    assert issubclass(impl.BadChunk, ValueError)


def test_the_sink_can_change_mid_body(impl: Relay) -> None:
    first, second = Pieces(), Pieces()
    dechunker = impl.Dechunker(first, time.perf_counter)
    dechunker.feed(0.0, b"3\r\nabc\r\n3\r\nd")
    dechunker.sink = second
    assert dechunker.feed(1.0, b"ef\r\n0\r\n\r\n") and dechunker.done
    assert first.pieces == [(0.0, b"abcd")] and second.pieces == [(1.0, b"ef")]


class Owner:
    """A connection's protocol, as the de-chunker sees it while it reads the body in its place."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def body_done(self) -> None:
        self.calls.append("done")

    def body_failed(self, exc: ValueError) -> None:
        self.calls.append(f"failed: {exc}")

    def eof_received(self) -> bool:
        self.calls.append("eof")
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.calls.append(f"lost: {exc}")

    def pause_writing(self) -> None:
        self.calls.append("pause")

    def resume_writing(self) -> None:
        self.calls.append("resume")


def test_as_the_protocol_it_stamps_reads_and_reports_the_end_to_its_owner(impl: Relay) -> None:
    ticks = itertools.count(10)
    sink, owner = Pieces(), Owner()
    dechunker = impl.Dechunker(sink, lambda: float(next(ticks)))
    dechunker.data_received(b"3\r\nabc\r\n")
    assert sink.pieces == [] and owner.calls == []  # no owner: not its body (any more)
    dechunker.owner = owner
    dechunker.data_received(b"3\r\nabc\r\n")
    dechunker.data_received(b"0\r\n\r\n")
    assert sink.pieces == [(10.0, b"abc")] and dechunker.last_read == 11.0 and owner.calls == ["done"]
    assert dechunker.eof_received() is True
    dechunker.pause_writing()
    dechunker.resume_writing()
    dechunker.connection_lost(None)
    assert owner.calls == ["done", "eof", "pause", "resume", "lost: None"]


def test_as_the_protocol_it_reports_broken_framing_to_its_owner(impl: Relay) -> None:
    owner = Owner()
    dechunker = impl.Dechunker(Pieces(), time.perf_counter)
    dechunker.owner = owner
    dechunker.data_received(b"3\r\nabcXY")
    assert owner.calls == ["failed: chunk data not followed by CRLF: b'XY'"]


def test_read_marks_reads_the_last_running_total_or_counts_text(impl: Relay) -> None:
    keys = (b'"completion_tokens":', b'"tokens":')
    events = b'data: {"tokens": 4, "completion_tokens":7}\n\ndata: {"completion_tokens":9, "tokens":  12}\n\n'
    assert impl.read_marks(events, keys, True) == 12
    assert impl.read_marks(b'data: {"completion_tokens":null}\n\n', keys, True) is None
    chat = b'{"content":"a"} {"content": ""} {"content":null} {"text": "b"} {"content":"\\"q"}'
    assert impl.read_marks(chat, (b'"content":', b'"text":'), False) == 2 + 0 + 1
    assert impl.read_marks(b"", keys, False) == 0
    assert impl.read_marks(b'{"tokens": 7} {"tokens": 99999999999999999999999}', keys, True) == 7  # beyond int64
    with pytest.raises(TypeError):
        impl.read_marks(b"", (), True)


def test_frame_is_one_http_chunk(impl: Relay) -> None:
    assert impl.frame(b"x" * 26) == b"1a\r\n" + b"x" * 26 + b"\r\n"
    assert impl.frame(b"x" * 4096).startswith(b"1000\r\n")
    with pytest.raises(ValueError, match="last chunk"):
        impl.frame(b"")


def native(tokens: int) -> bytes:
    return b"data: " + json.dumps({"text": "t", "meta_info": {"completion_tokens": tokens}}).encode() + b"\n\n"


def relay_for(impl: Relay, write: list[bytes] | None, chunked: bool) -> EventRelay:
    marks = sglang.NATIVE_TOKENS
    return impl.EventRelay(write.append if write is not None else None, chunked, marks.keys, marks.cumulative, (1.5, 2.5))


def test_crlf_events_are_cut_whole_and_framed_as_chunks(impl: Relay) -> None:
    written: list[bytes] = []
    relay = relay_for(impl, written, chunked=True)
    crlf = native(2).replace(b"\n", b"\r\n")
    relay.received(1.0, crlf[:-1])
    assert written == [] and relay.pending == crlf[:-1]
    relay.received(2.0, crlf[-1:] + b"data: {")
    assert written == [impl.frame(crlf)] and relay.pending == b"data: {"
    assert relay.first == 2.0


def test_the_body_ends_in_the_same_write_as_the_last_events_when_nothing_is_held(impl: Relay) -> None:
    """A system call fewer per request: a chunked client body is ended with the upstream body's last events, not
    when the end came in a read of its own, or with half an event held, or for a body that is not chunked."""
    written: list[bytes] = []
    relay = relay_for(impl, written, chunked=True)
    dechunker = impl.Dechunker(relay, time.perf_counter)
    dechunker.feed(0.0, impl.frame(native(1)))
    dechunker.feed(1.0, impl.frame(native(2)) + b"0\r\n\r\n")
    relay.received(2.0, native(3))  # the client's body is over: nothing more goes out
    assert written == [impl.frame(native(1)), impl.frame(native(2)) + b"0\r\n\r\n"] and relay.last_chunk_written
    assert relay.tokens == 2

    written = []
    relay = relay_for(impl, written, chunked=True)
    dechunker = impl.Dechunker(relay, time.perf_counter)
    dechunker.feed(0.0, impl.frame(native(1)))
    dechunker.feed(1.0, b"0\r\n\r\n")
    assert written == [impl.frame(native(1))] and not relay.last_chunk_written

    for chunked, held, expected in ((True, b"data: {", impl.frame(native(1))), (False, b"", native(1))):
        written = []
        relay = relay_for(impl, written, chunked=chunked)
        relay.received(0.0, native(1) + held, True)
        assert written == [expected] and not relay.last_chunk_written and relay.pending == held


def test_without_a_writer_or_once_detached_nothing_is_written_but_all_is_metered(impl: Relay) -> None:
    relay = relay_for(impl, None, chunked=True)
    relay.received(1.0, native(1))
    assert relay.tokens == 1
    written: list[bytes] = []
    relay = relay_for(impl, written, chunked=False)
    relay.received(1.0, native(1))
    relay.detach()
    relay.received(2.0, native(3))
    relay.ended()
    relay.received(3.0, native(5))
    assert written == [native(1)] and relay.tokens == 3
    assert relay.chunk_gaps == ((1, 0, 0), 1.0) and relay.token_gaps == ((2, 0, 0), 1.0)
    assert relay.tail == native(1) + native(3)


def test_a_long_stream_is_metered_whole(impl: Relay) -> None:
    relay = relay_for(impl, None, chunked=True)
    for n in range(1, 5001):
        relay.received(n / 100, native(3 * n))
    assert relay.tokens == 15000
    assert relay.first == 0.01
    (chunk_counts, chunk_sum), (token_counts, token_sum) = relay.chunk_gaps, relay.token_gaps or ((), 0.0)
    assert chunk_counts == (4999, 0, 0) and token_counts == (3 * 4999, 0, 0)
    assert chunk_sum == pytest.approx(49.99) and token_sum == pytest.approx(49.99)


def test_random_streams_through_dechunker_and_relay_arrive_byte_exact(impl: Relay) -> None:
    rng = random.Random(7)
    for _ in range(200):
        totals = np.cumsum([rng.randrange(1, 5) for _ in range(rng.randrange(1, 30))]).tolist()
        events = [native(total) if rng.random() < 0.8 else b": ping\n\n" for total in totals]
        stream = b"".join(events)
        chunks, at = [], 0
        while at < len(stream):
            size = rng.randrange(1, 200)
            chunks.append(b"%X\r\n%b\r\n" % (len(stream[at:at + size]), stream[at:at + size]))
            at += size
        body = b"".join(chunks) + b"0\r\n\r\n"
        cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randrange(0, 12))))
        written: list[bytes] = []
        relay = relay_for(impl, written, chunked=False)
        dechunker = impl.Dechunker(relay, time.perf_counter)
        done = [dechunker.feed(float(n), body[a:b]) for n, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(body)],
                                                                                    strict=True))]
        assert done[-1] and not any(done[:-1])
        assert b"".join(written) == stream and relay.pending == b""
        assert all(piece.endswith(b"\n\n") for piece in written)
        shown = [total for total, event in zip(totals, events, strict=True) if event.startswith(b"data")]
        assert relay.tokens == (shown[-1] if shown else None)
        with_tokens = sum(b"data" in piece for piece in written)
        assert sum(relay.chunk_gaps[0]) == max(with_tokens - 1, 0)


def test_a_relay_in_a_reference_cycle_is_collected(impl: Relay) -> None:
    class Holder:
        def write(self, data: bytes) -> None:
            """The relay's writer: a bound method, so the relay holds its holder."""

    def cycle() -> weakref.ref[Holder]:
        holder = Holder()
        holder.relay = impl.EventRelay(holder.write, True, (b'"x":',), True, ())  # type: ignore[attr-defined]
        return weakref.ref(holder)

    gone = cycle()
    gc.collect()
    assert gone() is None


def test_an_event_spread_over_many_reads_is_relayed_once_and_whole(impl: Relay) -> None:
    written: list[bytes] = []
    relay = relay_for(impl, written, chunked=False)
    event = b"data: " + json.dumps({"text": "x" * 300_000, "meta_info": {"completion_tokens": 5}}).encode() + b"\n\n"
    for at in range(0, len(event), 1000):
        relay.received(1.0, event[at:at + 1000])
    assert written == [event] and relay.pending == b"" and relay.tokens == 5


def test_a_bad_clock_or_bad_bounds_raise_instead_of_corrupting_state(impl: Relay) -> None:
    dechunker = impl.Dechunker(Pieces(), lambda: "noon")  # type: ignore[arg-type, return-value]
    dechunker.owner = Owner()
    with pytest.raises(TypeError):
        dechunker.data_received(b"3\r\nab")
    for bounds in ((0.1, float("nan")), (0.2, 0.1)):
        with pytest.raises(ValueError, match="increase"):
            impl.EventRelay(None, True, (b'"x":',), True, bounds)


def test_objects_made_without_init_are_inert(impl: Relay) -> None:
    dechunker = impl.Dechunker.__new__(impl.Dechunker)
    assert dechunker.sink is None and dechunker.owner is None
    dechunker.data_received(b"3\r\nabc\r\n")  # no owner: not its body
    relay = impl.EventRelay.__new__(impl.EventRelay)
    relay.received(1.0, b"data: {}\n\n")
    relay.ended()
    assert relay.tail == b"" and relay.pending == b"" and relay.first is None
    assert relay.chunk_gaps == ((0,), 0.0) and relay.token_gaps is None  # C: its bins were never allocated


def test_a_stamped_reader_made_without_init_has_no_socket_and_refuses_what_is_not_one(impl: Relay) -> None:
    reader = impl.StampedReader.__new__(impl.StampedReader)
    assert reader.protocol is None and reader.arrival() == 0.0
    assert (reader.reads, reader.late_reads, reader.max_lag) == (0, 0, 0.0)
    with pytest.raises(AttributeError):
        reader.reads = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="no socket"):
        reader()
    with pytest.raises(TypeError):
        impl.StampedReader("not a socket", None, print)
    closed = socket.socket()
    closed.close()
    with pytest.raises(ValueError, match="negative"):
        impl.StampedReader(closed, None, print)


def test_a_stamped_reader_in_a_reference_cycle_is_collected(impl: Relay) -> None:
    class Transport:
        def ended(self, exc: OSError | None) -> None:
            """The reader's `ended`: a bound method, so the reader holds its transport."""

    def cycle() -> weakref.ref[Transport]:
        transport = Transport()
        with socket.socket() as sock:
            transport.reader = impl.StampedReader(sock, None, transport.ended)  # type: ignore[attr-defined]
        return weakref.ref(transport)

    gone = cycle()
    gc.collect()
    assert gone() is None


def test_a_relay_whose_init_failed_is_inert_and_readable(impl: Relay) -> None:
    relay = impl.EventRelay.__new__(impl.EventRelay)
    with pytest.raises(TypeError):
        relay.__init__(None, True, (), True, (1.0,))  # no keys
    relay.received(1.0, native(3))
    assert relay.chunk_gaps == ((0,), 0.0) and relay.tokens == 0 and relay.tail == b""
    working = relay_for(impl, [], chunked=True)
    working.received(1.0, native(1))
    with pytest.raises(ValueError, match="increase"):
        working.__init__(None, True, (b'"x":',), True, (2.0, 1.0))
    working.received(2.0, native(5))
    assert working.tokens == 1 and working.chunk_gaps == ((0, 0, 0), 0.0)  # the old relay's, which relays no more


def test_empty_pieces_hold_nothing(impl: Relay) -> None:
    """An empty piece, first of all: in C, memcpy to a buffer not yet allocated (UBSan: a null pointer)."""
    written: list[bytes] = []
    relay = relay_for(impl, written, chunked=False)
    relay.received(1.0, b"")
    relay.received(2.0, b"data: ")
    relay.received(3.0, b"")
    relay.received(4.0, native(1)[6:])
    assert written == [native(1)] and relay.pending == b""


def test_an_event_longer_than_the_cap_ends_the_relay_and_lets_go_of_it(impl: Relay) -> None:
    written: list[bytes] = []
    marks = sglang.NATIVE_TOKENS
    relay = impl.EventRelay(written.append, False, marks.keys, marks.cumulative, (), 100)
    relay.received(1.0, native(1) + b"data: " + b"x" * 80)
    assert written == [native(1)] and len(relay.pending) == 86
    relay.received(2.0, b"x" * 14)  # 100 bytes held: at the cap, not past it
    with pytest.raises(impl.EventTooLarge, match="longer than 100 bytes"):
        relay.received(3.0, b"x\n\ndata: " + b"y" * 100)  # whole events go out first, then the rest is too long
    assert written == [native(1), b"data: " + b"x" * 95 + b"\n\n"] and relay.pending == b""
    relay.received(4.0, native(9))
    assert len(written) == 2 and relay.tokens == 1  # over: nothing more is relayed
    assert issubclass(impl.EventTooLarge, ValueError) and not issubclass(impl.EventTooLarge, impl.BadChunk)


def test_the_cap_applies_to_what_is_held_not_to_whole_events_passing_through(impl: Relay) -> None:
    written: list[bytes] = []
    relay = impl.EventRelay(written.append, False, (b'"x":',), True, (), 10)
    big = b"data: " + b"z" * 50 + b"\n\n"
    relay.received(1.0, big)
    assert written == [big]
    for limit in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            impl.EventRelay(None, False, (b'"x":',), True, (), limit)


def test_a_dechunker_as_the_protocol_reports_a_refused_event_to_its_owner(impl: Relay) -> None:
    owner = Owner()
    relay = impl.EventRelay(None, True, (b'"x":',), True, (), 16)
    dechunker = impl.Dechunker(relay, time.perf_counter)
    dechunker.owner = owner
    dechunker.data_received(impl.frame(b"data: " + b"x" * 10))
    assert owner.calls == []
    dechunker.data_received(impl.frame(b"x" * 10))
    assert owner.calls == ["failed: an event longer than 16 bytes (max_event_bytes)"]
    with pytest.raises(impl.EventTooLarge):  # fed by hand, the sink's refusal is raised
        impl.Dechunker(impl.EventRelay(None, True, (b'"x":',), True, (), 4), time.perf_counter).feed(
            0.0, impl.frame(b"data: {}"))


def test_cycles_through_subclassed_keys_or_payloads_are_collected(impl: Relay) -> None:
    class Keys(tuple):  # type: ignore[type-arg]
        """A tuple that can carry attributes, so it can point back at its relay."""

    class Payload(bytes):
        """Bytes that can carry attributes, likewise."""

    class Sentinel:
        """Weakly referable, and reachable only through the cycle (tuple and bytes subclasses are not)."""

    def through_keys() -> weakref.ref[Sentinel]:
        keys = Keys((b'"x":',))
        keys.relay = impl.EventRelay(None, True, keys, True, ())  # type: ignore[attr-defined]
        keys.sentinel = Sentinel()  # type: ignore[attr-defined]
        return weakref.ref(keys.sentinel)  # type: ignore[attr-defined]

    def through_payload() -> weakref.ref[Sentinel]:
        payload = Payload(b"data: {}\n\n")
        relay = impl.EventRelay(None, True, (b'"x":',), True, ())
        relay.received(1.0, payload)
        payload.relay, payload.sentinel = relay, Sentinel()  # type: ignore[attr-defined]
        return weakref.ref(payload.sentinel)  # type: ignore[attr-defined]

    gone: list[weakref.ref[object]] = [through_keys(), through_payload()]
    gc.collect()
    assert [ref() for ref in gone] == [None, None]


def chat_event(obj: dict[str, object]) -> bytes:
    """An OpenAI chunk as SGLang writes it: compact JSON, text as it is."""
    return b"data: " + sglang.json_bytes(obj) + b"\n\n"


SPEC_DETAILS = {"spec_accept_rate": 0.5, "spec_accept_length": 3.0, "spec_verify_ct": 4,
                "spec_correct_drafts_histogram": [1, 0, 3]}
CONTENT = chat_event({"id": "c", "choices": [{"index": 0, "delta": {"content": "def"}}]})
USAGE = chat_event({"id": "c", "choices": [], "usage": {"completion_tokens": 12}})
DONE = b"data: [DONE]\n\n"


def stripping_relay(impl: Relay, written: list[bytes], chunked: bool = False) -> EventRelay:
    marks = sglang.CONTENT_CHUNKS
    return impl.EventRelay(written.append, chunked, marks.keys, marks.cumulative, (), None, sglang.SPEC_DETAILS_KEY)


def test_the_chunk_sent_for_spec_details_alone_goes_whole_and_is_kept_as_it_came(impl: Relay) -> None:
    spec = chat_event({"id": "c", "choices": [], "usage": None, "sglext": {"spec_tokens_details": SPEC_DETAILS}})
    for pieces in ([CONTENT + spec + USAGE + DONE], [CONTENT, spec, USAGE, DONE], [CONTENT + spec[:30], spec[30:]]):
        written: list[bytes] = []
        relay = stripping_relay(impl, written)
        for piece in pieces:
            relay.received(1.0, piece)
        assert b"".join(written) == b"".join(pieces).replace(spec, b"") and relay.tokens == 1
        assert spec in relay.stripped and sglang.openai_stream_end(relay.stripped).spec is not None
    written = []
    relay = stripping_relay(impl, written, chunked=True)
    relay.received(1.0, CONTENT)
    relay.received(2.0, spec, True)  # cut to nothing, and the body's end: only the last chunk goes out
    assert written == [impl.frame(CONTENT), impl.LAST_CHUNK] and relay.last_chunk_written


def test_spec_details_beside_other_sglext_fields_leave_them_as_sglang_sends_them_without(impl: Relay) -> None:
    """SGLang puts every `sglext` field the request asked for in the one chunk, in this order."""
    values = {"routed_experts": "AAE=", "cached_tokens_details": {"device": 3}, "spec_tokens_details": SPEC_DETAILS,
              "input_ids": [1, 2]}
    for asked in (["routed_experts"], ["input_ids"], ["cached_tokens_details", "input_ids"]):
        without = {name: value for name, value in values.items() if name in asked}
        with_spec = {name: value for name, value in values.items() if name in asked or name == "spec_tokens_details"}
        sent = chat_event({"id": "c", "choices": [], "usage": None, "sglext": with_spec})
        written: list[bytes] = []
        relay = stripping_relay(impl, written)
        relay.received(1.0, sent + USAGE)
        assert written == [chat_event({"id": "c", "choices": [], "usage": None, "sglext": without}) + USAGE], asked
        assert relay.stripped == sent + USAGE


def test_text_that_quotes_the_words_is_never_cut(impl: Relay) -> None:
    """JSON escapes the quotes of generated text, so the key's quoted name never occurs in it."""
    texts = ['"sglext":{"spec_tokens_details":{"spec_verify_ct":4}}', '{"spec_tokens_details": 1}',
             'sglext spec_tokens_details', '\\"spec_tokens_details\\":{}}']
    for text in texts:
        quoted = chat_event({"id": "c", "choices": [{"index": 0, "delta": {"content": text}}]})
        assert b"spec_tokens_details" in quoted
        written: list[bytes] = []
        relay = stripping_relay(impl, written)
        relay.received(1.0, quoted + USAGE + DONE)
        assert written == [quoted + USAGE + DONE] and relay.stripped == b"" and relay.tokens == 1, text


def test_strip_is_a_key_or_nothing(impl: Relay) -> None:
    for strip in (b"", "key", 3):
        with pytest.raises(TypeError, match="strip"):
            impl.EventRelay(None, False, (b'"x":',), True, (), None, strip)
    relay = impl.EventRelay(None, False, (b'"x":',), True, (), None, None)
    relay.received(1.0, b'data: {"spec_tokens_details":1}\n\n')
    assert relay.tail == b'data: {"spec_tokens_details":1}\n\n' and relay.stripped == b""


def test_an_alarm_keeps_the_first_and_latest_pieces_it_marks_wherever_they_come(impl: Relay) -> None:
    """An error event followed by more pieces than the tail holds is still read with the stream's end; a key quoted
    in generated text (escaped) marks nothing."""
    error = b'data: {"error":{"message":"retracted","code":503}}\n\n'
    quoted = chat_event({"choices": [{"index": 0, "delta": {"content": '"error": "finish_reason":"abort"'}}]})
    abort = chat_event({"choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]})
    marks = sglang.CONTENT_CHUNKS
    relay = impl.EventRelay(None, False, marks.keys, marks.cumulative, (), None, None, False, sglang.OPENAI_ALARM)
    for n, piece in enumerate([CONTENT, quoted, error, CONTENT, abort, USAGE, DONE]):
        relay.received(float(n), piece)
        assert relay.alarmed == (b"" if n < 2 else error if n < 4 else error + abort)
    assert relay.tail == USAGE + DONE
    assert sglang.openai_stream_end(relay.alarmed + relay.tail).error is not None
    silent = impl.EventRelay(None, False, marks.keys, marks.cumulative, (), None, None, False)
    silent.received(1.0, error)
    assert silent.alarmed == b""
    for alarm in ((), (b"",), (b'"error":', "x"), b'"error":'):
        with pytest.raises(TypeError, match="keys"):
            impl.EventRelay(None, False, marks.keys, marks.cumulative, (), None, None, False, alarm)
    assert impl.EventRelay.__new__(impl.EventRelay).alarmed == b""


def test_kept_pieces_are_what_the_client_read_with_their_arrival_times(impl: Relay) -> None:
    """A recorded stream: each piece of whole events as it went out (spec details cut, an event cut to nothing
    left out, a half event kept only once it is whole), by reference, with the clock reading it came with."""
    spec = chat_event({"id": "c", "choices": [], "usage": None, "sglext": {"spec_tokens_details": SPEC_DETAILS}})
    written: list[bytes] = []
    marks = sglang.CONTENT_CHUNKS
    relay = impl.EventRelay(written.append, False, marks.keys, marks.cumulative, (), None, sglang.SPEC_DETAILS_KEY,
                            True)
    relay.received(1.0, CONTENT)
    relay.received(2.0, spec)
    relay.received(3.0, CONTENT[:20])
    relay.received(4.0, CONTENT[20:] + USAGE)
    relay.received(5.0, DONE, True)
    relay.ended()
    relay.received(6.0, CONTENT)  # not the client's: not kept
    pieces = relay.pieces
    assert pieces == [(1.0, CONTENT), (4.0, CONTENT + USAGE), (5.0, DONE)]
    assert [events for _, events in pieces] == written
    assert pieces is relay.pieces and pieces[0][1] is written[0]


def test_pieces_are_kept_only_when_asked_and_a_failed_read_keeps_none(impl: Relay) -> None:
    relay = relay_for(impl, None, chunked=True)
    relay.received(1.0, native(1))
    assert relay.pieces is None
    assert impl.EventRelay.__new__(impl.EventRelay).pieces is None
    marks = sglang.NATIVE_TOKENS
    relay = impl.EventRelay(None, True, marks.keys, marks.cumulative, (), 16, None, keep_pieces=True)
    relay.received(1.0, native(1))
    with pytest.raises(TypeError):
        relay.received("noon", native(2))  # type: ignore[arg-type]
    with pytest.raises(impl.EventTooLarge):
        relay.received(3.0, b"data: " + b"x" * 20)
    assert relay.pieces == [(1.0, 1)]


def test_a_recorded_native_stream_keeps_each_events_running_total_not_its_bytes(impl: Relay) -> None:
    """Native events repeat the whole output so far: a recorded one keeps (arrival, running total) for each event
    whose total changed, also several in one piece (each with that piece's arrival) and one whose end came in a
    later read; a piece with no total (a comment, `[DONE]`), or the same total again, keeps nothing; a total that
    went back is kept, for the reader to call it the protocol error it is."""
    marks = sglang.NATIVE_TOKENS
    written: list[bytes] = []
    relay = impl.EventRelay(written.append, False, marks.keys, marks.cumulative, (), None, None, True)
    relay.received(1.0, native(0))
    relay.received(2.0, native(2) + native(3) + native(3) + native(5).replace(b"\n\n", b"\r\n\r\n"))
    relay.received(3.0, b": keep-alive\n\n")
    relay.received(4.0, native(5))
    relay.received(5.0, native(7)[:20])
    relay.received(6.0, native(7)[20:] + native(4))
    relay.received(7.0, DONE, True)
    assert relay.pieces == [(2.0, 2), (2.0, 3), (2.0, 5), (6.0, 7), (6.0, 4)]
    assert len(written) == 6 and b"".join(written).count(b"completion_tokens") == 8  # relayed as without a record
    dechunked = impl.EventRelay(None, True, marks.keys, marks.cumulative, (), None, None, True)
    dechunker = impl.Dechunker(dechunked, lambda: 0.0)
    body = native(1) + native(2) + DONE
    dechunker.feed(8.0, b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
    assert dechunked.pieces == [(8.0, 1), (8.0, 2)]


def test_keep_alives_after_the_last_event_leave_it_in_the_tail(impl: Relay) -> None:
    """A stream's end is read from its last pieces: comments between the last event and `[DONE]` pushed it out,
    and a whole answer read as one without a finish reason."""
    marks = sglang.NATIVE_TOKENS
    relay = impl.EventRelay(None, False, marks.keys, marks.cumulative, ())
    last = native(7).replace(b'"completion_tokens"', b'"finish_reason":{"type":"stop"},"completion_tokens"')
    for at, piece in enumerate((native(3), last, b": ping\n\n", b":\r\n\r\n", b"", DONE), start=1):
        relay.received(float(at), piece)
    assert relay.tail == last + DONE
