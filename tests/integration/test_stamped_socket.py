"""The kernel-dated TCP transport on loopback, under asyncio's loop and uvloop (the tester's), with the reader in C
and in its pure-Python twin: a read is dated when its bytes arrived however late the loop reads them; writes
larger than the socket takes, pauses, the peer's end or reset, refused connections; and the HTTP client over it."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, cast

import pytest
import uvloop

from dfserve import _relay, _relay_py, stamped_socket
from dfserve.http1 import ConnectFailed, Pool, Response, kernel_stamps_for
from dfserve.stamped_socket import ReadLag, StampedSocket, connect

LOOPS: dict[str, Callable[[Coroutine[Any, Any, Any]], Any]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}
BUSY_S = 0.06
SLACK_S = 0.0005
"""Clock reading to clock reading: the date is the kernel's stamp, taken inside `sendall` on loopback."""


@pytest.fixture(params=[_relay, _relay_py], ids=["c", "python"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport's reader in C, then its twin: both must pass every test that takes this fixture."""
    monkeypatch.setattr(stamped_socket, "StampedReader", request.param.StampedReader)


class Recorder(asyncio.Protocol):
    """What the transport did to its protocol, in order, with each read's date and the clock when it was read."""

    def __init__(self) -> None:
        self.transport: StampedSocket | None = None
        self.reads: list[tuple[float, float, bytes]] = []
        self.calls: list[str] = []
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, StampedSocket)
        self.transport = transport
        self.calls.append("made")

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.reads.append((self.transport.arrival(), time.perf_counter(), data))
        self.calls.append("data")

    def eof_received(self) -> bool | None:
        self.calls.append("eof")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.calls.append("lost")
        self.lost.set_result(exc)

    def received(self) -> bytes:
        return b"".join(data for _, _, data in self.reads)


def send(peer: socket.socket, data: bytes) -> tuple[float, float]:
    """Send `data`; the clock just before and just after, between which the kernel stamps it."""
    before = time.perf_counter()
    peer.sendall(data)
    return before, time.perf_counter()


def dated_within(arrival: float, window: tuple[float, float]) -> bool:
    return window[0] - SLACK_S <= arrival <= window[1] + SLACK_S


def hold_the_loop() -> None:
    """Keep the loop busy for `BUSY_S`, as a tester's loop is with other streams' work."""
    end = time.perf_counter() + BUSY_S
    while time.perf_counter() < end:
        pass


@contextmanager
def listener() -> Iterator[socket.socket]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        yield server
    finally:
        server.close()


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while not condition():
        assert time.perf_counter() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def opened(server: socket.socket) -> tuple[StampedSocket, Recorder, socket.socket]:
    transport, protocol = await connect(asyncio.get_running_loop(), "127.0.0.1", server.getsockname()[1], Recorder)
    peer, _ = server.accept()
    assert isinstance(protocol, Recorder)
    return transport, protocol, peer


@pytest.mark.parametrize("loop", LOOPS)
def test_a_read_is_dated_when_its_bytes_arrived_not_when_a_busy_loop_got_to_them(loop: str, reader: None) -> None:
    async def go() -> tuple[tuple[float, float], float, float, bytes]:
        with listener() as server:
            transport, protocol, peer = await opened(server)
            sent = send(peer, b"first chunk")
            hold_the_loop()  # while the bytes wait in the kernel
            await until(lambda: bool(protocol.reads))
            arrival, read_at, data = protocol.reads[0]
            transport.close()
            peer.close()
            return sent, arrival, read_at, data

    sent, arrival, read_at, data = LOOPS[loop](go())
    assert data == b"first chunk"
    assert read_at - sent[1] >= BUSY_S
    assert dated_within(arrival, sent), (arrival - sent[0], arrival - sent[1])


class EndsOnEnd(Recorder):
    """Says that a read ending in b"end" or b"head" held no chunk a later one could share a stamp with, as the HTTP
    client says of the read that ends a response or holds only its head: so only the held reads' lags are counted,
    however slow the machine is to read the others."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if data.endswith((b"end", b"head")) and self.transport is not None:
            self.transport.not_a_chunk()


def lag_after(loop: str, sends: list[tuple[bytes, bool]]) -> tuple[ReadLag, float]:
    """What a connection adds to a `ReadLag` (which already holds 3 reads, 1 late, 1 ms) after reading `sends`,
    each read when sent (False) or after the loop was held for `BUSY_S` (True); and the longest a send waited to be
    read, from before it was sent (no read's lag can be longer, however slow the machine)."""
    async def go() -> tuple[ReadLag, float]:
        lag = ReadLag(reads=3, late_reads=1, max_lag_s=0.001)
        longest_wait_s = 0.0
        with listener() as server:
            transport, protocol = await connect(asyncio.get_running_loop(), "127.0.0.1", server.getsockname()[1],
                                                EndsOnEnd, lag)
            peer, _ = server.accept()
            assert isinstance(protocol, EndsOnEnd)
            for count, (data, held) in enumerate(sends, 1):
                sent = time.perf_counter()
                peer.sendall(data)
                if held:
                    hold_the_loop()
                await until(lambda: len(protocol.reads) == count)  # noqa: B023 (awaited before the next turn)
                longest_wait_s = max(longest_wait_s, time.perf_counter() - sent)
            assert lag.reads == 3, "added when the connection closes"
            transport.close()
            peer.close()
        return lag, longest_wait_s

    return cast(tuple[ReadLag, float], LOOPS[loop](go()))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_closed_connection_adds_how_long_its_reads_waited_for_the_loop(loop: str, reader: None) -> None:
    lag, longest_wait_s = lag_after(loop, [(b"head", False), (b"chunk", True), (b"chunk", False)])
    assert lag.reads == 6 and lag.late_reads == 2 and BUSY_S <= lag.max_lag_s <= longest_wait_s + SLACK_S


@pytest.mark.parametrize("loop", LOOPS)
def test_the_last_read_of_a_response_is_not_counted_however_late(loop: str, reader: None) -> None:
    """A late last read dates nothing wrongly: no chunk of its response follows it to share its stamp."""
    lag, _ = lag_after(loop, [(b"head", False), (b"last chunk, end", True), (b"next head", True)])
    assert lag.reads == 6 and lag.late_reads == 1 and lag.max_lag_s < BUSY_S


@pytest.mark.parametrize("loop", LOOPS)
def test_the_peers_end_reaches_the_protocol_after_its_bytes_then_the_connection_is_lost(loop: str, reader: None) -> None:
    async def go() -> tuple[list[str], bytes, Exception | None, bool]:
        with listener() as server:
            transport, protocol, peer = await opened(server)
            peer.sendall(b"last words")
            peer.close()
            exc = await asyncio.wait_for(protocol.lost, 5)
            return protocol.calls, protocol.received(), exc, transport.is_closing()

    calls, received, exc, closing = LOOPS[loop](go())
    assert calls == ["made", "data", "eof", "lost"] and received == b"last words" and exc is None and closing


@pytest.mark.parametrize("loop", LOOPS)
def test_a_reset_by_the_peer_loses_the_connection_with_the_error(loop: str, reader: None) -> None:
    async def go() -> tuple[Exception | None, list[str]]:
        with listener() as server:
            _, protocol, peer = await opened(server)
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            peer.close()  # with a zero linger: a reset, not an end
            return await asyncio.wait_for(protocol.lost, 5), protocol.calls

    exc, calls = LOOPS[loop](go())
    assert isinstance(exc, ConnectionResetError) and calls == ["made", "lost"]


class Failing(Recorder):
    def data_received(self, data: bytes) -> None:
        raise RuntimeError("the protocol broke")


@pytest.mark.parametrize("loop", LOOPS)
def test_a_protocol_that_raises_loses_its_connection_and_the_loop_hears_why(loop: str, reader: None) -> None:
    async def go() -> tuple[Exception | None, list[str], list[str]]:
        reported: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context["message"]))
        with listener() as server:
            _, protocol = await connect(asyncio.get_running_loop(), "127.0.0.1", server.getsockname()[1], Failing)
            peer, _ = server.accept()
            peer.sendall(b"anything")
            assert isinstance(protocol, Failing)
            exc = await asyncio.wait_for(protocol.lost, 5)
            peer.close()
            return exc, protocol.calls, reported

    exc, calls, reported = LOOPS[loop](go())
    assert isinstance(exc, RuntimeError) and calls == ["made", "lost"]
    assert reported == ["Fatal error: protocol.data_received() call failed."]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_write_larger_than_the_socket_takes_goes_whole_and_close_waits_for_it(loop: str, reader: None) -> None:
    payload = bytes(range(256)) * (32 * 1024)  # 8 MiB

    async def go() -> tuple[int, bytes, list[str]]:
        with listener() as server:
            transport, protocol, peer = await opened(server)
            transport.write(payload)
            queued = transport.get_write_buffer_size()
            transport.close()
            peer.setblocking(False)
            got = bytearray()
            while True:
                try:
                    data = peer.recv(1 << 20)
                except BlockingIOError:
                    await asyncio.sleep(0.001)
                    continue
                if not data:
                    break
                got += data
            await asyncio.wait_for(protocol.lost, 5)
            peer.close()
            return queued, bytes(got), protocol.calls

    queued, got, calls = LOOPS[loop](go())
    assert queued > 0, "the kernel took 8 MiB at once: the test no longer covers a partial write"
    assert got == payload and calls == ["made", "lost"]


@pytest.mark.parametrize("loop", LOOPS)
def test_paused_reading_leaves_the_bytes_in_the_kernel_with_their_arrival(loop: str, reader: None) -> None:
    async def go() -> tuple[int, tuple[float, float], float, float]:
        with listener() as server:
            transport, protocol, peer = await opened(server)
            transport.pause_reading()
            sent = send(peer, b"held")
            await asyncio.sleep(BUSY_S)
            while_paused = len(protocol.reads)
            resumed = time.perf_counter()
            transport.resume_reading()
            await until(lambda: bool(protocol.reads))
            transport.abort()
            peer.close()
            return while_paused, sent, resumed, protocol.reads[0][0]

    while_paused, sent, resumed, arrival = LOOPS[loop](go())
    assert while_paused == 0
    assert dated_within(arrival, sent) and resumed - sent[1] >= BUSY_S / 2


def test_a_refused_connection_raises_the_os_error_and_the_pool_names_it() -> None:
    with listener() as server:
        port = server.getsockname()[1]
    async def open_one() -> None:
        await connect(asyncio.get_running_loop(), "127.0.0.1", port, Recorder)

    with pytest.raises(ConnectionRefusedError):
        uvloop.run(open_one())

    async def fetch() -> None:
        await Pool(f"http://127.0.0.1:{port}", time.perf_counter, kernel_stamps=True).fetch(
            "/generate", b"{}", b"", Response())

    with pytest.raises(ConnectFailed, match=f"127.0.0.1:{port}"):
        uvloop.run(fetch())


def test_a_kernel_without_the_option_means_no_kernel_stamps_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(sock: socket.socket) -> None:
        raise OSError(92, "Protocol not available")

    monkeypatch.setattr(stamped_socket, "stamp_arrivals", refused)
    assert stamped_socket.available.__wrapped__(0.05) is False
    assert stamped_socket.available()  # the answer this process found at its first look, kept


def test_the_pool_dates_kernel_stamps_on_perf_counter_and_only_over_plain_http() -> None:
    assert kernel_stamps_for("http://127.0.0.1:30000") and not kernel_stamps_for("https://127.0.0.1:30000")
    assert not Pool("https://127.0.0.1:30000", time.perf_counter, kernel_stamps=True).kernel_stamps
    with pytest.raises(ValueError, match="perf_counter"):
        Pool("http://127.0.0.1:30000", time.monotonic, kernel_stamps=True)


HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


@asynccontextmanager
async def fetching_one() -> AsyncIterator[tuple[Pool, Response, socket.socket, asyncio.Future[None]]]:
    """The tester's path: a kernel-stamped pool fetching one request from a server played by the test (the peer, its
    request read); the response ended by the test is awaited, and the pool closed, on the way out."""
    loop = asyncio.get_running_loop()
    with listener() as server:
        server.setblocking(False)
        pool = Pool(f"http://127.0.0.1:{server.getsockname()[1]}", time.perf_counter, kernel_stamps=True)
        response = Response()
        fetching = asyncio.ensure_future(pool.fetch("/generate", b"{}", b"", response))
        peer, _ = await loop.sock_accept(server)
        await loop.sock_recv(peer, 65536)
        yield pool, response, peer, fetching
        await asyncio.wait_for(fetching, 5)
        pool.close()
        peer.close()


def test_every_piece_of_a_chunked_response_is_dated_by_its_arrival_through_the_http_client(reader: None) -> None:
    """Head, then chunks read by the de-chunker as the transport's protocol, each dated by the kernel while the
    loop is busy when they come."""
    async def go() -> tuple[list[tuple[float, float]], list[tuple[float, bytes]], list[float], ReadLag | None]:
        async with fetching_one() as (pool, response, peer, _):
            sent, read_by = [], []
            for count, piece in enumerate((HEAD + b"5\r\nfirst\r\n", b"6\r\nsecond\r\n"), 1):
                sent.append(send(peer, piece))
                hold_the_loop()  # while the piece waits in the kernel
                await until(lambda: len(response.pieces) == count)  # noqa: B023 (awaited before the next turn)
                read_by.append(time.perf_counter())
            peer.sendall(b"0\r\n\r\n")
        return sent, response.pieces, read_by, pool.read_lag

    sent, pieces, read_by, lag = uvloop.run(go())
    assert [data for _, data in pieces] == [b"first", b"second"]
    for (arrival, _), window, read in zip(pieces, sent, read_by, strict=True):
        assert dated_within(arrival, window) and read - window[1] >= BUSY_S, (arrival - window[0], read - window[1])
    assert lag is not None and (lag.reads, lag.late_reads) == (3, 2)  # both chunks late; the end not counted


def test_a_late_read_of_a_head_alone_is_not_counted_as_a_chunk_left_waiting() -> None:
    """A head shares its stamp with no chunk: however late the loop reads it, no chunk is misdated."""
    async def go() -> tuple[ReadLag | None, float]:
        async with fetching_one() as (pool, response, peer, _):
            peer.sendall(HEAD)
            hold_the_loop()
            await until(lambda: response.status == 200)
            sent = time.perf_counter()
            peer.sendall(b"5\r\nfirst\r\n")
            await until(lambda: len(response.pieces) == 1)
            chunk_wait_s = time.perf_counter() - sent
            peer.sendall(b"0\r\n\r\n")
        return pool.read_lag, chunk_wait_s

    lag, chunk_wait_s = uvloop.run(go())
    # the chunk that followed, read at once, may still be late on a slow machine, by at most how long it waited: the
    # head's lag (BUSY_S) is the test
    assert lag is not None and lag.reads == 3 and lag.late_reads <= 1 and lag.max_lag_s <= chunk_wait_s + SLACK_S


ENDS = {
    "chunked": (HEAD + b"5\r\nfirst\r\n", b"4\r\nlast\r\n0\r\n\r\n"),
    "length": (b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nfirst", b"last"),
    "close": (b"HTTP/1.1 200 OK\r\n\r\nfirst", b"last"),
}


@pytest.mark.parametrize("framing", ENDS)
def test_a_response_is_complete_when_its_last_byte_arrived_not_when_a_busy_loop_got_to_it(
        framing: str, reader: None) -> None:
    """A response's end (`Response.completed`, the load tester's and the gateway's end of a request) is the date of
    the read that completed it, whether the de-chunker, the length or the connection's end said it was the last."""
    async def go() -> tuple[tuple[float, float], float | None, float, bytes]:
        async with fetching_one() as (_, response, peer, fetching):
            first, last = ENDS[framing]
            peer.sendall(first)
            await until(lambda: bool(response.pieces))
            window = send(peer, last)
            if framing == "close":
                peer.shutdown(socket.SHUT_WR)
            hold_the_loop()  # while the last bytes wait in the kernel
            await fetching
            done_at = time.perf_counter()
        return window, response.completed, done_at, response.body()

    window, completed, done_at, body = uvloop.run(go())
    assert body == b"firstlast"
    assert completed is not None and dated_within(completed, window), (completed, window)
    assert done_at - window[1] >= BUSY_S


def test_a_response_abandoned_before_its_end_is_dated_by_its_latest_read() -> None:
    """A stream read to `[DONE]` whose chunked end is still to come (the OpenAI SDK closes there): the gateway ends
    the exchange at the arrival of the last piece read, however late its loop got to it."""
    async def go() -> tuple[tuple[float, float], float, float | None]:
        loop = asyncio.get_running_loop()
        with listener() as server:
            server.setblocking(False)
            pool = Pool(f"http://127.0.0.1:{server.getsockname()[1]}", time.perf_counter, kernel_stamps=True)
            response = Response()
            opening = asyncio.ensure_future(pool.open(b"POST", "/generate", b"{}", b"", response))
            peer, _ = await loop.sock_accept(server)
            await loop.sock_recv(peer, 65536)
            peer.sendall(HEAD)
            call = await opening
            window = send(peer, b"e\r\ndata: [DONE]\n\n\r\n")
            hold_the_loop()
            await until(lambda: bool(response.pieces))
            arrival, completed = call.last_arrival(), response.completed
            call.close()  # abandoned: its connection is closed, not kept
            pool.close()
            peer.close()
        return window, arrival, completed

    window, arrival, completed = uvloop.run(go())
    assert dated_within(arrival, window) and completed is None, (arrival - window[0], completed)
