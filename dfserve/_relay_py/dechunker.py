"""Dechunker: an HTTP/1.1 chunked body de-chunked read by read, as the upstream transport's protocol (dechunker.c)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

from dfserve._relay_py.event_relay import EventRelay
from dfserve._relay_py.module import BadChunk, EventTooLarge, seconds

_LINE_LIMIT = 4096
"""The longest chunk-size line, or trailer line, with its CRLF."""
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
        self.last_read = seconds(now)
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
