"""The pure-Python twin of the C extension `dfserve._relay`: the same API and the same behaviour, byte for byte,
for installs where the extension could not be built (no compiler); `dfserve.relay_core` picks one.

It costs more CPU per chunk (the reason the extension exists: dfserve/relay_c/relay.h), nothing else: the
gateway and the load tester work the same on either, and tests/unit/test_relay_differential.py runs both on the
same inputs, broken framing included. The C sources follow the same sections: framing (`frame`), token marks
(`read_marks`), members cut out of events (`_strip_members`), histogram bins (`_Bins`), `EventRelay`,
`Dechunker` and `StampedReader` (reader.c).
"""

from __future__ import annotations

import operator
import re
import socket
import struct
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Protocol

LAST_CHUNK = b"0\r\n\r\n"
"""The last chunk, which ends an HTTP/1.1 chunked body (no trailers)."""

_LINE_LIMIT = 4096
"""The longest chunk-size line, or trailer line, with its CRLF."""


class BadChunk(ValueError):
    """A chunked body that breaks HTTP/1.1's framing."""


class EventTooLarge(ValueError):
    """An event still incomplete past the relay's `max_event_bytes`."""


def _seconds(value: object) -> float:
    """A number as C reads one (`PyFloat_AsDouble`): by `__float__`, else `__index__`; never from a string."""
    if type(value) is float:
        return value
    if hasattr(type(value), "__float__"):
        return float(value)  # type: ignore[arg-type]
    return float(operator.index(value))  # type: ignore[arg-type]  # a TypeError for anything else


# framing ------------------------------------------------------------------------------------------------------


def frame(body: bytes) -> bytes:
    """`body` as one HTTP/1.1 chunk."""
    if not isinstance(body, bytes):
        raise TypeError("frame() takes bytes")
    if not body:
        raise ValueError('frame(b"") would be the last chunk, which ends the body')
    return b"%x\r\n%b\r\n" % (len(body), body)


# token marks --------------------------------------------------------------------------------------------------

_AFTER_KEY = re.compile(rb"[ \t\r\n]*")
_DIGITS = re.compile(rb"[0-9]*")
_COUNT_LIMIT = (2**63 - 1 - 9) // 10
"""Digits are taken while the value is below this, as C takes them into an int64 without overflow."""


def _check_keys(keys: object) -> None:
    if not isinstance(keys, tuple) or not keys or not all(isinstance(key, bytes) and key for key in keys):
        raise TypeError("keys must be a non-empty tuple of bytes")


def _count(digits: bytes) -> int | None:
    """The integer the digits spell, or None beyond int64 (C's loop, digit by digit, only for long runs)."""
    if len(digits) <= 18:
        return int(digits)
    value, taken = 0, 0
    while taken < len(digits) and value < _COUNT_LIMIT:
        value = value * 10 + digits[taken] - 48
        taken += 1
    return value if taken == len(digits) else None


def _marks(buf: bytes, keys: tuple[bytes, ...], cumulative: bool) -> int:
    found = -1 if cumulative else 0
    last_at = -1
    length = len(buf)
    for key in keys:
        hit = buf.find(key)
        while hit >= 0:
            after = hit + len(key)
            i = _AFTER_KEY.match(buf, after).end()  # type: ignore[union-attr]  # matches the empty string
            if not cumulative:
                found += i + 1 < length and buf[i] == 34 and buf[i + 1] != 34  # '"'
            elif i < length and 48 <= buf[i] <= 57 and hit >= last_at:
                value = _count(_DIGITS.match(buf, i).group())  # type: ignore[union-attr]
                if value is not None:
                    found, last_at = value, hit
            hit = buf.find(key, after)
    return found


def read_marks(events: bytes, keys: tuple[bytes, ...], cumulative: bool) -> int | None:
    """`cumulative`: the integer after the last of `keys` that has one (None if none); else how many of `keys` have
    a non-empty string value."""
    if not isinstance(events, bytes):
        raise TypeError("read_marks(events: bytes, keys: tuple[bytes, ...], cumulative)")
    _check_keys(keys)
    found = _marks(events, keys, bool(cumulative))
    return None if found < 0 else found


# members cut out of events -----------------------------------------------------------------------------------

_INLINE_SPACE = b" \t"
_SCALAR_ENDS = frozenset(b"}],\r\n \t")


def _value_end(buf: bytes, i: int) -> int:
    """One past the end of the JSON value at buf[i], or -1 where it does not end on its own line."""
    start, depth, length = i, 0, len(buf)
    while i < length:
        c = buf[i]
        if c == 34:  # '"'
            i += 1
            while i < length and buf[i] != 34 and buf[i] != 10:
                if buf[i] == 92:  # '\\'
                    i += 1
                i += 1
            if i >= length or buf[i] != 34:
                return -1
            if depth == 0:
                return i + 1
        elif c in b"{[":
            depth += 1
        elif depth == 0 and c in _SCALAR_ENDS:
            return i if i > start else -1  # a number or a literal ends here
        elif c in b"\r\n":
            return -1
        elif c in b"}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _event_end(buf: bytes, start: int) -> int:
    """One past the first blank line that ends at or after `start`; 0 if none."""
    low = max(start, 1)
    lf = buf.find(b"\n\n", low - 1)
    crlf = buf.find(b"\n\r\n", max(low - 2, 0))
    return min((end for end, at in ((lf + 2, lf), (crlf + 3, crlf)) if at >= 0), default=0)


def _member_span(buf: bytes, at: int, key_length: int, floor: int) -> tuple[int, int] | None:
    """The bytes that cutting the member whose key starts at `at` removes: the member and one comma beside it, or
    the whole event where its object is left empty (nothing else was asked for). None: not a member to cut (its
    value does not end, or it is not inside an object), or one that reaches back before `floor`."""
    length = len(buf)
    value = at + key_length
    while value < length and buf[value] in _INLINE_SPACE:
        value += 1
    end = _value_end(buf, value)
    if end < 0:
        return None
    before, after = at, end
    while before > floor and buf[before - 1] in _INLINE_SPACE:
        before -= 1
    while after < length and buf[after] in _INLINE_SPACE:
        after += 1
    if before > floor and buf[before - 1] == 44:  # ','
        return before - 1, end
    if before <= floor or buf[before - 1] != 123 or after >= length:  # '{'
        return None
    if buf[after] == 44:
        after += 1
        while after < length and buf[after] in _INLINE_SPACE:
            after += 1
        return at, after
    if buf[after] != 125:  # '}'
        return None
    start, stop = _event_boundary(buf, 0, at), _event_end(buf, after + 1)
    return (start, stop) if start >= floor and stop > 0 else None


def _strip_members(events: bytes, key: bytes) -> bytes:
    """`events` less each member whose key is `key` (`events` itself if nothing was cut)."""
    hit = events.find(key)
    if hit < 0:
        return events
    out: list[bytes] = []
    kept = 0  # events[kept:] is not yet copied or cut
    while hit >= 0:
        after = hit + len(key)
        span = _member_span(events, hit, len(key), kept)
        if span is not None:
            out.append(events[kept:span[0]])
            kept = span[1]
            after = max(after, kept)
        hit = events.find(key, after)
    if kept == 0:
        return events
    out.append(events[kept:])
    return b"".join(out)


# histogram bins -----------------------------------------------------------------------------------------------


class _Bins:
    """Observations counted as a Prometheus histogram counts them (a value goes to the first bucket whose upper
    bound is not below it; the last bucket is +Inf)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        try:
            items = list(bounds)
        except TypeError:
            raise TypeError("gap_bounds must be a sequence of floats") from None
        values = [_seconds(bound) for bound in items]
        for i, value in enumerate(values):
            if value != value or (i > 0 and not value > values[i - 1]):
                raise ValueError("gap_bounds must increase")
        self.bounds = values
        self.counts = [0] * (len(values) + 1)
        self.sum = 0.0

    def add(self, value: float, weight: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += weight
        self.sum += value * float(weight)

    def result(self) -> tuple[tuple[int, ...], float]:
        return tuple(self.counts), self.sum


_NO_BINS = _Bins(())


# EventRelay ---------------------------------------------------------------------------------------------------


def _event_boundary(buf: bytes | bytearray, start: int, length: int | None = None) -> int:
    """Length of the longest prefix of buf[:length] that ends with a blank line ("\\n\\n" or "\\n\\r\\n"), looking
    only at lines that end at or after `start`; 0 if none."""
    low = max(start, 1)
    lf = buf.rfind(b"\n\n", low - 1, length)
    crlf = buf.rfind(b"\n\r\n", max(low - 2, 0), length)
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


class EventRelay:
    """Relays a server-sent-event body to a client whole events at a time, counts the tokens each piece carried
    (`read_marks` with `keys` and `cumulative`), and counts the gaps between the pieces that carried tokens into
    histogram buckets (`gap_bounds`, then +Inf). An event still incomplete past `max_event_bytes` raises
    `EventTooLarge` and ends the relay, letting go of what it held. With `strip`, the members whose key it is are
    cut out of every event before it goes out (an event left with an empty object goes whole), and the last piece
    they were cut from is kept as it came (`stripped`).

    Made without `__init__` (or after a failed one), it relays nothing: the class's values below are an inert
    relay's."""

    _write: Callable[[bytes], object] | None = None
    _chunked = False
    _keys: tuple[bytes, ...] = ()
    _cumulative = False
    _strip: bytes | None = None
    _stripped = b""
    _held = bytearray()  # never written: an initialised relay holds its bytes in a bytearray of its own
    _max_event_bytes = 2**63 - 1
    _tail = (b"", b"")
    _tokens = 0
    _first = -1.0
    _previous = 0.0
    _chunk_gaps = _NO_BINS
    _token_gaps = _NO_BINS
    _closed = True
    _last_chunk_written = False

    def __init__(self, write: Callable[[bytes], object] | None, chunked: bool, keys: tuple[bytes, ...],
                 cumulative: bool, gap_bounds: Sequence[float], max_event_bytes: int | None = None,
                 strip: bytes | None = None) -> None:
        self._closed = True
        chunked, cumulative = bool(chunked), bool(cumulative)
        if strip is not None and not (isinstance(strip, bytes) and strip):
            raise TypeError("strip must be a non-empty bytes key or None")
        limit = 2**63 - 1
        if max_event_bytes is not None:
            limit = operator.index(max_event_bytes)
            if limit <= 0:
                raise ValueError("max_event_bytes must be positive")
        _check_keys(keys)
        self._chunk_gaps = _Bins(gap_bounds)
        self._token_gaps = _Bins(gap_bounds)
        self._write = write
        self._keys = keys
        self._strip = bytes(strip) if strip is not None else None
        self._stripped = b""
        self._held = bytearray()
        self._max_event_bytes = limit
        self._tail = (b"", b"")
        self._chunked = chunked
        self._cumulative = cumulative
        self._tokens = -1 if cumulative else 0
        self._first = -1.0
        self._previous = 0.0
        self._closed = False
        self._last_chunk_written = False

    def received(self, now: float, payload: bytes, last: bool = False, /) -> None:
        """Relay the whole events now complete, meter them, keep the rest for the next piece; `last`: the body ends
        here, so a chunked body is ended in the same write if nothing is held."""
        if not isinstance(payload, bytes):
            raise TypeError("received(now, payload: bytes, last=False)")
        self._receive(now, payload, bool(last))

    def _receive(self, now: object, payload: bytes, last: bool) -> None:
        if self._closed:
            return
        held = self._held
        if not held and payload.endswith(b"\n\n"):
            events = payload if type(payload) is bytes else bytes(payload)
        else:
            before = len(held)
            held += payload
            # what was held had no boundary, so a boundary's last newline can only be a new byte
            cut = _event_boundary(held, before)
            if cut == 0:
                self._check_held()
                return
            events = bytes(held[:cut])
            del held[:cut]
        if self._strip is not None:
            kept = _strip_members(events, self._strip)
            if kept is not events:
                self._stripped = events
            events = kept
        write = self._write
        end = last and self._chunked and not self._held
        if write is not None and (events or end):  # cut to nothing: nothing to frame
            write(((b"%x\r\n%b\r\n" % (len(events), events) if events else b"") + (LAST_CHUNK if end else b""))
                  if self._chunked else events)
            if end:
                self._last_chunk_written = self._closed = True  # the client's body is over: nothing more goes out
        try:
            self._meter(now, events)
        finally:
            self._tail = (self._tail[1], events)
        self._check_held()

    def _check_held(self) -> None:
        if len(self._held) > self._max_event_bytes:
            self._held = bytearray()
            self._closed = True
            raise EventTooLarge(f"an event longer than {self._max_event_bytes} bytes (max_event_bytes)")

    def _meter(self, now: object, events: bytes) -> None:
        found = _marks(events, self._keys, self._cumulative)
        produced = found
        if self._cumulative:
            produced = found - max(self._tokens, 0) if found > self._tokens else 0
            self._tokens = max(self._tokens, found)
        else:
            self._tokens += found
        if produced <= 0:
            return
        arrival = _seconds(now)
        if self._first < 0:
            self._first = arrival
        else:
            gap = arrival - self._previous
            self._chunk_gaps.add(gap, 1)
            if self._cumulative:
                self._token_gaps.add(gap / float(produced), produced)
        self._previous = arrival

    def ended(self) -> None:
        """The response is over (or abandoned): nothing more is relayed."""
        self._closed = True

    def detach(self) -> None:
        """The client is gone: stop writing to it."""
        self._write = None

    @property
    def pending(self) -> bytes:
        """Bytes after the last whole event."""
        return bytes(self._held)

    @property
    def tail(self) -> bytes:
        """The last two pieces of whole events relayed."""
        return self._tail[0] + self._tail[1]

    @property
    def stripped(self) -> bytes:
        """The last piece of whole events that had members cut (`strip`), as it came; empty if none."""
        return self._stripped

    @property
    def last_chunk_written(self) -> bool:
        """The client's chunked body was ended (its last chunk written) with the upstream body's last events."""
        return self._last_chunk_written

    @property
    def tokens(self) -> int | None:
        """`cumulative`: the last running total seen (None if none); else the marks counted."""
        return None if self._tokens < 0 else self._tokens

    @property
    def first(self) -> float | None:
        """When the first piece with tokens arrived (None if none)."""
        return None if self._first < 0 else self._first

    @property
    def chunk_gaps(self) -> tuple[tuple[int, ...], float]:
        """Counts per bucket and sum of the gaps between pieces that carried tokens."""
        return self._chunk_gaps.result()

    @property
    def token_gaps(self) -> tuple[tuple[int, ...], float] | None:
        """The same gaps per token, counted once per token; None unless `cumulative` (counts of text are not
        tokens)."""
        return self._token_gaps.result() if self._cumulative else None


# Dechunker ----------------------------------------------------------------------------------------------------

_AT_SIZE, _IN_DATA, _AT_DATA_END, _IN_TRAILER, _DONE = range(5)


class _Sink(Protocol):
    def received(self, now: float, data: bytes) -> None: ...


class _Owner(Protocol):
    def body_done(self) -> None: ...
    def body_failed(self, exc: BadChunk | EventTooLarge) -> None: ...
    def eof_received(self) -> bool | None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...


def _bad_chunk(what: str, line: bytes) -> BadChunk:
    return BadChunk(f"{what}: {line[:40]!r}")


def _parse_size(line: bytes) -> int:
    """A chunk-size line without its CRLF: hex digits, then optional whitespace and extensions after ';'."""
    digits = _HEX.match(line).end()  # type: ignore[union-attr]  # matches the empty string
    rest = len(line) - len(line[digits:].lstrip(b" \t"))
    if digits > 15 and int(line[:digits - 1], 16) > (2**63 - 1) >> 5:
        raise _bad_chunk("chunk size too large", line)
    if digits == 0 or (rest < len(line) and line[rest] != 59):  # ';'
        raise _bad_chunk("bad chunk size", line)
    return int(line[:digits], 16)


_HEX = re.compile(rb"[0-9a-fA-F]*")


class Dechunker:
    """An HTTP/1.1 chunked body, read by read: each read's payload goes to `sink` in one piece. While `owner` is set
    it is also the transport's protocol in the owner's place: it stamps each read with `clock()`, tells the owner
    `body_done()` or `body_failed(exc)`, and forwards the other protocol calls.

    Made without `__init__`, it reads nothing as a protocol (no owner): the class's values below are its state."""

    sink: _Sink | None = None
    clock: Callable[[], float] | None = None
    owner: _Owner | None = None
    last_read = 0.0
    overrun = False
    """Bytes came after the end of the body (dropped): the connection cannot be trusted for another response."""
    _state = _AT_SIZE
    _remaining = 0
    _line = b""

    def __init__(self, sink: _Sink, clock: Callable[[], float]) -> None:
        self.sink = sink
        self.clock = clock
        self.owner = None
        self.last_read = 0.0
        self.overrun = False
        self._state = _AT_SIZE
        self._remaining = 0
        self._line = b""

    @property
    def done(self) -> bool:
        """The last chunk and the trailers have been read."""
        return self._state == _DONE

    def feed(self, now: float, data: bytes) -> bool:
        """De-chunk one read into `sink.received(now, payload)`; True once the body is complete."""
        if not isinstance(data, bytes):
            raise TypeError("feed(now, data: bytes)")
        return self._dechunk(now, data)

    def _dechunk(self, now: object, data: bytes) -> bool:
        i, length = 0, len(data)
        payload: list[bytes] = []
        while i < length and self._state != _DONE:
            state = self._state
            if state == _IN_DATA:
                take = min(self._remaining, length - i)
                payload.append(data[i:i + take])
                i += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state, self._remaining = _AT_DATA_END, 2
            elif state == _AT_DATA_END:
                if data[i] != (13 if self._remaining == 2 else 10):
                    raise _bad_chunk("chunk data not followed by CRLF", data[i:])
                i += 1
                self._remaining -= 1
                if self._remaining == 0:
                    self._state = _AT_SIZE
            else:  # _AT_SIZE or _IN_TRAILER: a line
                newline = data.find(b"\n", i)
                end = newline + 1 if newline >= 0 else length
                if len(self._line) + end - i > _LINE_LIMIT:
                    raise _bad_chunk("chunk line too long", self._line)
                line = self._line + data[i:end]
                i = end
                if newline < 0:
                    self._line = line
                    break
                self._line = b""
                if len(line) < 2 or line[-2] != 13:
                    raise _bad_chunk("chunk line not ended by CRLF", line)
                if state == _IN_TRAILER:
                    if len(line) == 2:
                        self._state = _DONE
                    continue
                size = _parse_size(line[:-2])
                self._state, self._remaining = (_IN_TRAILER if size == 0 else _IN_DATA), size
        if self._state == _DONE and i < length:
            self.overrun = True
        if payload:
            self._deliver(now, b"".join(payload) if len(payload) > 1 else payload[0])
        return self._state == _DONE

    def _deliver(self, now: object, payload: bytes) -> None:
        sink = self.sink
        if type(sink) is EventRelay:
            sink._receive(now, payload, self._state == _DONE)
        else:
            sink.received(now, payload)  # type: ignore[union-attr, arg-type]

    def data_received(self, data: bytes) -> None:
        """As the transport's protocol (while `owner` is set): feed one read, stamped by `clock()`."""
        if not isinstance(data, bytes):
            raise TypeError("data_received(data: bytes)")
        if self.owner is None:
            return  # the owner took its transport back: what still comes is not this body's
        now = self.clock()  # type: ignore[misc]
        self.last_read = _seconds(now)
        try:
            done = self._dechunk(now, data)
        except (BadChunk, EventTooLarge) as exc:
            if self.owner is not None:
                self.owner.body_failed(exc)
            return
        if done and self.owner is not None:
            self.owner.body_done()

    def eof_received(self) -> bool | None:
        """Forwarded to the owner."""
        return self.owner.eof_received() if self.owner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        """Forwarded to the owner."""
        if self.owner is not None:
            self.owner.connection_lost(exc)

    def pause_writing(self) -> None:
        """Forwarded to the owner."""
        if self.owner is not None:
            self.owner.pause_writing()

    def resume_writing(self) -> None:
        """Forwarded to the owner."""
        if self.owner is not None:
            self.owner.resume_writing()


# reads dated by the kernel ------------------------------------------------------------------------------------

_STAMP_TYPE = 35
"""`SO_TIMESTAMPNS_OLD` (asm-generic/socket.h): a `struct timespec`, as dfserve/stamped_socket.py asks."""
_TIMESPEC = struct.Struct("@ll")
_ANCILLARY_BYTES = socket.CMSG_SPACE(_TIMESPEC.size)
_READ_BYTES = 65536
_LATE_READ_S = 1e-3


class _Readable(Protocol):
    def data_received(self, data: bytes) -> None: ...


class StampedReader:
    """Called when `sock` is readable: reads once, dates the read by the kernel's receive time (`arrival()`, on
    `perf_counter`'s clock) and hands the bytes to `protocol.data_received`; the end of the stream calls
    `ended(None)`, a failed read or a protocol that raised `ended(exc)`.

    Made without `__init__`, it has no socket: calling it raises ValueError."""

    protocol: object = None
    _reads = 0
    _late_reads = 0
    _max_lag = 0.0
    _pending_lag: float | None = None
    _sock: socket.socket | None = None
    _ended: object = None
    _arrival = 0.0

    def __init__(self, sock: socket.socket, protocol: _Readable, ended: Callable[[BaseException | None], object]) -> None:
        if not isinstance(sock, socket.socket):
            raise TypeError("StampedReader(sock, ...): sock must be a socket")
        if sock.fileno() < 0:
            raise ValueError("file descriptor cannot be a negative integer (-1)")
        self._sock = sock
        self.protocol = protocol
        self._ended = ended
        self._arrival = 0.0
        self._reads = self._late_reads = 0
        self._max_lag = 0.0
        self._pending_lag = None

    @property
    def reads(self) -> int:
        """Reads that took bytes."""
        return self._reads

    @property
    def late_reads(self) -> int:
        """Of the reads of chunks that more of their response followed, those taken 1 ms or more after their bytes
        arrived."""
        return self._late_reads

    @property
    def max_lag(self) -> float:
        """Of those reads, the longest their bytes waited in the kernel for the loop, in seconds."""
        return self._max_lag

    def arrival(self) -> float:
        """When the bytes of the last read arrived, on `perf_counter`'s clock."""
        return self._arrival

    def not_a_chunk(self) -> None:
        """The read being delivered holds no chunk that a later one could share a stamp with (it ended its
        response, or held only a response head): however late, it dates nothing wrongly, so its lag is not
        counted."""
        self._pending_lag = None

    def __call__(self) -> object:
        if self._sock is None:
            raise ValueError("StampedReader: no socket")
        try:
            data, ancillary, _, _ = self._sock.recvmsg(_READ_BYTES, _ANCILLARY_BYTES)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            return self._ended(exc)  # type: ignore[operator]
        now = time.perf_counter()
        self._arrival = self._arrival_of(ancillary, now)
        if not data:
            return self._ended(None)  # type: ignore[operator]
        self._reads += 1
        if self._pending_lag is not None:
            if self._pending_lag >= _LATE_READ_S:
                self._late_reads += 1
            self._max_lag = max(self._max_lag, self._pending_lag)
        self._pending_lag = now - self._arrival
        try:
            return self.protocol.data_received(data)  # type: ignore[attr-defined]
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:  # as asyncio's transports do: a protocol that failed loses its connection
            return self._ended(exc)  # type: ignore[operator]

    def _arrival_of(self, ancillary: list[tuple[int, int, bytes]], now: float) -> float:
        """The kernel's stamp as a date on `perf_counter`'s clock, `now` being its reading after the read; kept
        between the previous read's date and now, so it never runs backwards."""
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == _STAMP_TYPE and len(raw) >= _TIMESPEC.size:
                seconds, nanoseconds = _TIMESPEC.unpack_from(raw)
                arrival = now - (time.time_ns() - seconds * 1_000_000_000 - nanoseconds) * 1e-9
                return now if arrival > now else max(arrival, self._arrival)
        return now  # the end of the stream, or a segment queued before stamping was asked for
