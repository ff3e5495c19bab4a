"""StampedReader: a socket read dated by the kernel's receive time (reader.c)."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from typing import Protocol

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
        now, wall_ns = time.perf_counter(), time.time_ns()  # together: a pause between would age the read
        self._arrival = self._arrival_of(ancillary, now, wall_ns)
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

    def _arrival_of(self, ancillary: list[tuple[int, int, bytes]], now: float, wall_ns: int) -> float:
        """The kernel's stamp as a date on `perf_counter`'s clock, `now` and `wall_ns` being that clock's and the
        wall clock's readings after the read; kept between the previous read's date and now, so it never runs
        backwards."""
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == _STAMP_TYPE and len(raw) >= _TIMESPEC.size:
                seconds, nanoseconds = _TIMESPEC.unpack_from(raw)
                arrival = now - (wall_ns - seconds * 1_000_000_000 - nanoseconds) * 1e-9
                return now if arrival > now else max(arrival, self._arrival)
        return now  # the end of the stream, or a segment queued before stamping was asked for
