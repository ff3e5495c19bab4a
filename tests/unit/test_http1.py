"""The tester's and the gateway's HTTP/1.1 reader on byte streams cut at every possible point: de-chunking, lengths,
failures, and heads a hostile or unusual server sends (header injection, interim 1xx, bodiless 204/304/HEAD,
oversize heads)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import time

import pytest

from dfserve import sglang
from dfserve.errors import UserError
from dfserve.http1 import (
    BadResponse,
    BodyTooLarge,
    Disconnected,
    Pool,
    ReadTimeout,
    Response,
    _Connection,
    is_base_url,
)
from dfserve.relay_core import EventRelay, EventTooLarge, frame

CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"f\r\ndata: {\"a\":1}\n\n\r\n"
           b"11\r\ndata: {\"bb\":22}\n\n\r\n"
           b"0\r\n\r\n")
PAYLOAD = b'data: {"a":1}\n\ndata: {"bb":22}\n\n'


class FakeTransport:
    """Keeps what the connection writes and hands reads to the protocol of the moment, which the connection
    changes for the length of a chunked body."""

    def __init__(self, protocol: asyncio.Protocol) -> None:
        self.protocol = protocol
        self.written = b""
        self.aborted = False
        protocol.connection_made(self)  # type: ignore[arg-type]

    def set_protocol(self, protocol: asyncio.Protocol) -> None:
        self.protocol = protocol

    def deliver(self, data: bytes) -> None:
        self.protocol.data_received(data)

    def lose(self) -> None:
        self.protocol.connection_lost(None)

    def write(self, data: bytes) -> None:
        self.written += data

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


def feed(parts: list[bytes], close: bool = False, no_body: bool = False,
         max_body_bytes: int | None = None) -> tuple[_Connection, Response, asyncio.Future[Response]]:
    async def go() -> tuple[_Connection, Response, asyncio.Future[Response]]:
        ticks = itertools.count()
        connection = _Connection(lambda: float(next(ticks)))
        transport = FakeTransport(connection)
        response = Response(max_body_bytes=max_body_bytes)
        _, done = connection.start(b"POST / HTTP/1.1\r\n\r\n", response, no_body)
        for part in parts:
            transport.deliver(part)
        if close:
            transport.lose()
        return connection, response, done

    return asyncio.run(go())


def test_chunked_body_cut_at_every_byte_gives_the_same_payload() -> None:
    for cut in range(1, len(CHUNKED)):
        connection, response, done = feed([CHUNKED[:cut], CHUNKED[cut:]])
        assert done.done() and not done.exception(), cut
        assert response.status == 200 and response.body() == PAYLOAD, cut
        assert connection.reusable
        assert connection.transport.protocol is connection, cut  # type: ignore[union-attr]  # taken back


def test_a_chunk_broken_while_the_dechunker_reads_is_a_bad_response() -> None:
    crlf = CHUNKED.index(b"\r\n11\r\n")  # after the first chunk's data
    connection, response, done = feed([CHUNKED[:crlf], b"XX" + CHUNKED[crlf + 2 :]])
    assert isinstance(done.exception(), BadResponse) and "CRLF" in str(done.exception())
    assert connection.transport.protocol is connection and connection.closed  # type: ignore[union-attr]
    assert response.body() == b'data: {"a":1}\n\n'


def test_each_read_keeps_its_own_arrival_time() -> None:
    head_end = CHUNKED.index(b"\r\n\r\n") + 4
    first_end = CHUNKED.index(b"11\r\n")
    head, first, rest = CHUNKED[:head_end], CHUNKED[head_end:first_end], CHUNKED[first_end:]
    _, response, _ = feed([head, first, rest])
    times = [t for t, _ in response.pieces]
    assert times == sorted(times) and len(times) == 2  # the head's read carried no payload
    assert response.pieces[0][1] == b'data: {"a":1}\n\n'


def test_content_length_and_close_delimited_bodies() -> None:
    body = b'{"error":{"message":"busy"}}'
    _, response, done = feed([b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 28\r\n\r\n" + body])
    assert done.done() and response.status == 503 and response.body() == body
    connection, response, done = feed([b"HTTP/1.0 200 OK\r\n\r\nabc", b"def"], close=True)
    assert done.result() is response and response.body() == b"abcdef" and not connection.reusable


def test_a_connection_lost_mid_stream_keeps_what_arrived() -> None:
    _, response, done = feed([CHUNKED[:110]], close=True)
    assert isinstance(done.exception(), Disconnected)
    assert response.body().startswith(b'data: {"a":1}')


@pytest.mark.parametrize("head", [b"SPDY/3 200 OK\r\n\r\n", b"HTTP/1.1 OK\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"])
def test_malformed_heads_fail_as_bad_responses(head: bytes) -> None:
    connection, _, done = feed([head])
    assert isinstance(done.exception(), BadResponse) and connection.closed


def test_a_head_whose_lines_end_in_bare_lfs_fails_at_once() -> None:
    for head in (b"HTTP/1.1 200 OK\ncontent-length: 2\n\n{}", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\n{}"):
        connection, _, done = feed([head])
        assert isinstance(done.exception(), BadResponse) and "bare LF" in str(done.exception()), head
        assert connection.closed


def test_a_body_past_its_bound_fails_the_response_and_is_let_go() -> None:
    plain = b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n" + b"x" * 40
    for parts in ([CHUNKED], [CHUNKED[:60], CHUNKED[60:]], [plain[:50], plain[50:]]):
        connection, response, done = feed(parts, max_body_bytes=len(PAYLOAD) - 1)
        assert isinstance(done.exception(), BodyTooLarge) and connection.closed
        assert response.pieces == []
    _, response, done = feed([CHUNKED], max_body_bytes=len(PAYLOAD))
    assert done.result() is response and response.body() == PAYLOAD


def test_bad_chunk_size_is_a_bad_response() -> None:
    _, _, done = feed([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"])
    assert isinstance(done.exception(), BadResponse)


def test_request_bytes_carry_host_length_and_path_prefix() -> None:
    pool = Pool("http://127.0.0.1:8080/prefix/", lambda: 0.0)
    request = pool.request_bytes("/generate", b"{}")
    assert request.startswith(b"POST /prefix/generate HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n")
    assert b"Content-Length: 2\r\n\r\n{}" in request


def test_head_is_signalled_before_the_body_with_header_values_as_sent() -> None:
    head_end = CHUNKED.index(b"\r\n\r\n") + 4
    connection, response, done = feed([CHUNKED[:head_end]])
    assert connection.head is not None and connection.head.done() and not done.done()
    assert response.header(b"content-type") == b"text/event-stream" and response.header(b"x-none") is None
    assert (b"transfer-encoding", b"chunked") in response.headers


HEAD_BYTES = CHUNKED.index(b"\r\n\r\n") + 4


def test_read_timeout_fires_only_after_a_quiet_period() -> None:
    async def go(gaps: list[float], head: bool = True) -> BaseException | None:
        connection = _Connection(time.perf_counter, read_timeout_s=0.5)
        transport = FakeTransport(connection)
        _, done = connection.start(b"POST / HTTP/1.1\r\n\r\n", Response())
        transport.deliver(CHUNKED[: HEAD_BYTES + 10] if head else CHUNKED[:10])
        for n, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            transport.deliver(b"" if head else CHUNKED[10 + n : 11 + n])
        await asyncio.sleep(0.02)
        return done.exception() if done.done() else None

    # Gaps far from the timeout either way: a loop held up by a loaded machine fires the timeout and the next read
    # in one turn, the timeout first.
    assert asyncio.run(go([0.1] * 8)) is None  # 800 ms in all, never 500 ms without a read
    assert isinstance(asyncio.run(go([0.1, 0.9])), ReadTimeout)
    trickled = asyncio.run(go([0.1] * 8, head=False))  # a byte of the head every 100 ms: no later deadline
    assert isinstance(trickled, ReadTimeout) and str(trickled).startswith("no response head within 0.")


@pytest.mark.parametrize("cancelled_then", [False, True])
def test_a_server_that_never_answers_fails_the_request_once_and_nothing_is_left_unretrieved(
        monkeypatch: pytest.MonkeyPatch, cancelled_then: bool) -> None:
    """The read timeout fails the response; a caller's own timeout of the same length may cancel the wait for its
    head in the same turn of the loop: either way one failure is raised, none reported later as never retrieved."""
    async def go() -> tuple[type[BaseException] | None, list[str]]:
        reported: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                await reader.readuntil(b"\r\n\r\n")
                await reader.read()  # no answer, until the client gives up
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        pool = Pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", time.perf_counter, read_timeout_s=0.05)
        callers = [asyncio.create_task(pool.open(b"GET", "/server_info", b"", b"", Response()))]
        fail = _Connection._fail

        def fail_then_cancel(connection: _Connection, exc: Exception) -> None:
            fail(connection, exc)
            if cancelled_then:
                callers[0].cancel()  # before the caller wakes to the failure

        monkeypatch.setattr(_Connection, "_fail", fail_then_cancel)
        raised: type[BaseException] | None = None
        try:
            await callers[0]
        except (ReadTimeout, asyncio.CancelledError) as exc:
            raised = type(exc)  # not the exception: its traceback would keep the request's futures alive
        pool.close()
        server.close()
        callers.clear()
        gc.collect()
        await asyncio.sleep(0.01)
        return raised, reported

    raised, reported = asyncio.run(go())
    assert raised is (asyncio.CancelledError if cancelled_then else ReadTimeout) and reported == []


def test_open_returns_at_the_head_then_the_connection_is_reused() -> None:
    async def go() -> tuple[list[bytes], int]:
        accepted = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            try:
                while await reader.readuntil(b"\r\n\r\n"):
                    await reader.readexactly(2)
                    writer.write(CHUNKED[: CHUNKED.index(b"\r\n\r\n") + 4])
                    await asyncio.sleep(0.05)
                    writer.write(CHUNKED[CHUNKED.index(b"\r\n\r\n") + 4 :])
            except asyncio.IncompleteReadError:
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pool(f"http://127.0.0.1:{port}", time.perf_counter, connect_timeout_s=1, read_timeout_s=1)
        bodies = []
        for _ in range(2):
            response = Response()
            call = await pool.open(b"POST", "/generate", b"{}", b"Content-Type: application/json\r\n", response)
            assert response.status == 200 and not call.done.done()
            await call.finish()
            call.close()
            bodies.append(response.body())
        pool.close()
        server.close()
        await server.wait_closed()
        return bodies, accepted

    bodies, accepted = asyncio.run(go())
    assert bodies == [PAYLOAD, PAYLOAD] and accepted == 1


def test_a_kept_alive_connection_the_server_closed_unannounced_is_not_reused_and_no_request_goes_twice() -> None:
    """`closes`: the server closes each connection right after its answer, saying nothing (no `Connection: close`):
    the next request finds the end in the kernel before the loop has read it, and takes a new connection. `drops`:
    the server reads the second request of a connection and drops it: that request fails, and is not sent again
    (the server may have acted on it)."""
    async def go(server_does: str) -> tuple[list[object], int, int]:
        accepted = requests = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted, requests
            accepted += 1
            try:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)
                requests += 1
                writer.write(CHUNKED)
                if server_does == "drops":
                    await reader.readuntil(b"\r\n\r\n")
                    requests += 1
            except asyncio.IncompleteReadError:
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        pool = Pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", time.perf_counter,
                    connect_timeout_s=1, read_timeout_s=1)
        outcomes: list[object] = []
        for i in range(4):
            response = Response()
            try:
                if i % 2:
                    call = await pool.open(b"POST", "/generate", b"{}", b"", response)
                    await call.finish()
                    call.close()
                else:
                    await pool.fetch("/generate", b"{}", b"", response)
                outcomes.append(response.body())
            except Disconnected as exc:
                outcomes.append(type(exc))
            time.sleep(0.05)  # noqa: ASYNC251  # the server's close reaches the kernel; the loop does not read it
        pool.close()
        server.close()
        await server.wait_closed()
        return outcomes, accepted, requests

    assert asyncio.run(go("closes")) == ([PAYLOAD] * 4, 4, 4)
    assert asyncio.run(go("drops")) == ([PAYLOAD, Disconnected, PAYLOAD, Disconnected], 2, 4)


def test_the_read_timeout_holds_for_each_request_of_a_kept_alive_connection() -> None:
    async def go(pause_s: float) -> list[BaseException | None]:
        connection = _Connection(time.perf_counter, read_timeout_s=0.25)
        transport = FakeTransport(connection)
        outcomes: list[BaseException | None] = []
        for _ in range(2):
            _, done = connection.start(b"POST / HTTP/1.1\r\n\r\n", Response())
            transport.deliver(CHUNKED)
            outcomes.append(done.exception())
            await asyncio.sleep(pause_s)
        _, done = connection.start(b"POST / HTTP/1.1\r\n\r\n", Response())
        transport.deliver(CHUNKED[:60])
        await asyncio.sleep(0.6)
        outcomes.append(done.exception() if done.done() else None)
        return outcomes

    for pause_s in (0.0, 0.1, 0.4):  # the timer of an earlier request still pending, or long gone
        first, second, stalled = asyncio.run(go(pause_s))
        assert first is None and second is None and isinstance(stalled, ReadTimeout), pause_s


@pytest.mark.parametrize("extra", [
    CHUNKED + b"HTTP/1.1 200 OK\r\n",  # after a chunked body
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokjunk",  # after a Content-Length body
])
def test_bytes_after_a_body_make_the_connection_unfit_for_reuse(extra: bytes) -> None:
    connection, _, done = feed([extra])
    assert done.done() and not done.exception() and not connection.reusable
    connection, _, done = feed([extra[:-6], extra[-6:]])  # the stray bytes in a read of their own
    assert done.done() and not done.exception() and not connection.reusable


def test_a_transfer_coding_other_than_chunked_is_refused() -> None:
    _, _, done = feed([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"])
    assert isinstance(done.exception(), BadResponse) and "transfer-encoding" in str(done.exception())


def test_a_kept_alive_connection_lets_go_of_the_sink_it_served() -> None:
    class Sink:
        def __init__(self) -> None:
            self.pieces: list[bytes] = []
            self.over = False

        def received(self, now: float, data: bytes) -> None:
            self.pieces.append(data)

        def ended(self) -> None:
            self.over = True

    async def go() -> tuple[_Connection, Sink]:
        connection = _Connection(time.perf_counter)
        transport = FakeTransport(connection)
        _, done = connection.start(b"POST / HTTP/1.1\r\n\r\n", Response())
        transport.deliver(CHUNKED[:90])
        sink = Sink()
        connection.attach(sink)
        transport.deliver(CHUNKED[90:])
        await done
        return connection, sink

    connection, sink = asyncio.run(go())
    assert b"".join(sink.pieces) == PAYLOAD and sink.over and connection.reusable
    assert connection.sink is connection.response and connection._dechunker is not None
    assert connection._dechunker.sink is connection.response


@pytest.mark.parametrize("injected", [b"a\nSet-Cookie: pwned=1", b"a\rSet-Cookie: pwned=1",
                                      b"a\r\n Set-Cookie: pwned=1", b"a\x00b"])
def test_a_header_value_with_a_bare_line_break_is_refused_never_split(injected: bytes) -> None:
    head = b"HTTP/1.1 200 OK\r\nx-evil: " + injected + b"\r\nContent-Length: 2\r\n\r\nok"
    for parts in ([head], [head[:20], head[20:]]):
        connection, response, done = feed(parts)
        assert isinstance(done.exception(), BadResponse) and connection.closed
        assert not any(b"set-cookie" in name or b"\n" in value for name, value in response.headers)


def test_the_head_limit_holds_however_the_head_arrives() -> None:
    fields = b"".join(b"x-field-%05d: %s\r\n" % (n, b"v" * 40) for n in range(1400))  # about 70 KiB
    head = b"HTTP/1.1 200 OK\r\n" + fields + b"Content-Length: 2\r\n\r\nok"
    for parts in ([head], [head[:30000], head[30000:]], [head[:100], head[100:60000], head[60000:]]):
        connection, _, done = feed(parts)
        assert isinstance(done.exception(), BadResponse) and "head over 65536 bytes" in str(done.exception())
        assert connection.closed
    fitting = b"HTTP/1.1 200 OK\r\n" + fields[:60000].rpartition(b"\r\n")[0] + b"\r\nContent-Length: 2\r\n\r\nok"
    _, response, done = feed([fitting])
    assert done.result() is response and response.body() == b"ok" and len(response.headers) > 1000


def test_interim_responses_are_skipped_and_count_toward_the_head_limit() -> None:
    final = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
    whole = interim + final
    for cut in range(1, len(whole)):
        connection, response, done = feed([whole[:cut], whole[cut:]])
        assert done.result() is response and response.status == 200 and response.body() == b"ok", cut
        assert response.header(b"link") is None and connection.reusable, cut
    hint = b"HTTP/1.1 103 Early Hints\r\nLink: " + b"x" * 4000 + b"\r\n\r\n"
    _, _, done = feed([hint * 17 + final])
    assert isinstance(done.exception(), BadResponse)


@pytest.mark.parametrize("head", [b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
                                  b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
                                  b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n"])
def test_an_upgrade_or_another_protocol_is_refused(head: bytes) -> None:
    connection, _, done = feed([head])
    assert isinstance(done.exception(), BadResponse) and connection.closed


@pytest.mark.parametrize(("head", "no_body"), [
    (b"HTTP/1.1 204 No Content\r\n\r\n", False),
    (b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n", False),
    (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 1234\r\n\r\n", False),
    (b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n", False),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n", True),  # the answer to HEAD
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", True),
])
def test_responses_without_a_body_are_complete_at_their_head(head: bytes, no_body: bool) -> None:
    connection, response, done = feed([head], no_body=no_body)
    assert done.result() is response and response.body() == b"" and connection.reusable
    assert connection.head is not None and connection.head.done()
    connection, _, done = feed([head + b"junk"], no_body=no_body)  # bytes no request asked for
    assert done.done() and not done.exception() and not connection.reusable


def test_a_connection_header_listing_close_ends_reuse() -> None:
    connection, _, done = feed([b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\nContent-Length: 0\r\n\r\n"])
    assert done.done() and not done.exception() and not connection.reusable


def test_whitespace_around_header_values_is_not_part_of_them() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: \tchunked \t\r\nX-Engine:  stub  \r\n\r\n"
    connection, response, done = feed([CHUNKED.replace(CHUNKED[:CHUNKED.index(b"\r\n\r\n") + 4], head)])
    assert done.result() is response and response.body() == PAYLOAD and connection.reusable
    assert response.header(b"x-engine") == b"stub"


def test_an_event_past_the_relay_cap_fails_the_response_with_its_reason() -> None:
    """Whether the relay refuses a piece kept before it was attached, or one the de-chunker hands it as the
    transport's protocol, the response fails with `EventTooLarge`, and the connection is closed."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    marks = sglang.NATIVE_TOKENS

    async def go(before: bytes, after: bytes) -> tuple[_Connection, BaseException | None, list[bytes]]:
        connection = _Connection(time.perf_counter)
        transport = FakeTransport(connection)
        _, done = connection.start(b"POST / HTTP/1.1\r\n\r\n", Response())
        transport.deliver(head + before)
        written: list[bytes] = []
        connection.attach(EventRelay(written.append, False, marks.keys, marks.cumulative, (), 64))
        if not done.done():
            transport.deliver(after)
        return connection, done.exception(), written

    event = b"data: {}\n\n"
    for before, after in ((frame(event + b"x" * 100), b""), (frame(event + b"x" * 10), frame(b"y" * 100))):
        connection, failure, written = asyncio.run(go(before, after))
        assert isinstance(failure, EventTooLarge) and connection.closed and written == [event]


def test_a_bad_base_url_is_named_as_the_field_it_came_from() -> None:
    assert is_base_url("https://host:8443/prefix") and not is_base_url("http://") and not is_base_url("ftp://h")
    with pytest.raises(UserError, match=r"^base_url 'http://': not an http\(s\) URL with a host$"):
        Pool("http://", time.perf_counter)
