"""A TCP transport that dates each read by the kernel's receive time of its bytes, not by when the loop read them.

Why: a loop dates a read when it gets to it. When 128 streams' chunks arrive together, the last of them is dated
after the loop has handled the 127 before it, and after whatever else the loop was doing (records of requests that
just ended, the requests that replace them): the tester's TTFT error p99 was 1.3-3.7 ms at 128 synchronized streams
and 7-13 ms at 256 in bench/tester_timing.py, time that a load tester reports as the server's. Linux stamps each TCP
segment as it arrives (`SO_TIMESTAMPNS`); `recvmsg` returns the stamp of the last segment a read took, so a read's
date is when its last byte arrived, whatever the loop was doing then. The stamp is on the wall clock and is moved
onto the caller's `perf_counter` clock at the read (a step of the wall clock between a segment's arrival and its
read would misdate that read; a date is kept between the previous read's and now, so it can never run backwards).
What is left: the kernel merges a segment into one still unread in the socket and keeps the newer stamp, so a
chunk that the loop has not read when the next one arrives is dated by the next (a loop more than a chunk gap
behind; no read pattern recovers the older stamp). `ReadLag` counts how long chunks waited for the loop, so that a
run can say when that may have happened.

The transport speaks asyncio's: the protocol gets `connection_made`, `data_received`, `eof_received` and
`connection_lost`; `arrival()` is the date of the read being delivered. Plain TCP on Linux only: TLS decrypts in
user space, so an https connection is dated by its loop (`dfserve.http1.Pool` says which a pool uses), and so is
everything where `available()` found no stamps.

    transport, protocol = await connect(loop, "127.0.0.1", 30000, MyProtocol)
    # in MyProtocol.data_received: transport.arrival() is when the bytes arrived, on perf_counter's clock
"""

from __future__ import annotations

import asyncio
import atexit
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any

from pydantic import Field

from dfserve.relay_core import StampedReader

SO_TIMESTAMPNS = 35
"""`SO_TIMESTAMPNS_OLD` in asm-generic/socket.h (x86, arm, riscv...): a `struct timespec` per read; Python's
socket module does not name it."""


Count = Annotated[int, Field(ge=0)]
Wait = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


@dataclass
class ReadLag:
    """How long reads' bytes waited in the kernel for the loop, over the connections that added theirs: a loop that
    lets a chunk wait until the next one arrives dates it by the next (the module's docstring)."""

    reads: Count = 0
    late_reads: Count = 0
    """Of the reads of chunks that more of their response followed, those taken 1 ms or more after their bytes
    arrived: only a chunk still unread when the next arrives can be misdated."""
    max_lag_s: Wait = 0.0
    """Of those reads, the longest their bytes waited."""

    def __post_init__(self) -> None:
        """Checked when read back from a summary (pydantic calls it): a count of late reads beyond the reads is not
        one the tester made."""
        if self.late_reads > self.reads:
            raise ValueError(f"late_reads {self.late_reads} is more than reads {self.reads}")

    def add(self, reads: int, late_reads: int, max_lag_s: float) -> None:
        self.reads += reads
        self.late_reads += late_reads
        self.max_lag_s = max(self.max_lag_s, max_lag_s)


_KEPT_ON: list[socket.socket] = []
"""A loopback pair that asked for stamps, kept open for the life of the process (see `available`)."""


def stamp_arrivals(sock: socket.socket) -> None:
    """Ask the kernel to stamp what `sock` receives (set on a listening socket, its accepted ones inherit it)."""
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)


def _let_go() -> None:
    for sock in _KEPT_ON:
        sock.close()


@cache
def available(wait_s: float = 1.0) -> bool:
    """Whether TCP reads here come with the kernel's stamps, with stamping turned on for good. Linux turns receive
    stamps on for the whole system when the first socket asks, in a deferred work item, and off when the last such
    socket closes; segments that arrive in between carry no stamp, and their reads would be dated by the loop. So
    a loopback pair that asks is opened and kept open, and a byte is sent over it until one comes back stamped."""
    if sys.platform != "linux":
        return False
    try:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            sender = socket.create_connection(listener.getsockname())
            receiver, _ = listener.accept()
        _KEPT_ON.extend((sender, receiver))
        atexit.register(_let_go)
        stamp_arrivals(receiver)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            sender.send(b"?")
            _, ancillary, _, _ = receiver.recvmsg(1, socket.CMSG_SPACE(16))
            if ancillary:
                return True
            time.sleep(0.001)
    except OSError:
        return False  # a kernel (or sandbox) without the option, or without loopback
    return False


class StampedSocket(asyncio.Transport):
    """A connected, non-blocking TCP socket driving an asyncio protocol; each read dated by the kernel.

    The loop calls a `StampedReader` (C where the extension was built) when the socket is readable: it reads, dates
    the read and calls the protocol with no Python frame in between; `arrival` is its date of the read being
    delivered (when the bytes arrived, on `perf_counter`'s clock)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: asyncio.Protocol,
                 lag: ReadLag | None = None) -> None:
        """`lag`: where its reads' lag is added when it closes."""
        super().__init__()
        self._lag = lag
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._reader = StampedReader(sock, protocol, self._read_ended)
        self.arrival: Callable[[], float] = self._reader.arrival
        self._unsent = bytearray()
        self._closing = False
        self._closed = False
        self._reading = True
        protocol.connection_made(self)
        loop.add_reader(self._fd, self._reader)

    def not_a_chunk(self) -> None:
        """From the protocol, while it takes a read: that read ended a response or held only a head, so no later
        chunk can share its stamp (`ReadLag` leaves its lag out)."""
        self._reader.not_a_chunk()

    def _read_ended(self, exc: BaseException | None) -> None:
        """From the reader: the peer ended the stream (None), the read failed (OSError), or the protocol raised,
        which the loop's exception handler hears of, as from asyncio's own transports."""
        if exc is not None:
            if not isinstance(exc, OSError):
                self._loop.call_exception_handler({
                    "message": "Fatal error: protocol.data_received() call failed.", "exception": exc,
                    "transport": self, "protocol": self._protocol})
            self._close(exc if isinstance(exc, Exception) else None)
            return
        self._loop.remove_reader(self._fd)
        self._reading = False
        if not self._protocol.eof_received():
            self.close()

    # asyncio.Transport ----------------------------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        if not self._unsent:
            try:
                sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._close(exc)
                return
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
            self._loop.add_writer(self._fd, self._write_ready)
        self._unsent += data

    def _write_ready(self) -> None:
        try:
            sent = self._sock.send(self._unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(exc)
            return
        del self._unsent[:sent]
        if not self._unsent:
            self._loop.remove_writer(self._fd)
            if self._closing:
                self._close(None)

    def get_write_buffer_size(self) -> int:
        return len(self._unsent)

    def pause_reading(self) -> None:
        if self._reading and not self._closing:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def resume_reading(self) -> None:
        if not self._reading and not self._closing:
            self._loop.add_reader(self._fd, self._reader)
            self._reading = True

    def is_reading(self) -> bool:
        return self._reading

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop reading; close once what was written has gone."""
        if self._closing:
            return
        self._closing = True
        if not self._unsent:
            self._close(None)
        elif self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def abort(self) -> None:
        self._close(None)

    def _close(self, exc: Exception | None) -> None:
        self._closing = True
        if self._closed:
            return
        self._closed = True
        if self._reading:
            self._loop.remove_reader(self._fd)
        if self._unsent:
            self._loop.remove_writer(self._fd)
            self._unsent.clear()
        self._sock.close()
        if self._lag is not None:
            reader = self._reader
            self._lag.add(reader.reads, reader.late_reads, reader.max_lag)
        self._loop.call_soon(self._protocol.connection_lost, exc)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol  # type: ignore[assignment]
        self._reader.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return self._sock
        if name in ("peername", "sockname") and not self._closed:
            return self._sock.getpeername() if name == "peername" else self._sock.getsockname()
        return default


async def connect(loop: asyncio.AbstractEventLoop, host: str, port: int,
                  protocol_factory: Callable[[], asyncio.Protocol],
                  lag: ReadLag | None = None) -> tuple[StampedSocket, asyncio.Protocol]:
    """Open a TCP connection (each address of `host` in turn, as `loop.create_connection` does) with TCP_NODELAY
    and kernel stamps; raises the last address's `OSError` when none accepts, or one saying that the kernel here
    does not stamp TCP reads (`available`)."""
    if not available():
        raise OSError("the kernel does not stamp TCP reads here")
    failure: OSError | None = None
    for family, kind, proto, _, address in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stamp_arrivals(sock)
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            failure = exc
            continue
        except BaseException:
            sock.close()
            raise
        protocol = protocol_factory()
        return StampedSocket(loop, sock, protocol, lag), protocol
    raise failure or OSError(f"{host}: no address")
