"""The gateway's HTTP/1.1 server on loopback, talked to with raw sockets: framing, keep-alive, pipelining, limits,
disconnects and back-pressure."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest
import uvloop

from dfserve.gateway.server import Reply, Request, Server, ServerLimits
from dfserve.listen import bind
from dfserve.relay_core import EventRelay

LOOPBACK = "127.0.0.1"
JSON = [(b"content-type", b"application/json")]


LIMITS = ServerLimits(max_body_bytes=1000, max_connections=100, head_timeout_s=30.0, body_timeout_s=30.0,
                      idle_timeout_s=30.0)


async def listen(handler: Callable[[Request, Reply], Awaitable[None]], limits: ServerLimits = LIMITS,
                 refused: Callable[[str], object] = lambda reason: None,
                 answered: Callable[[int], object] = lambda status: None) -> tuple[Server, int]:
    """A started server on a free loopback port, and the port."""
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    sock.listen()
    listener = Server(handler, limits, refused, answered)
    await listener.start(sock)
    return listener, sock.getsockname()[1]


@contextlib.asynccontextmanager
async def server(handler: Callable[[Request, Reply], Awaitable[None]], refused: Callable[[str], object] = lambda reason: None,
                 answered: Callable[[int], object] = lambda status: None, **limits: float) -> AsyncIterator[int]:
    """`listen` with `LIMITS` changed where named; stopped after the block."""
    listener, port = await listen(handler, replace(LIMITS, **limits), refused, answered)
    try:
        yield port
    finally:
        await listener.stop(drain_s=1.0)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One response: Content-Length, chunked, or (neither) up to the connection's end."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    status = int(lines[0].split()[1])
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readexactly(2)
        return status, headers, body
    return status, headers, await reader.read()


async def echo(request: Request, reply: Reply) -> None:
    body = json.dumps({"method": request.method, "path": request.path, "body": request.body.decode(),
                       "headers": {k.decode(): v.decode() for k, v in request.headers}}).encode()
    reply.whole(200, JSON, body)


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra, body)


def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async def scenario() -> list[dict[str, str]]:
        async with server(echo) as port:
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(post("/a%20b?q=1", b"one"))
            first = await read_response(reader)
            writer.write(post("/second", b"two") + post("/third", b"three"))  # pipelined
            second, third = await read_response(reader), await read_response(reader)
            writer.close()
        return [json.loads(r[2]) for r in (first, second, third)]

    first, second, third = asyncio.run(scenario())
    assert (first["method"], first["path"], first["body"]) == ("POST", "/a b", "one")
    assert first["headers"]["host"] == "x"
    assert [second["body"], third["body"]] == ["two", "three"]


def test_expect_continue_then_body() -> None:
    async def scenario() -> tuple[bytes, dict[str, str]]:
        async with server(echo) as port:
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
            interim = await reader.readuntil(b"\r\n\r\n")
            writer.write(b"hello")
            _, _, body = await read_response(reader)
            writer.close()
        return interim, json.loads(body)

    interim, echoed = asyncio.run(scenario())
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n" and echoed["body"] == "hello"


def test_refusals_are_json_errors_that_close_the_connection() -> None:
    cases = {
        "declared too large": post("/x", b"", b"Content-Length: 5000\r\n").replace(b"Content-Length: 0\r\n", b""),
        "chunked too large": b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + b"200\r\n" + b"x" * 512 + b"\r\n" + b"300\r\n" + b"x" * 768 + b"\r\n0\r\n\r\n",
        "malformed": b"POST /x HTTP/9\r\n\r\n",
        "bad target": b"GET http:// HTTP/1.1\r\nHost: x\r\n\r\n",
        "head too large": b"GET /x HTTP/1.1\r\nX-Big: " + b"y" * 70_000 + b"\r\n\r\n",
        "many empty headers in one read": b"GET /x HTTP/1.1\r\nHost: x\r\n" + b"a:\r\n" * 50_000 + b"\r\n",
    }

    async def scenario() -> dict[str, tuple[int, dict[bytes, bytes], bytes, bytes]]:
        answers = {}
        async with server(echo) as port:
            for name, raw in cases.items():
                reader, writer = await asyncio.open_connection(LOOPBACK, port)
                writer.write(raw)
                status, headers, body = await read_response(reader)
                answers[name] = (status, headers, body, await reader.read())
                writer.close()
        return answers

    answers = asyncio.run(scenario())
    assert {name: a[0] for name, a in answers.items()} == {
        "declared too large": 413, "chunked too large": 413, "malformed": 400, "bad target": 400,
        "head too large": 431, "many empty headers in one read": 431}
    for status, headers, body, after in answers.values():
        assert headers[b"connection"] == b"close" and after == b""
        assert json.loads(body)["error"]["code"] == status


def test_streams_are_chunked_for_http11_close_delimited_for_http10_and_bodiless_for_head() -> None:
    async def stream(request: Request, reply: Reply) -> None:
        """Half through the C relay's writer, half through `Reply`: both must frame alike."""
        reply.start(200, [(b"content-type", b"text/event-stream")])
        write, chunked = reply.body_writer()
        relay = EventRelay(write, chunked, (b'"text":',), False, ())
        relay.received(0.0, b"data: 1\n\n")
        await asyncio.sleep(0)
        reply.end(b"data: 2\n\n")

    async def scenario() -> tuple[list[tuple[int, dict[bytes, bytes], bytes]], bytes]:
        answers = []
        async with server(stream) as port:
            for request in (b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /s HTTP/1.0\r\n\r\n"):
                reader, writer = await asyncio.open_connection(LOOPBACK, port)
                writer.write(request)
                answers.append(await read_response(reader))
                writer.close()
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(b"HEAD /s HTTP/1.1\r\nHost: x\r\n\r\n" + post("/s", b""))
            head = await reader.readuntil(b"\r\n\r\n")
            next_one = await read_response(reader)  # the connection carries on: the HEAD answer had no body
            writer.close()
        return answers, head + next_one[2]

    (http11, http10), head = asyncio.run(scenario())
    assert http11[1][b"transfer-encoding"] == b"chunked" and http11[2] == b"data: 1\n\ndata: 2\n\n"
    assert b"transfer-encoding" not in http10[1] and http10[1][b"connection"] == b"close"
    assert http10[2] == b"data: 1\n\ndata: 2\n\n"
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\ndata: 1\n\ndata: 2\n\n")


def test_a_body_ended_by_the_relay_is_not_ended_twice_and_the_connection_carries_on() -> None:
    async def stream(request: Request, reply: Reply) -> None:
        reply.start(200, [(b"content-type", b"text/event-stream")])
        write, chunked = reply.body_writer()
        relay = EventRelay(write, chunked, (b'"text":',), False, ())
        relay.received(0.0, b"data: 1\n\n", request.path == "/last")
        reply.end(relay.pending, relay.last_chunk_written)

    async def scenario() -> tuple[list[tuple[int, dict[bytes, bytes], bytes]], bytes]:
        async with server(stream) as port:
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(post("/last", b"") + post("/not-last", b"") + post("/last", b""))
            answers = [await read_response(reader) for _ in range(3)]
            writer.write_eof()
            rest = await reader.read()
            writer.close()
        return answers, rest

    answers, rest = asyncio.run(scenario())
    assert [(status, body) for status, _, body in answers] == [(200, b"data: 1\n\n")] * 3
    assert rest == b""


def _endless(events: list[str], started: asyncio.Event) -> Callable[[Request, Reply], Awaitable[None]]:
    """A handler that starts a stream and waits: logs its body writer's stop, and its cancellation with whether the
    client left."""
    async def endless(request: Request, reply: Reply) -> None:
        reply.start(200, [])
        write, chunked = reply.body_writer()
        assert write is not None and chunked
        reply.hook(lambda: None, lambda: None, lambda: events.append("gone"))
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append(f"cancelled, disconnected={reply.disconnected}")
            raise

    return endless


def test_a_client_that_leaves_cancels_its_request_and_stops_its_body_writer() -> None:
    async def scenario() -> list[str]:
        events: list[str] = []
        started = asyncio.Event()
        async with server(_endless(events, started)) as port:
            _, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(started.wait(), 5)
            writer.close()
            for _ in range(100):
                if events:
                    break
                await asyncio.sleep(0.01)
        return events

    assert asyncio.run(scenario()) == ["gone", "cancelled, disconnected=True"]


def test_a_full_client_socket_pauses_the_source_until_it_drains() -> None:
    piece = b"x" * 65536

    async def scenario() -> tuple[list[str], int]:
        events: list[str] = []
        paused, resumed = asyncio.Event(), asyncio.Event()

        async def flood(request: Request, reply: Reply) -> None:
            reply.start(200, [])
            reply.hook(lambda: (events.append("pause"), paused.set()), lambda: (events.append("resume"), resumed.set()),
                       lambda: events.append("gone"))
            while not paused.is_set():
                reply.write(piece)
                await asyncio.sleep(0)
            await resumed.wait()
            reply.unhook()
            reply.end()

        async with server(flood) as port:
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.3)  # not reading: the server's socket fills
            _, _, body = await asyncio.wait_for(read_response(reader), 10)
            writer.close()
        return events, len(body)

    events, size = asyncio.run(scenario())
    assert events == ["pause", "resume"]
    assert size > 0 and size % len(piece) == 0


def _silent_client(port: int) -> socket.socket:
    """A connection whose receive buffer is small and which reads nothing until told."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((LOOPBACK, port))
    return sock


def test_a_client_that_reads_nothing_has_no_next_answer_made_until_it_takes_the_last() -> None:
    """Pipelined requests from a client that reads nothing: each answer waits for the one before it to be taken, so
    the upstream work and the memory a client holds stay one answer's; all are answered once it reads."""
    answer = b"x" * (8 << 20)

    async def scenario() -> tuple[int, int, list[int]]:
        made: list[str] = []

        async def big(request: Request, reply: Reply) -> None:
            made.append(request.path)
            reply.whole(200, JSON, answer)

        async with server(big) as port:
            sock = _silent_client(port)
            sock.sendall(b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(6)))
            await asyncio.sleep(1.0)
            made_before_reading = len(made)
            reader, writer = await asyncio.open_connection(sock=sock)
            sizes = [len((await asyncio.wait_for(read_response(reader), 20))[2]) for _ in range(6)]
            writer.close()
        return made_before_reading, len(made), sizes

    made_before_reading, made_in_all, sizes = asyncio.run(scenario())
    assert made_before_reading <= 2
    assert made_in_all == 6 and sizes == [len(answer)] * 6


def test_a_client_that_does_not_take_its_answer_is_cut_off_after_the_idle_timeout_and_frees_its_place() -> None:
    """Whether its answer is still over the transport's high mark (the next request waits for it) or under it when
    the connection goes idle (closing waits for it to be sent), a client that takes nothing of it for
    `idle_timeout_s` is cut off and no longer counts against `max_connections`."""
    async def sized(request: Request, reply: Reply) -> None:
        assert reply.connection.transport is not None  # the kernel takes little of it: the transport holds the rest
        reply.connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        reply.whole(200, JSON, b"x" * (1 << 20))

    async def scenario(read_to_under_the_high_mark: bool) -> tuple[bool, float, bytes]:
        listener, port = await listen(sized, replace(LIMITS, max_connections=1, idle_timeout_s=0.5))
        try:
            silent = _silent_client(port)
            silent.setblocking(False)
            silent.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            quiet = time.perf_counter()
            await asyncio.sleep(0.3)
            (connection,) = listener.connections
            while read_to_under_the_high_mark and connection.writes_paused and not connection.closed:
                with contextlib.suppress(BlockingIOError):
                    silent.recv(65536)  # the client reads, slowly: it is not cut off while it takes some
                await asyncio.sleep(0.001)
                quiet = time.perf_counter()
            unsent = connection.transport.get_write_buffer_size() > 0 if connection.transport else False
            for _ in range(100):  # 5 s at most
                if not listener.connections:
                    break
                await asyncio.sleep(0.05)
            cut_after_s = time.perf_counter() - quiet
            other = await asyncio.to_thread(socket.create_connection, (LOOPBACK, port), 10)
            other.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = (await asyncio.to_thread(_read_to_end, other)).split(b"\r\n", 1)[0]
            silent.close()
        finally:
            await listener.stop(drain_s=1.0)
        return unsent, cut_after_s, answer

    for read_to_under_the_high_mark in (False, True):
        unsent, cut_after_s, answer = asyncio.run(scenario(read_to_under_the_high_mark))
        assert unsent  # the answer was not taken whole
        assert 0.4 < cut_after_s < 3.0 and answer == b"HTTP/1.1 200 OK"


def test_a_handler_bug_is_a_500_json_error() -> None:
    async def broken(request: Request, reply: Reply) -> None:
        raise RuntimeError("bug")

    answered: list[int] = []

    async def scenario() -> tuple[int, bytes]:
        async with server(broken, answered=answered.append) as port:
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, body = await read_response(reader)
            writer.close()
        return status, body

    status, body = asyncio.run(scenario())
    assert status == 500 and json.loads(body)["error"]["code"] == 500 and answered == [500]


def test_an_idle_kept_alive_connection_is_closed_a_full_idle_period_after_its_last_answer() -> None:
    async def slow_echo(request: Request, reply: Reply) -> None:
        await asyncio.sleep(0.3)  # answering is not idling: the quiet time starts when the answer is out
        await echo(request, reply)

    async def scenario() -> tuple[bytes, float]:
        async with server(slow_echo, idle_timeout_s=0.4) as port:
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(post("/x", b"1"))
            await read_response(reader)
            answered = time.perf_counter()
            rest = await asyncio.wait_for(reader.read(), 5)
            open_for_s = time.perf_counter() - answered
            writer.close()
        return rest, open_for_s

    rest, open_for_s = asyncio.run(scenario())
    assert rest == b"" and 0.25 < open_for_s < 3.0


async def slow_stream(request: Request, reply: Reply) -> None:
    reply.start(200, [(b"content-type", b"text/event-stream")])
    for n in range(3):
        reply.write(b"data: %d\n\n" % n)
        await asyncio.sleep(0.05)
    reply.end()


def test_what_follows_an_answer_under_way_waits_for_it() -> None:
    """A pipelined bad request is refused after the good one is answered; a pipelined `Expect: 100-continue` is
    answered after the stream under way, never inside it."""
    async def scenario() -> tuple[bytes, bytes]:
        async with server(slow_stream) as port:
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n" + b"BAD REQUEST\r\n\r\n")
            refused = await reader.read(-1)
            writer.close()
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n"
                         + b"POST /s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
            await read_response(reader)
            interim = await reader.readuntil(b"\r\n\r\n")
            writer.write(b"ok")
            second = await read_response(reader)
            writer.close()
        return refused, interim + second[2]

    refused, continued = asyncio.run(scenario())
    first, _, error = refused.partition(b"0\r\n\r\n")
    assert first.endswith(b"data: 2\n\n\r\n") and error.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert continued == b"HTTP/1.1 100 Continue\r\n\r\ndata: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_upgrades_are_served_as_plain_http_and_connect_is_refused() -> None:
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"

    async def scenario() -> tuple[list[bytes], bytes]:
        answers = []
        async with server(echo) as port:
            for raw in (b"GET /u HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",
                        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com\r\n\r\n",
                        b"POST /u HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: websocket\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(smuggled), smuggled)):
                reader, writer = await asyncio.open_connection(LOOPBACK, port)
                writer.write(raw)
                status, _, body = await read_response(reader)
                answers.append(body)
                rest = await reader.read(-1) if status >= 400 else b""
                writer.close()
        return answers, rest

    (upgraded, connect, with_body), after_body = asyncio.run(scenario())
    assert json.loads(upgraded)["path"] == "/u"
    assert json.loads(connect)["error"]["code"] == 405
    assert json.loads(with_body)["error"]["code"] == 400 and after_body == b""  # the body was not taken for a request


def test_a_long_pipelined_body_and_a_continue_sent_anyway_are_ordinary_requests() -> None:
    async def scenario() -> list[tuple[int, bytes]]:
        async with server(echo, max_body_bytes=200_000) as port:
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(post("/a", b"x" * 100_000) + b"GET /b HTTP/1.1\r\nHo")
            first = await read_response(reader)
            writer.write(b"st: x\r\n\r\n" + post("/c", b"body", b"Expect: 100-continue\r\n"))
            answers = [first, await read_response(reader), await read_response(reader)]
            writer.write(post("/d", b""))
            answers.append(await read_response(reader))  # no stray 100 Continue in front of it
            writer.close()
        return [(status, body) for status, _, body in answers]

    answers = asyncio.run(scenario())
    assert [status for status, _ in answers] == [200, 200, 200, 200]
    assert [json.loads(body)["path"] for _, body in answers] == ["/a", "/b", "/c", "/d"]


def test_an_answer_the_stop_cuts_past_its_drain_is_no_client_that_left() -> None:
    """The stop's cut cancels the request as a client's leaving does; the handler must tell them apart (the gateway
    records one as the arm's answer cut by its stop, the other as the client's doing)."""
    async def scenario() -> list[str]:
        events: list[str] = []
        started = asyncio.Event()
        listener, port = await listen(_endless(events, started))
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(started.wait(), 5)
        await listener.stop(drain_s=0.2)
        assert not (await reader.read(-1)).endswith(b"0\r\n\r\n")  # cut: its body never ended
        writer.close()
        return events

    assert asyncio.run(scenario()) == ["gone", "cancelled, disconnected=False"]


def test_stop_lets_the_answer_under_way_finish_and_closes_after_it() -> None:
    async def scenario() -> tuple[bytes, bool]:
        listener, port = await listen(slow_stream)
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        writer.write(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")  # the answer is under way
        stopping = asyncio.ensure_future(listener.stop(drain_s=5))
        rest = await reader.read(-1)
        await stopping
        writer.close()
        return rest, not listener.connections

    rest, all_closed = asyncio.run(scenario())
    assert rest.endswith(b"data: 2\n\n\r\n0\r\n\r\n") and all_closed


def test_stop_sends_whole_answers_including_a_pipelined_one() -> None:
    """The answer under way started before the stop (so it could not say `connection: close`): the request
    pipelined behind it is answered too, with `connection: close`, and every byte of both is delivered."""
    piece = b"z" * 1_000_000

    async def answer(request: Request, reply: Reply) -> None:
        if request.path == "/big":
            reply.start(200, [])
            for _ in range(8):
                reply.write(piece)
                await asyncio.sleep(0.01)
            reply.end()
        else:
            reply.whole(200, [], b"small")

    async def scenario() -> tuple[bytes, tuple[int, dict[bytes, bytes], bytes]]:
        listener, port = await listen(answer)
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\nGET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        stopping = asyncio.ensure_future(listener.stop(drain_s=10))
        body = b""
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readexactly(2)
        second = await read_response(reader)
        await stopping
        writer.close()
        return head + body, second

    first, second = asyncio.run(scenario())
    assert first.endswith(piece * 8) and second[2] == b"small" and second[1][b"connection"] == b"close"


async def dribble(writer: asyncio.StreamWriter, piece: bytes, gap_s: float) -> None:
    """Send `piece` a byte at a time, forever: only the server closing the connection stops it."""
    with contextlib.suppress(ConnectionError):
        while True:
            for byte in piece:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(gap_s)


async def cut_off(port: int, start: bytes, piece: bytes) -> tuple[bytes, float]:
    """Everything the server answers to `start` followed by `piece` trickling in, and when its connection ended."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    began = time.perf_counter()
    writer.write(start)
    trickle = asyncio.ensure_future(dribble(writer, piece, 0.05))
    try:
        answer = await asyncio.wait_for(reader.read(-1), 10)
    except ConnectionResetError:  # the answer came, then the reset for the bytes still trickling in
        answer = b"reset"
    elapsed = time.perf_counter() - began
    trickle.cancel()
    writer.close()
    return answer, elapsed


def test_a_head_or_a_body_trickling_in_is_cut_at_its_deadline_and_counted() -> None:
    """Bytes arriving do not extend a deadline: a head must be whole within head_timeout_s of its first byte, a body
    within body_timeout_s of the head's end; a connection that sends nothing is closed without an answer."""
    async def scenario() -> tuple[list[tuple[bytes, float]], bytes, list[str]]:
        refused: list[str] = []
        async with server(echo, refused.append, head_timeout_s=0.5, body_timeout_s=0.5) as port:
            head = await cut_off(port, b"GET /x HTTP/1.1\r\nHost: x\r\n", b"X-Slow: 1\r\n")
            body = await cut_off(port, b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n", b"y")
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            silent = await asyncio.wait_for(reader.read(-1), 10)
            writer.close()
        return [head, body], silent, refused

    (head, body), silent, refused = asyncio.run(scenario())
    for answer, elapsed in (head, body):
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and b"connection: close" in answer, answer
        assert 0.4 < elapsed < 3.0
    assert b"request head not received within 0.5 s" in head[0]
    assert b"request body not received within 0.5 s" in body[0]
    assert silent == b""
    assert refused == ["head_timeout", "body_timeout", "head_timeout"]


def test_each_wait_of_a_kept_alive_connection_has_its_own_deadline() -> None:
    """Idle time between requests is not held against the next head, and a head pipelined behind a long answer has
    its deadline from that answer's end."""
    async def slow_echo(request: Request, reply: Reply) -> None:
        await asyncio.sleep(1.2)
        await echo(request, reply)

    async def scenario() -> list[int]:
        statuses = []
        async with server(slow_echo, head_timeout_s=0.5, idle_timeout_s=30) as port:
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            second = post("/second", b"2")
            writer.write(post("/first", b"1") + second[:10])  # a head begun behind an answer 1.2 s long
            statuses.append((await read_response(reader))[0])
            await asyncio.sleep(0.1)  # well within the head's deadline, however late this loop wakes
            writer.write(second[10:])
            statuses.append((await read_response(reader))[0])
            await asyncio.sleep(0.8)  # idle: longer than a head may take, shorter than the idle timeout
            writer.write(post("/third", b"3"))
            statuses.append((await read_response(reader))[0])
            writer.close()
        return statuses

    assert asyncio.run(scenario()) == [200, 200, 200]


GET_AND_CLOSE = b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def _read_to_end(sock: socket.socket, send_after_first_read: bytes = b"") -> bytes:
    received = sock.recv(65536)
    sock.sendall(send_after_first_read)
    while chunk := sock.recv(65536):
        received += chunk
    sock.close()
    return received


def test_connections_past_the_cap_are_answered_503_and_closed() -> None:
    """Counted as they are accepted: of a burst that arrives at once, as many as the cap are served and the rest
    answered 503 and closed, cleanly whether their request came before that answer or after it."""
    async def scenario() -> tuple[list[bytes], list[bytes], list[str]]:
        refused: list[str] = []
        async with server(echo, refused.append, max_connections=5) as port:
            # connected while the event loop is busy here: the server accepts all of them in one go
            asking = [socket.create_connection((LOOPBACK, port)) for _ in range(7)]
            for sock in asking:
                sock.sendall(GET_AND_CLOSE)
            waiting = [socket.create_connection((LOOPBACK, port)) for _ in range(3)]
            answers = await asyncio.gather(*(asyncio.to_thread(_read_to_end, sock) for sock in asking),
                                           *(asyncio.to_thread(_read_to_end, sock, GET_AND_CLOSE) for sock in waiting))
            later = []
            for _ in range(5):
                sock = socket.create_connection((LOOPBACK, port))
                sock.sendall(GET_AND_CLOSE)
                later.append(await asyncio.to_thread(_read_to_end, sock))
        return answers, later, refused

    answers, later, refused = asyncio.run(scenario())
    assert [answer.split(b" ", 2)[1] for answer in answers] == [b"200"] * 5 + [b"503"] * 5
    for answer in answers[5:]:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"connection: close" in head and b"content-length: %d" % len(body) in head
        assert json.loads(body)["error"]["code"] == 503
    assert all(answer.startswith(b"HTTP/1.1 200 OK") for answer in later)  # the cap counts connections open now
    assert refused == ["over_capacity"] * 5


def test_a_chunk_size_line_or_trailer_section_past_the_head_limit_is_refused() -> None:
    """llhttp reads past chunk extensions and trailers without a bound: the server holds them to 64 KiB."""
    async def send_until_answered(port: int, start: bytes, endless: bytes) -> tuple[bytes, int]:
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        writer.write(start)
        sent = 0
        answer = asyncio.ensure_future(reader.read(-1))
        with contextlib.suppress(ConnectionError):
            while sent < 50_000_000 and not answer.done():
                writer.write(endless)
                await writer.drain()
                sent += len(endless)
        try:
            received = await asyncio.wait_for(answer, 10)
        except ConnectionResetError:
            received = b"reset"
        writer.close()
        return received, sent

    async def scenario() -> list[tuple[bytes, int]]:
        async with server(echo, max_body_bytes=100_000_000) as port:
            chunked = b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            return [await send_until_answered(port, chunked + b"5;ext=", b"a" * 65536),
                    await send_until_answered(port, chunked + b"5\r\nhello\r\n0\r\nX-Trailer: ", b"b" * 65536)]

    for answer, sent in asyncio.run(scenario()):
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer[:200]
        assert b"chunk-size line or trailer section over 65536 bytes" in answer
        # Refused long before the 50 MB: what was sent includes what loopback's socket buffers held unread (several
        # MB once autotuned), more of it when the server's loop is slow to run on a busy machine.
        assert sent < 20_000_000


def test_an_absolute_form_target_without_a_path_is_the_root() -> None:
    """RFC 9112 §3.2.2: `http://host` asks for `/` (httptools gives it no path at all)."""
    async def scenario() -> list[tuple[int, str]]:
        async with server(echo) as port:
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            answers = []
            for target in (b"http://x", b"http://x?q=1", b"http://x/v1"):
                writer.write(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % target)
                status, _, body = await read_response(reader)
                answers.append((status, json.loads(body)["path"]))
            writer.close()
        return answers

    assert asyncio.run(scenario()) == [(200, "/"), (200, "/"), (200, "/v1")]


def test_parser_edges_are_answered_as_rfc_9112_says() -> None:
    """Two Host headers: 400. A version other than 1.0 and 1.1: 505. HTTP/1.0 with Transfer-Encoding: answered,
    then closed (§6.1), so nothing pipelined behind it is read. Trailer fields of a chunked body are not headers."""
    async def scenario() -> tuple[bytes, list[bytes], bytes, tuple[int, dict[bytes, bytes], bytes]]:
        async with server(echo) as port:
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
            two_hosts = await reader.read(-1)
            writer.close()
            versions = []
            for version in (b"2.0", b"0.9"):  # llhttp itself refuses every version but these and 1.x
                reader, writer = await asyncio.open_connection(LOOPBACK, port)
                writer.write(b"GET /x HTTP/" + version + b"\r\nHost: a\r\n\r\n")
                versions.append(await asyncio.wait_for(reader.read(-1), 5))
                writer.close()
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(b"POST /x HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n0\r\n\r\n" + post("/smuggled", b""))
            http10_chunked = await asyncio.wait_for(reader.read(-1), 5)
            writer.close()
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n0\r\nX-Trailer: evil\r\nHost: elsewhere\r\n\r\n")
            trailers = await read_response(reader)
            writer.close()
        return two_hosts, versions, http10_chunked, trailers

    two_hosts, versions, http10_chunked, (status, _, body) = asyncio.run(scenario())
    assert two_hosts.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"more than one Host header" in two_hosts
    for version, answer in zip(("2.0", "0.9"), versions, strict=True):
        assert answer.startswith(b"HTTP/1.1 505 HTTP Version Not Supported\r\n"), answer
        assert f"HTTP/{version} is not supported".encode() in answer
    head, _, rest = http10_chunked.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"connection: close" in head
    assert json.loads(rest)["body"] == "hello" and b"smuggled" not in rest
    echoed = json.loads(body)
    assert status == 200 and echoed["body"] == "hello"
    assert echoed["headers"] == {"host": "x", "transfer-encoding": "chunked"}


def _accept_queue(port: int) -> int:
    """Connections the kernel completed on the listening socket at `port` that nobody accepted yet (the rx_queue
    column of a LISTEN row in /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":
            return int(fields[4].split(":")[1], 16)
    raise LookupError(f"no listening socket on port {port}")


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_the_listen_backlog_is_the_one_asked_for(loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    """Starting to serve on a bound socket listens again: with the loop's default the kernel would queue 101."""
    wanted = min(300, int(Path("/proc/sys/net/core/somaxconn").read_text()) + 1)

    async def scenario() -> int:
        sock = bind(LOOPBACK, 0)
        listener = Server(echo, LIMITS)
        await listener.start(sock)
        queued = _connect_without_accepting(sock.getsockname()[1], 300, wanted)
        await listener.stop(drain_s=1.0)
        return queued

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        assert runner.run(scenario()) == wanted


def _connect_without_accepting(port: int, count: int, wanted: int) -> int:
    """Open `count` connections while the caller's event loop cannot run (it is here): how many the kernel queues,
    once `wanted` are or after 5 s."""
    clients = []
    for _ in range(count):
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex((LOOPBACK, port))
        clients.append(client)
    deadline = time.monotonic() + 5
    while (queued := _accept_queue(port)) < wanted and time.monotonic() < deadline:
        time.sleep(0.05)
    for client in clients:
        client.close()
    return queued


async def _cut_off_at_once(port: int, count: int) -> set[bytes]:
    """`count` connections that each send part of a request head and nothing more: the status lines answered."""
    async def one() -> bytes:
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        answer = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
        await writer.wait_closed()
        return answer.partition(b"\r\n")[0]

    return set(await asyncio.gather(*(one() for _ in range(count))))


def _live() -> tuple[collections.Counter[str], int]:
    """Live gc-tracked objects by type, and blocks held by Python's allocator (tracked or not), after a collection."""
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects()), sys.getallocatedblocks()


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_connections_cut_at_the_head_deadline_leave_nothing_behind(
        loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    """What a slow flood costs is given back: a third flood of connections answered 408 at the head deadline leaves
    no more live objects or allocator blocks than the second did, so nothing is kept per connection (its protocol,
    parser, timer, lingering state, transport or the exceptions of its refusal). The first floods size what is kept
    for reuse (sets, free lists, the loop's caches), which in a long test session is not the same from run to run: a
    leak shows as one object or more per connection (`count`), caches as fewer."""
    count = 300

    async def scenario() -> tuple[set[bytes], collections.Counter[str], int]:
        refused: list[str] = []
        limits = replace(LIMITS, head_timeout_s=0.3, max_connections=4 * count)  # no cap hides what is kept
        listener, port = await listen(echo, limits, refused.append)

        async def flood() -> tuple[set[bytes], collections.Counter[str], int]:
            answers = await _cut_off_at_once(port, count)
            for _ in range(100):  # all gone within 5 s, or what is left is counted below
                if not (listener.connections or listener.lingering):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)  # transports closed a loop turn after their protocols are done
            return answers, *_live()

        answered, _, _ = await flood()
        answered_second, types, blocks = await flood()
        answered_later, later_types, later_blocks = await flood()
        await listener.stop(drain_s=1.0)
        assert refused == ["head_timeout"] * 3 * count
        answered |= answered_second
        return answered | answered_later, later_types - types, later_blocks - blocks

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        answered, grown, blocks = runner.run(scenario())
    assert answered == {b"HTTP/1.1 408 Request Timeout"}
    assert {name: more for name, more in grown.items() if more >= count * 2 // 3} == {}
    assert blocks < count
