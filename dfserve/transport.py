"""httpx's client API over dfserve's stamping HTTP/1.1 client (`dfserve.http1`).

httpx's own transport wakes a task and runs several Python layers per read, which at 128 synchronized streams
delays the stamp of the last arrival by tens of milliseconds. `StampingTransport` keeps httpx's client
API (headers, auth, TLS verification, timeouts, event hooks) and puts `dfserve.http1` under it: the clock is read
the moment bytes arrive, and a caller that only needs the whole body with its stamps waits once for its end
(`wait_complete`) instead of once per read.

    stamps = Stamps()
    async with httpx.AsyncClient(transport=StampingTransport(), base_url=url, timeout=None) as client:
        request = client.build_request("POST", "/generate", json=body, extensions={STAMPS: stamps})
        response = await client.send(request, stream=True)
        await wait_complete(response)      # or `async for piece in response.aiter_raw()`, a wake-up per read
        await response.aclose()
    stamps.sent, stamps.pieces            # the write's clock reading; (arrival clock reading, bytes) per read

`Stamps` is the caller's: it is filled however the exchange ends, so a request that times out or is cancelled
still says when it was written and what arrived. Failures are httpx's exceptions: `ConnectError` and
`ConnectTimeout`, `ReadTimeout`, `ReadError` (the server closed mid-response) and `RemoteProtocolError` (bytes that
are not an HTTP/1.1 response).

The load tester's probes use it; its measured requests use `dfserve.http1` directly, since building httpx's request
and response objects costs about 26 µs a request (bench/request_overhead.py), loop time that shows in the tail of
its own timing error when many streams end together. Request bodies are read whole and sent with
`Content-Length`. A proxy is not spoken: httpx routes proxied
requests to a transport of its own, without stamps (`wait_complete` refuses such a response).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from dfserve.http1 import (
    BadResponse,
    Call,
    ConnectFailed,
    ConnectTimedOut,
    Disconnected,
    Pool,
    ReaderStalled,
    ReadTimeout,
    Response,
)

STAMPS = "dfserve.stamps"
"""The key of a request's and its response's `extensions` under which the exchange's `Stamps` are found."""
BODY = "dfserve.body"
"""The key of a response's `extensions` under which its `StampedBody` is found (httpx wraps `response.stream`)."""


@dataclass(eq=False)
class Stamps(Response):
    """One exchange as the clock saw it: `sent`, read just before the request's write; each body piece with the
    clock reading of its arrival (`pieces`); the response's status and headers."""

    _waiter: asyncio.Future[None] | None = field(default=None, repr=False)

    def received(self, now: float, data: bytes) -> None:
        self.pieces.append((now, data))
        if self._waiter is not None:
            self._wake()

    def ended(self) -> None:
        if self._waiter is not None:
            self._wake()

    def _wake(self) -> None:
        assert self._waiter is not None
        if not self._waiter.done():
            self._waiter.set_result(None)

    async def next_change(self) -> None:
        """Wait for the next piece or the end (only a reader iterating the body pays for this wake-up)."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


@contextmanager
def _as_httpx(request: httpx.Request) -> Iterator[None]:
    """dfserve.http1's failures as httpx's exceptions, which is what an httpx client's caller catches."""
    try:
        yield
    except ConnectTimedOut as exc:
        raise httpx.ConnectTimeout(str(exc), request=request) from None
    except ConnectFailed as exc:
        raise httpx.ConnectError(str(exc), request=request) from None
    except (ReadTimeout, ReaderStalled) as exc:
        raise httpx.ReadTimeout(str(exc), request=request) from None
    except Disconnected as exc:
        raise httpx.ReadError(str(exc), request=request) from None
    except BadResponse as exc:
        raise httpx.RemoteProtocolError(str(exc), request=request) from None


class StampedBody(httpx.AsyncByteStream):
    """A response body arriving into its `Stamps`; iterating wakes once per read, `complete` once at the end."""

    def __init__(self, call: Call, stamps: Stamps, request: httpx.Request) -> None:
        self.call = call
        self.stamps = stamps
        self.request = request

    async def complete(self) -> None:
        """Wait for the end of the body; its pieces are in `stamps.pieces`."""
        with _as_httpx(self.request):
            await self.call.finish()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        given = 0
        while True:
            pieces = self.stamps.pieces
            while given < len(pieces):
                yield pieces[given][1]
                given += 1
            if self.call.done.done():
                await self.complete()  # raises why the body failed, if it did
                return
            await self.stamps.next_change()

    async def aclose(self) -> None:
        self.call.close()


def _request_bytes(request: httpx.Request, body: bytes) -> bytes:
    """The request as HTTP/1.1 bytes: its own headers (httpx gave it Host) with the body's length."""
    fields = [(name, value) for name, value in request.headers.raw
              if name.lower() not in (b"content-length", b"transfer-encoding")]
    raw = b"".join(name + value for name, value in fields)
    if b"\r" in raw or b"\n" in raw or b"\0" in raw:
        bad = next(name for name, value in fields if any(c in name + value for c in (b"\r", b"\n", b"\0")))
        raise httpx.LocalProtocolError(f"header {bad!r}: CR, LF or NUL in a header", request=request)
    if body or request.method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        fields.append((b"Content-Length", str(len(body)).encode()))
    head = b"".join(name + b": " + value + b"\r\n" for name, value in fields)
    return request.method.encode() + b" " + request.url.raw_path + b" HTTP/1.1\r\n" + head + b"\r\n" + body


class StampingTransport(httpx.AsyncBaseTransport):
    """Keep-alive connections per origin and timeout setting, one request at a time on each; `verify` as httpx's
    (True, False, a CA bundle path or an `ssl.SSLContext`); `clock` is what stamps arrivals."""

    def __init__(self, *, verify: bool | str | ssl.SSLContext = True,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._verify = verify
        self._ssl: ssl.SSLContext | None = None
        self.clock = clock
        self._pools: dict[tuple[bytes, bytes, int | None, float | None, float | None], Pool] = {}

    def _pool(self, url: httpx.URL, connect_s: float | None, read_s: float | None) -> Pool:
        key = (url.raw_scheme, url.raw_host, url.port, connect_s, read_s)
        pool = self._pools.get(key)
        if pool is None:
            origin = f"{url.scheme}://{url.netloc.decode('ascii')}"
            if url.scheme == "https" and self._ssl is None:
                self._ssl = (self._verify if isinstance(self._verify, ssl.SSLContext)
                             else httpx.create_ssl_context(verify=self._verify))
            pool = self._pools[key] = Pool(origin, self.clock, connect_timeout_s=connect_s, read_timeout_s=read_s,
                                           ssl_context=self._ssl)
        return pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"{request.url.scheme!r}: only http and https", request=request)
        stamps = request.extensions.get(STAMPS)
        if not isinstance(stamps, Stamps):
            stamps = Stamps()
        timeout = request.extensions.get("timeout", {})
        pool = self._pool(request.url, timeout.get("connect"), timeout.get("read"))
        data = _request_bytes(request, await request.aread())
        with _as_httpx(request):
            call = await pool.send(data, stamps, no_body=request.method == "HEAD")
        body = StampedBody(call, stamps, request)
        return httpx.Response(stamps.status, headers=stamps.headers, stream=body,
                              extensions={STAMPS: stamps, BODY: body, "http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


async def wait_complete(response: httpx.Response) -> Stamps:
    """Wait for the end of a `StampingTransport` response's body, with no wake-up per read; its stamps."""
    body = response.extensions.get(BODY)
    if not isinstance(body, StampedBody):
        raise TypeError("not a response of StampingTransport (a proxied request goes to httpx's own transport)")
    await body.complete()
    return body.stamps
