"""The gateway's client-facing HTTP/1.1 server: requests parsed by httptools, responses written straight to the
client's socket.

The gateway relays each streamed chunk from the upstream connection's data callback to this socket with one write
and no task, coroutine or message in between (`Reply.body_writer`; bench/RESULTS.md: most of a proxy's cost is per
chunk), and it
applies back-pressure the way a proxy should: when the client's socket is full, the upstream connection stops
being read (`Reply.hook`) instead of the stream piling up in memory. A client that goes away mid-response cancels
its request's task, which closes the upstream connection, and so SGLang aborts the request.

One request at a time per connection: a pipelined request waits (reading paused) until the one before is answered.
The server's own refusals (malformed HTTP, an oversize request, a handler's bug) are OpenAI-style JSON errors. A
client that shuts down its sending side is taken as gone, as uvicorn does: an LLM request is too expensive to leave
running for a client that may have left.

Slow clients cannot hold connections (`ServerLimits`): a request head and a request body each have a deadline that
bytes trickling in do not extend, a kept-alive connection is closed after an idle time, and connections past
`max_connections` are answered 503 at once, so the descriptors a slow flood can take stay bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Protocol, cast
from urllib.parse import quote, unquote

import httptools

from dfserve import sglang
from dfserve.listen import BACKLOG
from dfserve.relay_core import LAST_CHUNK, frame

log = logging.getLogger("dfserve.gateway")

_MAX_HEAD_BYTES = 64 * 1024
"""Also the most a chunk-size line (extensions included) or a trailer section may run to: llhttp reads past both
without a bound of its own."""
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_PRINTABLE = "".join(map(chr, range(0x21, 0x7F)))
_LINGER_S = 1.0
"""How long a connection refused with an error answer is held open, reading and dropping what its client still
sends, for the client to read that answer: closing with bytes unread resets the connection, and a client may lose
an answer it had not read yet to the reset."""


@dataclass(eq=False)
class Request:
    method: str
    path: str
    """Percent-decoded, without the query string."""
    headers: list[tuple[bytes, bytes]]
    """Names lower-cased, values as sent."""
    body: bytes = b""
    query: str = ""
    """The request target's query string, without its `?`: as sent, bytes outside printable ASCII percent-encoded.
    The gateway routes on `path` alone and passes the query on upstream (an OpenAI client's `default_query`)."""


class Responder(Protocol):
    """Where a handler's response goes: a client's socket (`Reply`) or nowhere (`Discard`, for shadow requests)."""

    @property
    def disconnected(self) -> bool: ...

    def whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None: ...

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    def write(self, body: bytes) -> None: ...

    def end(self, body: bytes = b"", last_chunk_written: bool = False) -> None: ...

    def body_writer(self) -> tuple[Callable[[bytes], object] | None, bool]: ...

    def hook(self, pause: Callable[[], None], resume: Callable[[], None], gone: Callable[[], None]) -> None: ...

    def unhook(self) -> None: ...


_STATUS_LINES = {status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in HTTPStatus}


JSON_HEADERS = [(b"content-type", b"application/json")]

_BODILESS = frozenset({204, 304})


def send_error(reply: Responder, status: int, message: str, kind: str,
               extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """An OpenAI-style JSON error as the whole answer."""
    reply.whole(status, JSON_HEADERS + (extra or []), sglang.error_body(message, kind, status))


def _head(status: int, headers: list[tuple[bytes, bytes]], framing: bytes) -> bytes:
    line = _STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status
    return b"".join([line, *(name + b": " + value + b"\r\n" for name, value in headers), framing, b"\r\n"])


def _last_answer(status: int, message: str, kind: str) -> bytes:
    """The server's own JSON error, whole, as the last answer of its connection."""
    body = sglang.error_body(message, kind, status)
    return _head(status, JSON_HEADERS, b"content-length: %d\r\nconnection: close\r\n" % len(body)) + body


class Reply:
    """The response to one request, written to the client's transport as it is produced.

    A streamed body (`start` then `write`s then `end`) is chunked for HTTP/1.1 clients and delimited by the
    connection's end for HTTP/1.0 ones; a response to HEAD carries no body. Writes after the client has gone are
    dropped (its request's task is being cancelled)."""

    def __init__(self, connection: ClientConnection, head_only: bool, http11: bool, keep_alive: bool) -> None:
        self.connection = connection
        self.head_only = head_only
        self.http11 = http11
        self.chunked = http11
        self.keep_alive = keep_alive
        self.started = False
        self.complete = False
        self._hooks: tuple[Callable[[], None], Callable[[], None], Callable[[], None]] | None = None
        self._paused = False

    @property
    def disconnected(self) -> bool:
        """The client left (or stopped reading): not the gateway's stop cutting its connection."""
        return self.connection.closed and not self.connection.cut_by_stop

    def _persistence(self) -> bytes:
        if not self.keep_alive:
            return b"connection: close\r\n"
        return b"" if self.http11 else b"connection: keep-alive\r\n"  # HTTP/1.0 closes unless told otherwise

    def whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole response: Content-Length framed, but a 204 or 304, which has no body and says no length (RFC 9110
        8.6)."""
        self.started = self.complete = True
        if status in _BODILESS:
            head, body = _head(status, headers, self._persistence()), b""
        else:
            head = _head(status, headers, b"content-length: %d\r\n" % len(body) + self._persistence())
        self.connection.write(head if self.head_only else head + body)

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The head of a streamed response; the body follows in `write`s and `end`."""
        self.started = True
        if self.head_only:
            self.chunked = False
        elif not self.chunked:
            self.keep_alive = False  # an HTTP/1.0 stream ends with its connection
        self.connection.write(_head(status, headers, (b"transfer-encoding: chunked\r\n" if self.chunked else b"")
                                    + self._persistence()))

    def write(self, body: bytes) -> None:
        write, chunked = self.body_writer()
        if body and write is not None:
            write(frame(body) if chunked else body)

    def body_writer(self) -> tuple[Callable[[bytes], object] | None, bool]:
        """The call that writes body bytes straight to the client's socket and whether they must be framed as
        chunks: what `write` uses, and what a relay that writes from C (`dfserve._relay`) is given; None when no body
        is to be sent (HEAD, a client already gone). `hook`'s `gone` says when a relay must stop using it."""
        transport = self.connection.transport
        if self.head_only or self.connection.closed or transport is None:
            return None, False
        return transport.write, self.chunked

    def end(self, body: bytes = b"", last_chunk_written: bool = False) -> None:
        """The body's last bytes, then its end; `last_chunk_written`: a relay already ended the chunked body in its
        last write (`EventRelay.last_chunk_written`), and `body` is empty."""
        if not last_chunk_written:
            self.write(body)
            if self.chunked and not self.head_only:
                self.connection.write(LAST_CHUNK)
        self.complete = True

    def hook(self, pause: Callable[[], None], resume: Callable[[], None], gone: Callable[[], None]) -> None:
        """Call `pause` while the client's socket is full and `resume` once it drains (the upstream's reading), and
        `gone` as soon as the client's connection is lost."""
        self._hooks = (pause, resume, gone)
        if self.connection.writes_paused:
            self.pause()

    def unhook(self) -> None:
        """Stop applying back-pressure, resuming what was paused."""
        if self._hooks is not None and self._paused:
            self._hooks[1]()
        self._hooks, self._paused = None, False

    def pause(self) -> None:
        if self._hooks is not None and not self._paused:
            self._paused = True
            self._hooks[0]()

    def resume(self) -> None:
        if self._hooks is not None and self._paused:
            self._paused = False
            self._hooks[1]()

    def lost(self) -> None:
        if self._hooks is not None:
            self._hooks[2]()


class Discard:
    """The client side of a shadow request: nobody is listening."""

    disconnected = False

    def whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        pass

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        pass

    def write(self, body: bytes) -> None:
        pass

    def end(self, body: bytes = b"", last_chunk_written: bool = False) -> None:
        pass

    def body_writer(self) -> tuple[Callable[[bytes], object] | None, bool]:
        return None, False

    def hook(self, pause: Callable[[], None], resume: Callable[[], None], gone: Callable[[], None]) -> None:
        pass

    def unhook(self) -> None:
        pass


Handler = Callable[[Request, Reply], Awaitable[None]]


@dataclass(frozen=True)
class ServerLimits:
    """What a listener allows its clients; the gateway's come from its config (`Limits`, which documents each)."""

    max_body_bytes: int
    max_connections: int
    head_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float


@dataclass(eq=False)
class _Incoming:
    """A request being parsed."""

    url: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    in_head: bool = True
    in_body: bool = False
    head_bytes: int = 0
    body: list[bytes] = field(default_factory=list)
    body_bytes: int = 0
    chunks: int = 0
    framing_bytes: int = 0
    """Bytes of a chunked body's framing since its last chunk-size line ended: a line or trailers in the making."""
    close_after: bool = False
    """RFC 9112 §6.1: an HTTP/1.0 request with Transfer-Encoding is answered, then its connection closed."""


# What a connection waits for while no request of it is being answered; each has its own deadline.
_FIRST = "first request"
_IDLE = "next request"
_HEAD = "request head"
_BODY = "request body"


class ClientConnection(asyncio.Protocol):
    """One client connection: parses its requests, runs `handler` for each in a task of its own, one at a time.

    Requests that arrive while one is being answered wait their turn (pipelining); so does a refusal of what follows
    (malformed, oversize), which is answered after them and closes the connection.

    While none of its requests is being answered, it waits for one thing (`_waiting`) until a deadline: its first
    request head (from the connection's start), the next request (an idle kept-alive connection), the rest of a
    request head (from its first byte) or of a body (from the end of its head). Bytes arriving do not move a
    deadline; one timer per connection is moved only when a deadline comes sooner than it."""

    def __init__(self, handler: Handler, limits: ServerLimits, server: Server) -> None:
        self.handler = handler
        self.limits = limits
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.stopping = False
        self.cut_by_stop = False
        """Closed by the gateway's stop with an answer still under way: the client did not leave."""
        self.writes_paused = False
        self.incoming = _Incoming()
        self.waiting: list[tuple[Request, Reply]] = []
        self.reply: Reply | None = None
        self.task: asyncio.Task[None] | None = None
        self.refusal: bytes | None = None
        """The error answer owed to a request that could not be parsed; sent once the ones before it are answered."""
        self.continue_owed = False
        """A request waiting its turn expects `100 Continue` before sending its body."""
        self._read_at = 0.0
        self._waiting: str | None = _FIRST
        self._deadline = math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._answer_taken: asyncio.Future[None] | None = None

    # asyncio callbacks ------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()  # kept: on Python 3.11 each lookup is a getpid() system call
        self._wait(_FIRST, self.loop.time())
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._read_at = self.loop.time()
        incoming = self.incoming
        head_under_way = incoming if incoming.in_head and incoming.url else None
        body_under_way = incoming if incoming.in_body else None
        body_bytes, chunks = incoming.body_bytes, incoming.chunks
        while True:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as upgrade:  # served as plain HTTP/1.1: what follows is a request
                data = data[upgrade.args[0] :]
                continue
            except httptools.HttpParserCallbackError as exc:
                refused = exc.__context__
                self.refuse(*((refused.status, str(refused)) if isinstance(refused, _Refused)
                              else (400, "malformed HTTP request")))
                return
            except httptools.HttpParserError as exc:
                self.refuse(400, f"malformed HTTP request ({exc})")
                return
            break
        if self.incoming is head_under_way and incoming.in_head:  # httptools holds a head whole until it ends
            incoming.head_bytes += len(data)
            if incoming.head_bytes > _MAX_HEAD_BYTES:
                self.refuse(431, f"request head over {_MAX_HEAD_BYTES} bytes")
                return
        elif self.incoming is body_under_way and incoming.in_body and incoming.chunks == chunks:
            # a read that ended no chunk-size line: what is not body is a line, or trailers, still growing
            incoming.framing_bytes += len(data) - (incoming.body_bytes - body_bytes)
            if incoming.framing_bytes > _MAX_HEAD_BYTES:
                self.refuse(400, f"chunk-size line or trailer section over {_MAX_HEAD_BYTES} bytes")
                return
        if self._deadline < self._timer_at and self._waiting is not None:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.lost(self)
        if self._timer is not None:
            self._timer.cancel()
        self._taken()
        if self.task is not None and self.reply is not None and not self.reply.complete:
            self.reply.lost()
            self.task.cancel()

    def pause_writing(self) -> None:
        self.writes_paused = True
        if self.reply is not None:
            self.reply.pause()

    def resume_writing(self) -> None:
        self.writes_paused = False
        self._taken()
        if self.reply is not None:
            self.reply.resume()

    def _taken(self) -> None:
        if self._answer_taken is not None and not self._answer_taken.done():
            self._answer_taken.set_result(None)

    # httptools callbacks ----------------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.incoming = _Incoming()
        if self._waiting is _IDLE:
            self._wait(_HEAD, self._read_at)
        elif self._waiting is _FIRST:
            self._waiting = _HEAD  # the first head's deadline runs from the connection's start

    def on_url(self, url: bytes) -> None:
        self.incoming.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.incoming.in_head:  # trailer fields of a chunked body are dropped, never taken for headers
            self.incoming.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        incoming, parser = self.incoming, self.parser
        incoming.in_head = False
        incoming.in_body = True
        if self._waiting is not None:
            self._wait(_BODY, self._read_at)
        size, hosts, length, coded, expects = len(incoming.url), 0, b"", False, False
        codings: list[bytes] = []
        for name, value in incoming.headers:
            size += len(name) + len(value) + 4  # ": " and CRLF at the least: 50,000 empty headers are 250 KB
            if name == b"host":
                hosts += 1
            elif name == b"content-length":
                length = value  # llhttp refuses a second one
            elif name == b"transfer-encoding":
                coded = True
                codings += [coding.strip().lower() for coding in value.split(b",") if coding.strip()]
            elif name == b"expect":
                expects = expects or value.lower() == b"100-continue"
        if size > _MAX_HEAD_BYTES:
            raise _Refused(431, f"request head over {_MAX_HEAD_BYTES} bytes")
        if other := next((coding for coding in codings if coding != b"chunked"), None):
            # read as plain chunks, a gzip-coded body would be refused as invalid JSON, or worse, taken as it is
            raise _Refused(501, f"transfer coding {other.decode('latin-1')!r} is not supported (only chunked)")
        if parser.get_method() == b"CONNECT":
            raise _Refused(405, "CONNECT is not supported")
        if parser.should_upgrade() and (coded or length.strip(b"0")):
            # httptools stops at the head of an upgrade: its body would be read as the next request
            raise _Refused(400, "an Upgrade request with a body is not supported")
        version = parser.get_http_version()
        if version not in ("1.0", "1.1"):  # httptools reads any major.minor; answered as 1.0 it would be misread
            raise _Refused(505, f"HTTP/{version} is not supported (HTTP/1.1 and 1.0 are)")
        http11 = version == "1.1"
        if hosts > 1:
            raise _Refused(400, "more than one Host header")
        if http11 and not hosts:
            raise _Refused(400, "an HTTP/1.1 request needs a Host header")
        incoming.close_after = coded and not http11
        limit = self.limits.max_body_bytes
        if length.isdigit() and int(length) > limit:
            raise _Refused(413, f"request body over the {limit}-byte limit")
        if expects and http11:
            if self.task is None:
                self.write(_CONTINUE)
            else:
                self.continue_owed = True  # after the answer under way, never inside it
                self._pause_reading()

    def on_chunk_header(self) -> None:
        self.incoming.chunks += 1
        self.incoming.framing_bytes = 0

    def on_body(self, body: bytes) -> None:
        incoming = self.incoming
        incoming.body.append(body)
        incoming.body_bytes += len(body)
        if incoming.body_bytes > self.limits.max_body_bytes:
            raise _Refused(413, f"request body over the {self.limits.max_body_bytes}-byte limit")

    def on_message_complete(self) -> None:
        self.continue_owed = False  # the body came without it
        incoming, parser = self.incoming, self.parser
        incoming.in_body = False
        method = parser.get_method().decode("ascii", "replace")
        try:
            target = httptools.parse_url(incoming.url)
        except httptools.HttpParserInvalidURLError:
            raise _Refused(400, f"malformed request target {incoming.url[:80]!r}") from None
        path = unquote((target.path or b"/").decode("latin-1"))  # absolute-form with no path: RFC 9112 §3.2.2
        query = quote(target.query, safe=_PRINTABLE) if target.query else ""
        http11 = parser.get_http_version() == "1.1"
        reply = Reply(self, head_only=method == "HEAD", http11=http11,
                      keep_alive=parser.should_keep_alive() and not incoming.close_after)
        self.waiting.append((Request(method, path, incoming.headers, b"".join(incoming.body), query), reply))
        if self.task is None:
            self._next()
        else:
            self._pause_reading()  # pipelined: the rest waits in the socket

    # requests ---------------------------------------------------------------------------------------------------

    def _next(self) -> None:
        self._waiting = None
        request, reply = self.waiting.pop(0)
        if self.stopping:
            reply.keep_alive = False
        self.reply = reply
        self.task = self.loop.create_task(self._run(request, reply))

    async def _run(self, request: Request, reply: Reply) -> None:
        try:
            await self.handler(request, reply)
            if self.writes_paused and not self.closed:
                await self._until_taken()
        except asyncio.CancelledError:
            if not self.closed:
                self.abort()
                raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            if not reply.started:
                reply.keep_alive = False
                send_error(reply, 500, "internal error in the gateway", "internal_error")
                self.server.answered(500)
            elif not reply.complete:
                self.abort()
        finally:
            self.task = self.reply = None
        if self.closed:
            return
        if not reply.complete or not reply.keep_alive:
            self.close()
        elif self.waiting:
            self._next()
        elif self.refusal is not None:
            self._linger(self.refusal)
        elif self.stopping:
            self.close()
        else:
            if self.continue_owed:
                self.continue_owed = False
                self.write(_CONTINUE)
            assert self.transport is not None
            self.transport.resume_reading()
            incoming = self.incoming  # what came behind the answer; its deadline runs from the answer's end
            self._wait(_BODY if incoming.in_body else _HEAD if incoming.in_head else _IDLE, self.loop.time())
            if self._deadline < self._timer_at:
                self._arm()

    async def _until_taken(self) -> None:
        """Wait until the client has taken most of its answer (its socket drained to the transport's low mark): the
        next request waits for it, so a client that sends requests and reads nothing cannot have answer after
        answer made upstream and held in the gateway's memory; one that takes nothing of it for `idle_timeout_s`
        is cut off."""
        assert self.transport is not None
        taken = self._answer_taken = self.loop.create_future()
        unsent = self.transport.get_write_buffer_size()
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(taken), self.limits.idle_timeout_s)
                    return
                except TimeoutError:
                    if self.transport.get_write_buffer_size() >= unsent:
                        self.abort()
                        return
                    unsent = self.transport.get_write_buffer_size()
        finally:
            self._answer_taken = None

    def refuse(self, status: int, message: str) -> None:
        """Answer the server's own error, after the answers still owed, and close the connection (what follows in
        it cannot be parsed)."""
        self.refusal = _last_answer(status, message, "invalid_request_error")
        self.server.answered(status)
        if self.task is None:
            self._linger(self.refusal)
        else:
            self._pause_reading()

    def _linger(self, answer: bytes) -> None:
        """Send the last answer and hand the connection to `_Linger`: done with here, and no longer counted."""
        self.closed = True
        self.server.lost(self)
        if self._timer is not None:
            self._timer.cancel()
        assert self.transport is not None
        lingering = _Linger(self.server, answer)
        self.transport.set_protocol(lingering)
        lingering.connection_made(self.transport)

    def stop(self) -> None:
        """Finish the answer under way, if any, and close; nothing more is read."""
        self.stopping = True
        if self.task is None:
            self.close()
            return
        self._pause_reading()
        if self.reply is not None and not self.reply.started:
            self.reply.keep_alive = False

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def _pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def _wait(self, waiting: str, since: float) -> None:
        limits = self.limits
        self._waiting = waiting
        self._deadline = since + (limits.idle_timeout_s if waiting is _IDLE else
                                  limits.body_timeout_s if waiting is _BODY else limits.head_timeout_s)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(self._deadline, self._check_deadline)
        self._timer_at = self._deadline

    def _check_deadline(self) -> None:
        """The one timer of a connection: a deadline that moved later re-arms it, one that passed closes the
        connection (408 when part of a request came); a request being answered has none."""
        self._timer, self._timer_at = None, math.inf
        waiting = self._waiting
        if self.closed or waiting is None:
            return
        if self.loop.time() < self._deadline:
            self._arm()
        elif waiting is _IDLE:
            self.close()
        else:
            self.server.refused("body_timeout" if waiting is _BODY else "head_timeout")
            if waiting is _FIRST:
                self.close()
            else:
                limit_s = self.limits.body_timeout_s if waiting is _BODY else self.limits.head_timeout_s
                self.refuse(408, f"{waiting} not received within {limit_s:g} s")

    def close(self) -> None:
        """Close once what was written is sent; a client that does not take it within `idle_timeout_s` is cut off
        (a transport closed with bytes the peer never reads stays open, and counted, for good)."""
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
            if self.transport.get_write_buffer_size():
                self.loop.call_later(self.limits.idle_timeout_s, self.transport.abort)

    def abort(self) -> None:
        if self.transport is not None:
            self.closed = True
            self.transport.abort()


class _Refused(Exception):
    """Raised from a parser callback: httptools wraps it, and `data_received` answers it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _not_counted(reason: str | int) -> None:
    pass


class Server:
    """The client listener: accepts connections on a bound socket and, on `stop`, lets answers under way finish.

    `refused` is called with the reason (`dfserve.metrics.REFUSAL_REASONS`) whenever it closes a client's
    connection on its own; `answered` with the status of each request it answers itself (unreadable, or the
    handler failed)."""

    def __init__(self, handler: Handler, limits: ServerLimits,
                 refused: Callable[[str], object] = _not_counted,
                 answered: Callable[[int], object] = _not_counted) -> None:
        self.handler = handler
        self.limits = limits
        self.refused = refused
        self.answered = answered
        self.connections: set[ClientConnection] = set()
        self.lingering: set[_Linger] = set()
        self._server: asyncio.Server | None = None
        self._drained: asyncio.Event | None = None

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accepted, sock=sock, backlog=BACKLOG)

    def _accepted(self) -> asyncio.Protocol:
        """The protocol of a connection just accepted, counted at once: a loop may accept many before it makes any."""
        if len(self.connections) >= self.limits.max_connections:
            self.refused("over_capacity")
            return _Linger(self, _OVER_CAPACITY)
        connection = ClientConnection(self.handler, self.limits, self)
        self.connections.add(connection)
        return connection

    def lost(self, connection: ClientConnection) -> None:
        self.connections.discard(connection)
        if self._drained is not None and not self.connections:
            self._drained.set()

    async def stop(self, drain_s: float = 10.0) -> None:
        """Stop accepting; close idle connections now and busy ones once their answers are out and sent (at most
        `drain_s`), then wait for every request's task to end."""
        if self._server is not None:
            self._server.close()
        self._drained = asyncio.Event()
        for connection in list(self.connections):
            connection.stop()
        if self.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), drain_s)
        tasks = [c.task for c in self.connections if c.task is not None]
        for connection in list(self.connections):
            connection.cut_by_stop = True
            connection.abort()  # cancels what is still running
        for lingering in list(self.lingering):
            if lingering.transport is not None:
                lingering.transport.abort()
        await asyncio.gather(*tasks, return_exceptions=True)


_OVER_CAPACITY = _last_answer(503, "the gateway has as many client connections open as it allows "
                              "(limits.max_connections); retry later", "server_overloaded")


class _Linger(asyncio.Protocol):
    """A connection the server is done with, after one last answer (a refusal): the answer goes out with the end of
    the server's side, and what the client still sends is read and dropped until it closes its side, for
    `_LINGER_S` at most. Connections past `max_connections` start here, answered 503 before their request is read.
    Lingering connections are bounded like served ones; past that one is closed right after its answer."""

    def __init__(self, server: Server, answer: bytes) -> None:
        self.server = server
        self.answer = answer
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        transport.write(self.answer)
        if len(self.server.lingering) >= self.server.limits.max_connections:
            transport.close()
            return
        self.server.lingering.add(self)
        transport.write_eof()
        transport.resume_reading()
        self.timer = asyncio.get_running_loop().call_later(_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.lingering.discard(self)
        if self.timer is not None:
            self.timer.cancel()
