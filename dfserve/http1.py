"""A minimal HTTP/1.1 client on an asyncio protocol: the hot path of the load tester and of the gateway's upstream.

Why not aiohttp: with 128 streams a verify round makes every stream's chunk arrive at once, and a client that wakes
a task and parses JSON per chunk time-stamps the last of them several milliseconds late (measured in
bench/RESULTS.md); a proxy pays the same per-chunk cost as added latency. This protocol stamps `perf_counter()` as
`data_received` is called, before any other work, and only de-chunks the body there. A chunked body is read by
`dfserve._relay.Dechunker` (C), which becomes the transport's protocol from the end of the head to the end of the
body, so a read costs no Python frame; it hands each read's piece to the response's sink: the `Response`, which
keeps it, until a relay is attached (`Call.attach`); from then on pieces go straight from the de-chunker to the
relay.

What it speaks: one request at a time per connection, keep-alive reuse, `Content-Length` or chunked bodies
(trailers read and dropped), TCP_NODELAY (asyncio sets it on TCP connections), optional connect and read
timeouts. Failures raise the exceptions below so the caller can classify them.

    pool = Pool("http://127.0.0.1:30000", time.perf_counter)
    response = Response()
    await pool.post("/generate", body, response, on_sent=print)   # response.pieces: [(arrival time, bytes), ...]
    call = await pool.open(b"POST", "/generate", body, b"Content-Type: application/json\r\n", response)
    await call.finish()                                           # after the head: status, headers, body so far
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, cast
from urllib.parse import urlsplit

from dfserve._relay import BadChunk, Dechunker
from dfserve.errors import UserError


class ConnectFailed(Exception):
    """No connection could be opened."""


class Disconnected(Exception):
    """The server closed the connection before the response was complete."""


class BadResponse(Exception):
    """The bytes were not an HTTP/1.1 response this client understands."""


class ReadTimeout(Exception):
    """Nothing arrived for the pool's `read_timeout_s` while a response was due."""


class ReaderStalled(Exception):
    """The response's reader kept reading paused (`Call.pause_reading`) for `read_timeout_s`: its fault, not the
    server's."""


class Sink(Protocol):
    """Where a response's body goes, piece by piece (one piece per read, with the clock reading of its arrival)."""

    def received(self, now: float, data: bytes) -> None: ...

    def ended(self) -> None: ...


@dataclass
class Response:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    """Header names lower-cased, values as sent."""
    pieces: list[tuple[float, bytes]] = field(default_factory=list)
    """Body bytes, de-chunked, with the clock reading taken when they arrived (one entry per read)."""

    def received(self, now: float, data: bytes) -> None:
        """One de-chunked piece of body, as it arrives."""
        self.pieces.append((now, data))

    def ended(self) -> None:
        """The response is complete, failed or abandoned (the connection's `done` future says which)."""

    def body(self) -> bytes:
        return b"".join(piece for _, piece in self.pieces)

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower case)."""
        return next((value for key, value in self.headers if key == name), None)


_MAX_HEAD = 64 * 1024


class _Connection(asyncio.Protocol):
    def __init__(self, clock: Callable[[], float], read_timeout_s: float | None = None) -> None:
        self.clock = clock
        self.read_timeout_s = read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reading_paused = False
        """Paused by the reader's back-pressure: quiet time is then the reader's, not the server's."""
        self._timer: asyncio.TimerHandle | None = None
        """The read timeout's one timer, kept across the requests of a kept-alive connection."""
        self._reset(Response())

    def _reset(self, response: Response) -> None:
        self.response = response
        self.sink: Sink = response
        self.done: asyncio.Future[Response] | None = None
        self.head: asyncio.Future[None] | None = None
        """Resolved once the response head is parsed, or the response ended without one (then see `done`)."""
        self._last = 0.0
        self._buffer = bytearray()
        self._head_done = False
        self._dechunker: Dechunker | None = None
        self._remaining: int | None = None  # bytes left in a Content-Length body
        self._keep_alive = True
        self._finished = False
        self._over = False

    # asyncio callbacks ------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        self.loop = asyncio.get_running_loop()  # kept: on Python 3.11 each lookup is a getpid() system call

    def data_received(self, data: bytes) -> None:
        now = self._last = self.clock()
        if self.done is None or self.done.done():
            if data:
                self._keep_alive = False  # bytes no request asked for: the server's framing is out of step
            return
        try:
            self._feed(now, data)
        except BadChunk as exc:
            self._fail(BadResponse(str(exc)))
        except BadResponse as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        if self._dechunker is not None:
            self._dechunker.owner = None
        if self.done is not None and not self.done.done():
            if self._head_done and self._dechunker is None and self._remaining is None:
                self._finish()  # a body delimited by the connection's end
            else:
                self._fail(Disconnected(f"connection closed mid-response ({exc or 'EOF'})"))

    # request/response -------------------------------------------------------------------------------------------

    def start(self, request: bytes, response: Response) -> tuple[float, asyncio.Future[Response]]:
        """Write one request; returns the clock reading just before the write and the response future."""
        assert self.transport is not None
        self._reset(response)
        self.done = self.loop.create_future()
        self.head = self.loop.create_future()
        sent = self._last = self.clock()
        if self.read_timeout_s is not None and self._timer is None:
            self._timer = self.loop.call_later(self.read_timeout_s, self._check_idle)
        self.transport.write(request)
        return sent, self.done

    def set_reading(self, paused: bool) -> None:
        """Pause or resume reading; either way the read timeout counts afresh, and while paused, running out means
        the reader stalled (`ReaderStalled`), not the server."""
        if self.transport is not None and not self.transport.is_closing():
            if paused:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()
            self.reading_paused = paused
            self._last = self.clock()

    def _check_idle(self) -> None:
        """One timer per connection, not one per piece or per request: while a response is due it re-arms itself
        for the time left since the last read; then it stops until the next request."""
        assert self.read_timeout_s is not None
        if self.done is None or self.done.done():
            self._timer = None
            return
        last = self._last if self._dechunker is None else max(self._last, self._dechunker.last_read)
        idle = self.clock() - last
        if idle >= self.read_timeout_s:
            self._fail(ReaderStalled(f"the reader took nothing for {idle:.1f} s") if self.reading_paused
                       else ReadTimeout(f"nothing received for {idle:.1f} s"))
        else:
            self._timer = self.loop.call_later(self.read_timeout_s - idle, self._check_idle)

    def attach(self, sink: Sink) -> None:
        """Send the body to `sink` from now on: first the pieces kept so far, then each read's piece as it comes
        (straight from the de-chunker), then the end."""
        for now, data in self.response.pieces:
            sink.received(now, data)
        self.response.pieces = []
        if self._over:
            sink.ended()
            return
        self.sink = sink
        if self._dechunker is not None:
            self._dechunker.sink = sink

    @property
    def reusable(self) -> bool:
        return self._finished and self._keep_alive and not self.closed and self.transport is not None \
            and not self.transport.is_closing()

    def abort(self) -> None:
        """Close the connection; a response still due is cancelled (the server sees the request abandoned)."""
        if self.done is not None and not self.done.done():
            self.done.cancel()
        self._ended()
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()
        self.closed = True

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _ended(self) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_result(None)
        self._over = True
        self.sink.ended()
        self.sink = self.response  # a kept-alive connection holds on to no relay (nor to its client)
        if self._dechunker is not None:
            self._dechunker.sink = self.response

    def _fail(self, exc: Exception) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc)
        self.abort()

    def _finish(self) -> None:
        self._finished = True
        if self.done is not None and not self.done.done():
            self.done.set_result(self.response)
        self._ended()

    def _feed(self, now: float, data: bytes) -> None:
        if not self._head_done:
            buffer = self._buffer
            buffer += data
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _MAX_HEAD:
                    raise BadResponse("response head too large")
                return
            self._parse_head(bytes(buffer[:end]))
            data = bytes(buffer[end + 4 :])
            buffer.clear()
        if self._dechunker is None:
            self._plain(now, data)
        elif self._dechunker.feed(now, data):
            self._body_done()
        elif self._dechunker.owner is None and self.transport is not None:
            # The rest of the body is read by the de-chunker as the transport's protocol: no Python per read.
            self._dechunker.owner = self
            self.transport.set_protocol(self._dechunker)  # type: ignore[arg-type]

    def body_done(self) -> None:
        """From the de-chunker: the body is complete; the connection takes its transport back."""
        self._take_back()
        self._body_done()

    def _body_done(self) -> None:
        assert self._dechunker is not None
        if self._dechunker.overrun:
            self._keep_alive = False
        self._finish()

    def body_failed(self, exc: BadChunk) -> None:
        """From the de-chunker: the body's framing is broken."""
        self._take_back()
        self._fail(BadResponse(str(exc)))

    def _take_back(self) -> None:
        assert self._dechunker is not None and self.transport is not None
        self._dechunker.owner = None
        self.transport.set_protocol(self)

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise BadResponse(f"bad status line {lines[0][:80]!r}")
        self.response.status = int(parts[1])
        length, chunked = None, False
        headers = self.response.headers
        for line in lines[1:]:
            name, _, raw = line.partition(b":")
            name, raw = name.strip().lower(), raw.strip()
            headers.append((name, raw))
            value = raw.lower()
            if name == b"transfer-encoding":
                if value != b"chunked":  # another coding, or a list: the body could not be relayed as sent
                    raise BadResponse(f"unsupported transfer-encoding {value[:40]!r}")
                chunked = True
            elif name == b"content-length":
                if not value.isdigit():
                    raise BadResponse(f"bad content-length {value!r}")
                length = int(value)
            elif name == b"connection" and value == b"close":
                self._keep_alive = False
        if parts[0] == b"HTTP/1.0":
            self._keep_alive = False
        self._head_done = True
        if chunked:
            self._dechunker = Dechunker(self.sink, self.clock)
        elif length is not None:
            self._remaining = length
        else:
            self._keep_alive = False  # the body ends with the connection
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def _plain(self, now: float, data: bytes) -> None:
        if self._remaining is None:
            if data:
                self.sink.received(now, data)
            return
        take = min(self._remaining, len(data))
        if take:
            self.sink.received(now, data[:take])
            self._remaining -= take
        if len(data) > take:
            self._keep_alive = False  # bytes after the body: the server's framing is out of step
        if self._remaining == 0:
            self._finish()


_POST_HEADERS = b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"


@dataclass(eq=False)
class Call:
    """A request whose response head has arrived; the body keeps flowing into its `Response` until `finish`."""

    pool: Pool
    connection: _Connection
    done: asyncio.Future[Response]

    async def finish(self) -> None:
        """Wait for the end of the body; raises `Disconnected`, `BadResponse` or `ReadTimeout` on a failure."""
        await self.done

    def attach(self, sink: Sink) -> None:
        """Hand the body to `sink` (`_Connection.attach`): a relay's hot path, with no Python between reads."""
        self.connection.attach(sink)

    def pause_reading(self) -> None:
        """Stop reading the body (the server's sends then wait in its socket): back-pressure from a slow reader."""
        self.connection.set_reading(paused=True)

    def resume_reading(self) -> None:
        self.connection.set_reading(paused=False)

    def close(self) -> None:
        """Done with the call: a complete response frees its connection for reuse, anything else closes it."""
        if self.done.done() and not self.done.cancelled() and self.done.exception() is None:
            self.pool.recycle(self.connection)
        else:
            self.connection.abort()


class Pool:
    """Keep-alive connections to one server; a connection carries one request at a time."""

    def __init__(self, base_url: str, clock: Callable[[], float], headers: Mapping[str, str] | None = None,
                 connect_timeout_s: float | None = None, read_timeout_s: float | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"--arm: {base_url!r} is not an http(s) URL")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.encode()
        self.extra_headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self.clock = clock
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: list[_Connection] = []

    async def _connection(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable:
                return connection
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(self.clock, self.read_timeout_s), self.host, self.port, ssl=self.ssl,
                server_hostname=self.host if self.ssl else None), self.connect_timeout_s)
        except OSError as exc:
            raise ConnectFailed(f"{self.host}:{self.port}: {exc.strerror or exc}") from None
        except TimeoutError:
            raise ConnectFailed(f"{self.host}:{self.port}: no connection in {self.connect_timeout_s} s") from None
        return protocol

    def request_bytes(self, path: str, body: bytes, method: bytes = b"POST", headers: bytes = _POST_HEADERS) -> bytes:
        """One request; `headers` are header lines each ending in CRLF, to which Host, the pool's own headers and
        Content-Length are added."""
        return (method + b" " + (self.prefix + path).encode() + b" HTTP/1.1\r\nHost: " + self.host_header + b"\r\n"
                + self.extra_headers + headers + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def post(self, path: str, body: bytes, response: Response, on_sent: Callable[[float], None]) -> None:
        """Send one POST and fill `response` until it is complete; `on_sent` gets the clock reading of the write.

        Whatever arrived stays in `response` when this raises (disconnect, cancellation, timeout).
        """
        connection = await self._connection()
        sent, done = connection.start(self.request_bytes(path, body), response)
        on_sent(sent)
        await self._settle(connection, done)

    async def open(self, method: bytes, path: str, body: bytes, headers: bytes, response: Response) -> Call:
        """Send one request and return once its response head has arrived (`response.status`, `.headers`)."""
        connection = await self._connection()
        _, done = connection.start(self.request_bytes(path, body, method, headers), response)
        assert connection.head is not None
        try:
            await connection.head
        except BaseException:
            connection.abort()
            raise
        if done.done():
            done.result()  # the response ended before its head: raise why
        return Call(self, connection, done)

    async def _settle(self, connection: _Connection, done: asyncio.Future[Response]) -> None:
        """Wait for a response's end, then keep its connection for reuse or close it."""
        try:
            await done
        except BaseException:
            connection.abort()
            raise
        self.recycle(connection)

    def recycle(self, connection: _Connection) -> None:
        if connection.reusable:
            self._idle.append(connection)
        else:
            connection.abort()

    def close(self) -> None:
        for connection in self._idle:
            connection.abort()
        self._idle.clear()
