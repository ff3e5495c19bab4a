"""A minimal HTTP/1.1 client on an asyncio protocol: the load tester's hot path, built for timing.

Why not aiohttp here: with 128 streams a verify round makes every stream's chunk arrive at once, and a client
that wakes a task and parses JSON per chunk time-stamps the last of them several milliseconds late (measured in
bench/RESULTS.md). This protocol stamps `perf_counter()` as `data_received` is called, before any other work, and
only de-chunks the body there; SSE and JSON are parsed after the response ends, off the timing path.

What it speaks: one POST at a time per connection, keep-alive reuse, `Content-Length` or chunked bodies (no
trailers expected, tolerated), TCP_NODELAY (asyncio sets it on TCP connections). Failures raise the exceptions below
so the caller can classify them.

    pool = Pool("http://127.0.0.1:30000", time.perf_counter)
    response = Response()
    await pool.post("/generate", body, response, on_sent=print)   # response.pieces: [(arrival time, bytes), ...]
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

from dfserve.errors import UserError


class ConnectFailed(Exception):
    """No connection could be opened."""


class Disconnected(Exception):
    """The server closed the connection before the response was complete."""


class BadResponse(Exception):
    """The bytes were not an HTTP/1.1 response this client understands."""


@dataclass
class Response:
    status: int = 0
    pieces: list[tuple[float, bytes]] = field(default_factory=list)
    """Body bytes, de-chunked, with the clock reading taken when they arrived (one entry per read)."""

    def body(self) -> bytes:
        return b"".join(piece for _, piece in self.pieces)


_MAX_HEAD = 64 * 1024


class _Connection(asyncio.Protocol):
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.response = Response()
        self.done: asyncio.Future[Response] | None = None
        self._buffer = bytearray()
        self._head_done = False
        self._chunked = False
        self._remaining: int | None = None  # bytes left in the body (content-length) or in the current chunk
        self._keep_alive = True
        self._finished = False

    # asyncio callbacks ------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        now = self.clock()
        if self.done is None or self.done.done():
            return
        try:
            self._feed(now, data)
        except BadResponse as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            if self._head_done and not self._chunked and self._remaining is None:
                self._finish()  # a body delimited by the connection's end
            else:
                self._fail(Disconnected(f"connection closed mid-response ({exc or 'EOF'})"))

    # request/response -------------------------------------------------------------------------------------------

    def start(self, request: bytes, response: Response) -> tuple[float, asyncio.Future[Response]]:
        """Write one request; returns the clock reading just before the write and the response future."""
        assert self.transport is not None
        self._reset()
        self.response = response
        self.done = asyncio.get_running_loop().create_future()
        sent = self.clock()
        self.transport.write(request)
        return sent, self.done

    @property
    def reusable(self) -> bool:
        return self._finished and self._keep_alive and not self.closed and self.transport is not None \
            and not self.transport.is_closing()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self.closed = True

    def _fail(self, exc: Exception) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc)
        self.abort()

    def _finish(self) -> None:
        self._finished = True
        if self.done is not None and not self.done.done():
            self.done.set_result(self.response)

    def _feed(self, now: float, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if not self._head_done:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _MAX_HEAD:
                    raise BadResponse("response head too large")
                return
            self._parse_head(bytes(buffer[:end]))
            del buffer[: end + 4]
        if self._chunked:
            self._dechunk(now)
        else:
            self._plain(now)

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise BadResponse(f"bad status line {lines[0][:80]!r}")
        self.response.status = int(parts[1])
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding" and value == b"chunked":
                self._chunked = True
            elif name == b"content-length":
                if not value.isdigit():
                    raise BadResponse(f"bad content-length {value!r}")
                length = int(value)
            elif name == b"connection" and value == b"close":
                self._keep_alive = False
        if parts[0] == b"HTTP/1.0":
            self._keep_alive = False
        self._head_done = True
        if self._chunked:
            self._remaining = None
        elif length is not None:
            self._remaining = length
        else:
            self._keep_alive = False  # the body ends with the connection

    def _plain(self, now: float) -> None:
        buffer = self._buffer
        if self._remaining is None:
            if buffer:
                self.response.pieces.append((now, bytes(buffer)))
                buffer.clear()
            return
        take = min(self._remaining, len(buffer))
        if take:
            self.response.pieces.append((now, bytes(buffer[:take])))
            del buffer[:take]
            self._remaining -= take
        if self._remaining == 0:
            self._finish()

    def _dechunk(self, now: float) -> None:
        buffer = self._buffer
        got = bytearray()
        while True:
            if self._remaining is None:  # at a chunk-size line
                end = buffer.find(b"\r\n")
                if end < 0:
                    break
                size_text = bytes(buffer[:end]).split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise BadResponse(f"bad chunk size {size_text[:20]!r}") from None
                del buffer[: end + 2]
                if size == 0:
                    if buffer.find(b"\r\n") < 0:  # wait for the (empty) trailer section's end
                        buffer[:0] = b"0\r\n"
                        break
                    self._trailers_done(got, now)
                    return
                self._remaining = size + 2  # payload and its CRLF
            take = min(self._remaining, len(buffer))
            if not take:
                break
            payload = min(take, max(0, self._remaining - 2))  # the chunk's CRLF is not payload
            got += buffer[:payload]
            del buffer[:take]
            self._remaining -= take
            if self._remaining == 0:
                self._remaining = None
        if got:
            self.response.pieces.append((now, bytes(got)))

    def _trailers_done(self, got: bytearray, now: float) -> None:
        if got:
            self.response.pieces.append((now, bytes(got)))
        self._buffer.clear()
        self._finish()


class Pool:
    """Keep-alive connections to one server; a connection carries one request at a time."""

    def __init__(self, base_url: str, clock: Callable[[], float], headers: Mapping[str, str] | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"--arm: {base_url!r} is not an http(s) URL")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.encode()
        self.extra_headers = b"".join(f"\r\n{k}: {v}".encode("latin-1") for k, v in (headers or {}).items())
        self.clock = clock
        self._idle: list[_Connection] = []

    async def _connection(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable:
                return connection
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await loop.create_connection(
                lambda: _Connection(self.clock), self.host, self.port, ssl=self.ssl,
                server_hostname=self.host if self.ssl else None)
        except OSError as exc:
            raise ConnectFailed(f"{self.host}:{self.port}: {exc.strerror or exc}") from None
        return protocol

    def request_bytes(self, path: str, body: bytes) -> bytes:
        return (b"POST " + (self.prefix + path).encode() + b" HTTP/1.1\r\nHost: " + self.host_header
                + self.extra_headers + b"\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def post(self, path: str, body: bytes, response: Response, on_sent: Callable[[float], None]) -> None:
        """Send one POST and fill `response` until it is complete; `on_sent` gets the clock reading of the write.

        Whatever arrived stays in `response` when this raises (disconnect, cancellation, timeout).
        """
        connection = await self._connection()
        sent, done = connection.start(self.request_bytes(path, body), response)
        on_sent(sent)
        try:
            await done
        except BaseException:
            connection.abort()
            raise
        if connection.reusable:
            self._idle.append(connection)
        else:
            connection.abort()

    def close(self) -> None:
        for connection in self._idle:
            connection.abort()
        self._idle.clear()
