"""Types of the C extension `dfserve/_relay.c` (see its header for why it is in C)."""

from collections.abc import Callable, Sequence
from typing import Protocol

class BadChunk(ValueError):
    """A chunked body that breaks HTTP/1.1's framing."""

class _Sink(Protocol):
    def received(self, now: float, data: bytes) -> None: ...
    def ended(self) -> None: ...

class _Owner(Protocol):
    def body_done(self) -> None: ...
    def body_failed(self, exc: BadChunk) -> None: ...
    def eof_received(self) -> bool | None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...

class EventRelay:
    """Relays a server-sent-event body to a client whole events at a time, counts the tokens each piece carried
    (`read_marks` with `keys` and `cumulative`), and counts the gaps between the pieces that carried tokens into
    histogram buckets (`gap_bounds`, then +Inf)."""

    pending: bytes
    """Bytes after the last whole event."""
    tail: bytes
    """The last two pieces of whole events relayed."""
    tokens: int | None
    """`cumulative`: the last running total seen (None if none); else the marks counted."""
    first: float | None
    """When the first piece with tokens arrived."""
    chunk_gaps: tuple[tuple[int, ...], float]
    """Counts per bucket and sum of the gaps between pieces that carried tokens."""
    token_gaps: tuple[tuple[int, ...], float] | None
    """The same gaps per token, counted once per token; None unless `cumulative` (counts of text are not tokens)."""

    def __init__(self, write: Callable[[bytes], object] | None, chunked: bool, keys: tuple[bytes, ...],
                 cumulative: bool, gap_bounds: Sequence[float]) -> None: ...
    last_chunk_written: bool
    """The client's chunked body was ended (its last chunk written) with the upstream body's last events."""

    def received(self, now: float, data: bytes, last: bool = False, /) -> None: ...
    def ended(self) -> None: ...
    def detach(self) -> None: ...

class Dechunker:
    """An HTTP/1.1 chunked body, read by read: each read's payload goes to `sink` in one piece. While `owner` is set
    it is also the transport's protocol in the owner's place: it stamps each read with `clock()`, tells the owner
    `body_done()` or `body_failed(exc)`, and forwards the other protocol calls."""

    sink: _Sink
    owner: _Owner | None
    done: bool
    last_read: float
    overrun: bool
    """Bytes came after the end of the body (dropped): the connection cannot be trusted for another response."""

    def __init__(self, sink: _Sink, clock: Callable[[], float]) -> None: ...
    def feed(self, now: float, data: bytes) -> bool: ...
    def data_received(self, data: bytes) -> None: ...
    def eof_received(self) -> bool | None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...

LAST_CHUNK: bytes
"""The last chunk, which ends an HTTP/1.1 chunked body (no trailers)."""

def frame(body: bytes) -> bytes:
    """`body` as one HTTP/1.1 chunk."""

def read_marks(events: bytes, keys: tuple[bytes, ...], cumulative: bool) -> int | None:
    """`cumulative`: the integer after the last of `keys` that has one (None if none); else how many of `keys` have a
    non-empty string value."""
