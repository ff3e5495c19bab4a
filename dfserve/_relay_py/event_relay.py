"""EventRelay: a server-sent-event body relayed to a client whole events at a time, and metered (event_relay.c)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from dfserve._relay_py.bins import NO_BINS, Bins
from dfserve._relay_py.frame import LAST_CHUNK
from dfserve._relay_py.marks import check_keys, count_marks
from dfserve._relay_py.members import event_boundary, event_end, strip_members
from dfserve._relay_py.module import EventTooLarge, seconds


class EventRelay:
    """Relays a server-sent-event body to a client whole events at a time, counts the tokens each piece carried
    (`read_marks` with `keys` and `cumulative`), and counts the gaps between the pieces that carried tokens into
    histogram buckets (`gap_bounds`, then +Inf). An event still incomplete past `max_event_bytes` raises
    `EventTooLarge` and ends the relay, letting go of what it held. With `strip`, the members whose key it is are
    cut out of every event before it goes out (an event left with an empty object goes whole), and the last piece
    they were cut from is kept as it came (`stripped`). With `alarm`, a tuple of keys, the first and the latest
    piece relayed in which one occurs are kept (`alarmed`): an event the last pieces (`tail`) may have left behind. With `keep_pieces`, every piece of whole events relayed is
    kept, by reference, with its arrival time (`pieces`): what a client would have read, for a record of the
    stream decoded later, off the loop; `cumulative`, each event's running total where it changed (from 0) is kept
    instead of the events, which repeat the whole output so far (their bytes grow with the square of its length).

    Made without `__init__` (or after a failed one), it relays nothing: the class's values below are an inert
    relay's."""

    _write: Callable[[bytes], object] | None = None
    _chunked = False
    _keys: tuple[bytes, ...] = ()
    _cumulative = False
    _strip: bytes | None = None
    _stripped = b""
    _alarm: tuple[bytes, ...] | None = None
    _alarmed = (b"", b"")
    _held = bytearray()  # never written: an initialised relay holds its bytes in a bytearray of its own
    _max_event_bytes = 2**63 - 1
    _tail = (b"", b"")
    _pieces: list[tuple[Any, Any]] | None = None
    _kept = 0
    _tokens = 0
    _first = -1.0
    _previous = 0.0
    _chunk_gaps = NO_BINS
    _token_gaps = NO_BINS
    _closed = True
    _last_chunk_written = False

    def __init__(self, write: Callable[[bytes], object] | None, chunked: bool, keys: tuple[bytes, ...],
                 cumulative: bool, gap_bounds: Sequence[float], max_event_bytes: int | None = None,
                 strip: bytes | None = None, keep_pieces: bool = False,
                 alarm: tuple[bytes, ...] | None = None) -> None:
        self._closed = True
        chunked, cumulative = bool(chunked), bool(cumulative)
        if strip is not None and not (isinstance(strip, bytes) and strip):
            raise TypeError("strip must be a non-empty bytes key or None")
        limit = 2**63 - 1
        if max_event_bytes is not None:
            limit = operator.index(max_event_bytes)
            if limit <= 0:
                raise ValueError("max_event_bytes must be positive")
        check_keys(keys)
        if alarm is not None:
            check_keys(alarm)
        self._chunk_gaps = Bins(gap_bounds)
        self._token_gaps = Bins(gap_bounds)
        self._write = write
        self._keys = keys
        self._strip = bytes(strip) if strip is not None else None
        self._stripped = b""
        self._alarm = alarm
        self._alarmed = (b"", b"")
        self._held = bytearray()
        self._max_event_bytes = limit
        self._tail = (b"", b"")
        self._pieces = [] if keep_pieces else None
        self._kept = 0
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
            cut = event_boundary(held, before)
            if cut == 0:
                self._check_held()
                return
            events = bytes(held[:cut])
            del held[:cut]
        if self._strip is not None:
            kept = strip_members(events, self._strip)
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
            if self._alarm is not None and any(key in events for key in self._alarm):
                first, _ = self._alarmed
                self._alarmed = (first, events) if first else (events, b"")
            if not only_comments(events):
                self._tail = (self._tail[1], events)
        if self._pieces is not None and events:
            if self._cumulative:
                self._keep_counts(self._pieces, now, events)
            else:
                self._pieces.append((now, events))  # as it came, as C keeps it
        self._check_held()

    def _keep_counts(self, kept: list[tuple[Any, Any]], now: object, events: bytes) -> None:
        """Each event's running total where it changed; one that went back too (a reader calls it a protocol
        error)."""
        start = 0
        while start < len(events):
            end = event_end(events, start + 1) or len(events)
            count = count_marks(events[start:end], self._keys, True)
            start = end
            if count >= 0 and count != self._kept:
                kept.append((now, count))
                self._kept = count

    def _check_held(self) -> None:
        if len(self._held) > self._max_event_bytes:
            self._held = bytearray()
            self._closed = True
            raise EventTooLarge(f"an event longer than {self._max_event_bytes} bytes (max_event_bytes)")

    def _meter(self, now: object, events: bytes) -> None:
        found = count_marks(events, self._keys, self._cumulative)
        produced = found
        if self._cumulative:
            produced = found - max(self._tokens, 0) if found > self._tokens else 0
            self._tokens = max(self._tokens, found)
        else:
            self._tokens += found
        if produced <= 0:
            return
        arrival = seconds(now)
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
        """The last two pieces of whole events relayed, pieces of comments alone (keep-alives) left out."""
        return self._tail[0] + self._tail[1]

    @property
    def stripped(self) -> bytes:
        """The last piece of whole events that had members cut (`strip`), as it came; empty if none."""
        return self._stripped

    @property
    def alarmed(self) -> bytes:
        """The first and the latest piece of whole events relayed (as relayed) in which a key of `alarm` occurs;
        empty if none."""
        return self._alarmed[0] + self._alarmed[1]

    @property
    def pieces(self) -> list[tuple[float, bytes]] | list[tuple[float, int]] | None:
        """`keep_pieces`: every piece of whole events relayed (as the client got them, none empty) with the clock
        reading of its arrival, by reference; `cumulative`, (arrival, running total) for each event whose total
        changed; else None."""
        return self._pieces

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


def only_comments(events: bytes) -> bool:
    """Whether a piece of whole events holds nothing but comments and blank lines (a keep-alive): it is no end of the
    stream to read, and stays out of `tail`, so that the last events are still there after it."""
    return all(not line or line == b"\r" or line.startswith(b":") for line in events.split(b"\n"))
