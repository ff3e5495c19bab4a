"""Types of the C extension `dfserve/_relay.c` (see its header for why it is in C)."""

from collections.abc import Callable
from typing import Protocol

class BadChunk(ValueError):
    """A chunked body that breaks HTTP/1.1's framing."""

class _Sink(Protocol):
    def received(self, now: float, data: bytes) -> None: ...
    def ended(self) -> None: ...

class EventRelay:
    """Relays a server-sent-event body to a client whole events at a time, and notes when each piece of events
    arrived and the tokens it carried (`read_marks` with `keys` and `cumulative`)."""

    pending: bytes
    """Bytes after the last whole event."""
    tail: bytes
    """The last two pieces of whole events relayed."""
    tokens: int | None
    """`cumulative`: the last running total seen (None if none); else the marks counted."""
    arrivals: bytes
    """Arrival times (float64, native byte order) of the pieces that carried tokens."""
    produced: bytes
    """Tokens (int64) each of those pieces carried."""

    def __init__(self, write: Callable[[bytes], object] | None, chunked: bool, keys: tuple[bytes, ...],
                 cumulative: bool, on_end: Callable[[], None]) -> None: ...
    def received(self, now: float, data: bytes) -> None: ...
    def ended(self) -> None: ...
    def detach(self) -> None: ...

class Dechunker:
    """An HTTP/1.1 chunked body, read by read: each read's payload goes to `sink` in one piece."""

    sink: _Sink
    done: bool

    def __init__(self, sink: _Sink) -> None: ...
    def feed(self, now: float, data: bytes) -> bool: ...

def frame(body: bytes) -> bytes:
    """`body` as one HTTP/1.1 chunk."""

def read_marks(events: bytes, keys: tuple[bytes, ...], cumulative: bool) -> int | None:
    """`cumulative`: the integer after the last of `keys` that has one (None if none); else how many of `keys` have a
    non-empty string value."""
