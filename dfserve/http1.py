"""A minimal HTTP/1.1 client on an asyncio protocol: the hot path of the load tester and of the gateway's upstream.

Why not aiohttp: with 128 streams a verify round makes every stream's chunk arrive at once, and a client that wakes
a task and parses JSON per chunk time-stamps the last of them several milliseconds late (measured in
bench/RESULTS.md); a proxy pays the same per-chunk cost as added latency. This protocol dates each read before any
other work (by `perf_counter()` as `data_received` is called, or, in a pool made with `kernel_stamps`, by when the
kernel received the bytes: `dfserve.stamped_socket`) and only de-chunks the body there. A chunked body is read by
`dfserve.relay_core.Dechunker` (C where the extension was built), which becomes the transport's protocol from the
end of the head to the end of the body, so the protocol adds no Python frame per read; it hands each read's piece to the
response's sink: the `Response`, which keeps it, until a relay is attached (`Call.attach`); from then on pieces go
straight from the de-chunker to the relay.

What it speaks: one request at a time per connection, keep-alive reuse, `Content-Length` or chunked bodies
(trailers read and dropped), TCP_NODELAY (asyncio sets it on TCP connections), optional connect and read
timeouts. Response heads are parsed by httptools (llhttp), which refuses a CR or LF inside a header value, so no
header can be smuggled to whoever the headers are passed on to; interim 1xx responses are skipped; 204, 304 and a
response to HEAD have no body, whatever their headers say; a head (with the interim ones before it) over 64 KiB is
refused however it arrives. Failures raise the exceptions below so the caller can classify them.

    pool = Pool("http://127.0.0.1:30000", time.perf_counter)
    response = Response()
    call = await pool.open(b"POST", "/generate", body, b"Content-Type: application/json\r\n", response)
    await call.finish()     # after the head: status, headers; then response.pieces: [(arrival time, bytes), ...]

`dfserve.transport` puts this client under httpx's API.
"""

from __future__ import annotations

import asyncio
import select
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

from dfserve import stamped_socket
from dfserve.errors import UserError
from dfserve.relay_core import BadChunk, Dechunker, EventTooLarge
from dfserve.stamped_socket import ReadLag, StampedSocket, connect


class ConnectFailed(Exception):
    """No connection could be opened."""


class ConnectTimedOut(ConnectFailed):
    """No connection within the pool's `connect_timeout_s`."""


class Disconnected(Exception):
    """The server closed the connection before the response was complete."""


class BadResponse(Exception):
    """The bytes were not an HTTP/1.1 response this client understands."""


class ReadTimeout(Exception):
    """Nothing arrived for the pool's `read_timeout_s` while a response was due."""


class ReaderStalled(Exception):
    """The response's reader kept reading paused (`Call.pause_reading`) for `read_timeout_s`: its fault, not the
    server's."""


class BodyTooLarge(EventTooLarge):
    """A whole body longer than its `Response.max_body_bytes`: refused by its sink, as a relay refuses an event too
    long, so that the de-chunker fails the response the same way."""


class Sink(Protocol):
    """Where a response's body goes, piece by piece (one piece per read, with the clock reading of its arrival)."""

    def received(self, now: float, data: bytes) -> None: ...

    def ended(self) -> None: ...


@dataclass
class Response:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    """Header names lower-cased, values as sent but for the whitespace around them."""
    pieces: list[tuple[float, bytes]] = field(default_factory=list)
    """Body bytes, de-chunked, with the clock reading taken when they arrived (one entry per read)."""
    sent: float | None = None
    """The clock reading just before the request was written."""
    completed: float | None = None
    """When the read that completed the response arrived (its last byte's date, as its pieces are dated); None
    until it is complete. A response's end is when its last byte came, not when the loop got to it."""
    max_body_bytes: int | None = None
    """The most body it holds: one more byte fails the response (`BodyTooLarge`). None: no bound."""
    body_bytes: int = 0

    def received(self, now: float, data: bytes) -> None:
        """One de-chunked piece of body, as it arrives."""
        self.pieces.append((now, data))
        self.body_bytes += len(data)
        if self.max_body_bytes is not None and self.body_bytes > self.max_body_bytes:
            self.pieces.clear()
            raise BodyTooLarge(f"a body longer than {self.max_body_bytes} bytes")

    def ended(self) -> None:
        """The response is complete, failed or abandoned (the connection's `done` future says which)."""

    def body(self) -> bytes:
        return b"".join(piece for _, piece in self.pieces)

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower case)."""
        return next((value for key, value in self.headers if key == name), None)

    def media_type(self) -> bytes:
        """The Content-Type's media type, lower-cased, without its parameters (b"" when none was sent)."""
        return (self.header(b"content-type") or b"").partition(b";")[0].strip().lower()


_MAX_HEAD = 64 * 1024
_NO_BODY = frozenset({204, 304})


class _Head:
    """httptools' callbacks for one response head: its header fields, names lower-cased, values without the
    whitespace around them (llhttp keeps what trails)."""

    __slots__ = ("headers",)

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value.rstrip(b" \t")))


class _Connection(asyncio.Protocol):
    def __init__(self, clock: Callable[[], float], read_timeout_s: float | None = None) -> None:
        self.clock = clock
        self.arrival = clock
        """When the read being delivered arrived: the kernel's date over a `StampedSocket`, else `clock()` now."""
        self._stamped: StampedSocket | None = None
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
        self._last = self._sent = self._read_at = 0.0
        self._buffer = bytearray()
        self._head_bytes = 0  # of the heads read so far, interim ones included
        self._head_done = False
        self._no_body = False  # a response to HEAD
        self._dechunker: Dechunker | None = None
        self._remaining: int | None = None  # bytes left in a Content-Length body
        self._keep_alive = True
        self._finished = False
        self._over = False

    # asyncio callbacks ------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        self.loop = asyncio.get_running_loop()  # kept: on Python 3.11 each lookup is a getpid() system call
        if isinstance(transport, StampedSocket):
            self._stamped = transport
            self.arrival = transport.arrival

    def data_received(self, data: bytes) -> None:
        now = self._last = self._read_at = self.arrival()
        if self.done is None or self.done.done():
            if data:
                self._keep_alive = False  # bytes no request asked for: the server's framing is out of step
            return
        try:
            self._feed(now, data)
        except (BadChunk, BadResponse, EventTooLarge) as exc:
            self._fail(_failure(exc))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        if self._dechunker is not None:
            self._dechunker.owner = None
        if self.done is not None and not self.done.done():
            if self._head_done and self._dechunker is None and self._remaining is None:
                self._finish(self._read_at)  # a body delimited by the connection's end
            else:
                self._fail(Disconnected(f"connection closed mid-response ({exc or 'EOF'})"))

    # request/response -------------------------------------------------------------------------------------------

    def start(self, request: bytes, response: Response, no_body: bool = False) -> tuple[float, asyncio.Future[Response]]:
        """Write one request; returns the clock reading just before the write and the response future. `no_body`:
        the response has none whatever its head says (a request with method HEAD)."""
        assert self.transport is not None
        self._reset(response)
        self._no_body = no_body
        self.done = self.loop.create_future()
        self.head = self.loop.create_future()
        sent = response.sent = self._last = self._sent = self.clock()
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
        for the time left since the last read (since the request, for its head: bytes of a head trickling in do not
        extend its deadline); then it stops until the next request."""
        assert self.read_timeout_s is not None
        if self.done is None or self.done.done():
            self._timer = None
            return
        now = self.clock()
        last = self._last if self._dechunker is None else max(self._last, self._dechunker.last_read)
        idle = now - (last if self._head_done else self._sent)
        if idle < self.read_timeout_s:
            self._timer = self.loop.call_later(self.read_timeout_s - idle, self._check_idle)
        elif not self._head_done:
            self._fail(ReadTimeout(f"no response head within {idle:.1f} s"))
        else:
            self._fail(ReaderStalled(f"the reader took nothing for {idle:.1f} s") if self.reading_paused
                       else ReadTimeout(f"nothing received for {idle:.1f} s"))

    def attach(self, sink: Sink) -> None:
        """Send the body to `sink` from now on: first the pieces kept so far, then each read's piece as it comes
        (straight from the de-chunker), then the end. A sink that refuses a piece (`EventTooLarge`) fails the
        response."""
        pieces, self.response.pieces = self.response.pieces, []
        try:
            for now, data in pieces:
                sink.received(now, data)
        except EventTooLarge as exc:
            self._fail(exc)
            return
        if self._over:
            sink.ended()
            return
        self.sink = sink
        if self._dechunker is not None:
            self._dechunker.sink = sink

    def last_arrival(self) -> float:
        """The date of the latest read, its own or its de-chunker's (`Call.last_arrival`)."""
        dechunker = self._dechunker
        return max(self._read_at, dechunker.last_read) if dechunker is not None else self._read_at

    def ended_by_server(self) -> bool:
        """An idle connection with something to read: the server's end of it (or bytes no request asked for), in
        the kernel though the loop has not read it yet. One `poll` of the socket."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
        return bool(poller.poll(0))

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

    def _finish(self, arrival: float) -> None:
        """The response is complete: `arrival` is the date of the read that completed it."""
        self._finished = True
        self.response.completed = arrival
        if self._stamped is not None:
            self._stamped.not_a_chunk()
        if self.done is not None and not self.done.done():
            self.done.set_result(self.response)
        self._ended()

    def _feed(self, now: float, data: bytes) -> None:
        if not self._head_done:
            if self._buffer:
                self._buffer += data
                data = bytes(self._buffer)
                self._buffer.clear()
            start = 0
            while not self._head_done:  # interim (1xx) heads, then the final one
                end = data.find(b"\r\n\r\n", start)
                if data.find(b"\n\n", start, end if end >= 0 else len(data)) >= 0:
                    # llhttp takes CRLF only: such a head would never end, and wait out the read timeout
                    raise BadResponse("a response head whose lines end in a bare LF")
                size = (end + 4 if end >= 0 else len(data)) - start
                if self._head_bytes + size > _MAX_HEAD:
                    raise BadResponse(f"response head over {_MAX_HEAD} bytes")
                if end < 0:
                    self._buffer += data[start:]
                    return
                self._head_bytes += size
                self._parse_head(data[start : end + 4])
                start = end + 4
            data = data[start:]
            if not data and self._stamped is not None:
                self._stamped.not_a_chunk()
            if self._finished:  # a response without a body
                if data:
                    self._keep_alive = False  # bytes no request asked for: the server's framing is out of step
                return
        if self._dechunker is None:
            self._plain(now, data)
        elif self._dechunker.feed(now, data):
            self._body_done(now)
        elif self._dechunker.owner is None and self.transport is not None:
            # The rest of the body is read by the de-chunker as the transport's protocol: no Python per read.
            self._dechunker.owner = self
            self.transport.set_protocol(self._dechunker)  # type: ignore[arg-type]

    def body_done(self) -> None:
        """From the de-chunker: the body is complete; the connection takes its transport back."""
        assert self._dechunker is not None
        self._take_back()
        self._body_done(self._dechunker.last_read)

    def _body_done(self, arrival: float) -> None:
        assert self._dechunker is not None
        if self._dechunker.overrun:
            self._keep_alive = False
        self._finish(arrival)

    def body_failed(self, exc: BadChunk | EventTooLarge) -> None:
        """From the de-chunker: the body's framing is broken, or its sink refused it."""
        self._take_back()
        self._fail(_failure(exc))

    def _take_back(self) -> None:
        assert self._dechunker is not None and self.transport is not None
        self._dechunker.owner = None
        self.transport.set_protocol(self)

    def _parse_head(self, head: bytes) -> None:
        """One response head, its blank line included: an interim (1xx) one is skipped; a final one says how the
        body is framed, and a response without a body (204, 304, or to HEAD) is complete with it."""
        parsed = _Head()
        parser = httptools.HttpResponseParser(parsed)
        try:
            parser.feed_data(head)
        except httptools.HttpParserUpgrade:
            raise BadResponse("a 101 upgrade, which no request asked for") from None
        except httptools.HttpParserError as exc:
            raise BadResponse(f"bad response head ({exc}): {head[:80]!r}") from None
        status, version = parser.get_status_code(), parser.get_http_version()
        if version not in ("1.0", "1.1"):
            raise BadResponse(f"HTTP/{version} response to an HTTP/1.1 request")
        if status < 200:
            if status == 101:
                raise BadResponse("a 101 upgrade, which no request asked for")
            return
        self.response.status = status
        self.response.headers = parsed.headers
        length, chunked = None, False
        for name, raw in parsed.headers:
            if name == b"transfer-encoding":
                if raw.lower() != b"chunked":  # another coding, or a list: the body could not be relayed as sent
                    raise BadResponse(f"unsupported transfer-encoding {raw[:40]!r}")
                chunked = True
            elif name == b"content-length":
                length = int(raw)  # llhttp took only digits, and one Content-Length
            elif name == b"connection" and b"close" in (token.strip().lower() for token in raw.split(b",")):
                self._keep_alive = False
        if version == "1.0":
            self._keep_alive = False
        self._head_done = True
        if self._no_body or status in _NO_BODY:
            self._finish(self._read_at)
            return
        if chunked:
            self._dechunker = Dechunker(self.sink, self.arrival)
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
            self._finish(now)


def _failure(exc: BadChunk | BadResponse | EventTooLarge) -> Exception:
    """What a response fails with: broken chunk framing is a bad response; a body refused by its sink says why."""
    return BadResponse(str(exc)) if isinstance(exc, BadChunk) else exc


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

    def last_arrival(self) -> float:
        """When the latest read of its response arrived: where a response abandoned once the client had what it
        wanted (a stream read to `[DONE]`, its chunked end still to come) ended for the client."""
        return self.connection.last_arrival()

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


def kernel_stamps_for(url: str) -> bool:
    """Whether a connection to `url` can be dated by the kernel: plain http where the kernel stamps TCP reads (TLS
    decrypts in user space)."""
    return urlsplit(url).scheme == "http" and stamped_socket.available()


def is_base_url(url: str) -> bool:
    """An http(s) URL with a host, as `Pool` needs its base URL."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018  # a port out of range or not a number raises
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


class Pool:
    """Keep-alive connections to one server; a connection carries one request at a time."""

    def __init__(self, base_url: str, clock: Callable[[], float], *,
                 connect_timeout_s: float | None = None, read_timeout_s: float | None = None,
                 ssl_context: ssl.SSLContext | None = None, kernel_stamps: bool = False) -> None:
        """`kernel_stamps`: date each read by its arrival in the kernel (`dfserve.stamped_socket`) where the
        connection allows it (`kernel_stamps_for`), on `clock`, which must then be `time.perf_counter`."""
        if not is_base_url(base_url):
            raise UserError(f"base_url {base_url!r}: not an http(s) URL with a host")
        if kernel_stamps and clock is not time.perf_counter:
            raise ValueError("kernel stamps are dated on time.perf_counter's clock")
        self.kernel_stamps = kernel_stamps and kernel_stamps_for(base_url)
        self.read_lag = ReadLag() if self.kernel_stamps else None
        """How late the loop took its connections' reads, those closed so far (`close` closes them all)."""
        parts = urlsplit(base_url)
        self.host = cast(str, parts.hostname)  # is_base_url: never None
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.encode()
        self.clock = clock
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: list[_Connection] = []

    def _kept(self) -> _Connection | None:
        """A kept-alive connection to reuse, if one is open: one the server has closed (its keep-alive timeout, or a
        close it did not announce) is dropped here, though the loop has not read its end yet, rather than failing
        the request sent on it. A request is never sent twice: the server may have read it."""
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable and not connection.ended_by_server():
                return connection
            connection.abort()
        return None

    async def _connection(self) -> _Connection:
        loop = asyncio.get_running_loop()
        new = partial(_Connection, self.clock, self.read_timeout_s)
        opening = (connect(loop, self.host, self.port, new, self.read_lag) if self.kernel_stamps
                   else loop.create_connection(new, self.host, self.port, ssl=self.ssl,
                                               server_hostname=self.host if self.ssl else None))
        try:
            # not wait_for: on Python 3.11 it swallows a cancellation that comes as the connection is made, and the
            # request then goes out on it (a stopped load test waited for its probe's answer)
            async with asyncio.timeout(self.connect_timeout_s):
                _, protocol = await opening
        except TimeoutError:  # before OSError, of which it is a kind
            raise ConnectTimedOut(f"{self.host}:{self.port}: no connection in {self.connect_timeout_s} s") from None
        except OSError as exc:
            raise ConnectFailed(f"{self.host}:{self.port}: {exc.strerror or exc}") from None
        return cast(_Connection, protocol)

    def request_bytes(self, path: str, body: bytes, method: bytes = b"POST", headers: bytes = _POST_HEADERS) -> bytes:
        """One request; `headers` are header lines each ending in CRLF, to which Host and Content-Length are
        added."""
        return (method + b" " + (self.prefix + path).encode() + b" HTTP/1.1\r\nHost: " + self.host_header + b"\r\n"
                + headers + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def fetch(self, path: str, body: bytes, headers: bytes, response: Response) -> None:
        """POST one request and fill `response` until it is complete, with no wake-up at its head (the load tester's
        hot path). Whatever arrived, and `response.sent`, stay in `response` when this raises (disconnect,
        cancellation, timeout)."""
        connection = self._kept() or await self._connection()
        _, done = connection.start(self.request_bytes(path, body, b"POST", headers), response)
        try:
            await done
        except BaseException:
            connection.abort()
            raise
        self.recycle(connection)

    async def open(self, method: bytes, path: str, body: bytes, headers: bytes, response: Response) -> Call:
        """Send one request and return once its final response head has arrived (`response.status`, `.headers`);
        a response without a body (204, 304, to HEAD) is complete by then."""
        return await self.send(self.request_bytes(path, body, method, headers), response, method == b"HEAD")

    async def send(self, request: bytes, response: Response, no_body: bool = False) -> Call:
        """`open` for a request already in bytes; `no_body`: the response has none (the request's method is HEAD).
        Whatever arrived stays in `response` when this raises (disconnect, cancellation, timeout)."""
        connection = self._kept() or await self._connection()
        _, done = connection.start(request, response, no_body)
        assert connection.head is not None
        try:
            await connection.head
        except BaseException:
            connection.abort()
            if done.done() and not done.cancelled():
                done.exception()  # its failure is told by what is raised here, not logged as never retrieved
            raise
        if done.done():
            done.result()  # the response ended before its head: raise why
        return Call(self, connection, done)

    def recycle(self, connection: _Connection) -> None:
        if connection.reusable:
            self._idle.append(connection)
        else:
            connection.abort()

    def close(self) -> None:
        for connection in self._idle:
            connection.abort()
        self._idle.clear()
