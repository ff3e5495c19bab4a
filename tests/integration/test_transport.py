"""httpx's client API over the stamping transport, against scripted loopback servers: what goes on the wire, the
stamps a caller gets (also from a failed exchange), streaming reads, keep-alive, and httpx's exceptions."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from dfserve.transport import STAMPS, StampingTransport, Stamps, wait_complete

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
CHUNK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head, await reader.readexactly(length)


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    connections: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):  # the client left
            await handler(reader, writer)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in connections:
            writer.close()
        await server.wait_closed()


def test_requests_carry_the_clients_headers_and_the_stamps_bracket_the_pieces() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(CHUNK_HEAD + chunk(b"data: 1\n\n"))
            await asyncio.sleep(0.03)
            writer.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")

    async def go() -> tuple[list[Stamps], int]:
        async with serving(handler) as url:
            transport = StampingTransport()
            async with httpx.AsyncClient(transport=transport, base_url=url,
                                         headers={"Authorization": "Bearer k"}) as client:
                stamps = []
                for _ in range(2):
                    stamp = Stamps()
                    request = client.build_request("POST", "/generate?x=1", json={"a": 1},
                                                   extensions={STAMPS: stamp})
                    response = await client.send(request, stream=True)
                    assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
                    assert await wait_complete(response) is stamp
                    await response.aclose()
                    stamps.append(stamp)
                return stamps, len(transport._pools)

    stamps, pools = asyncio.run(go())
    assert pools == 1 and len(seen) == 2  # both requests on the one kept-alive connection's pool
    head, body = seen[0]
    assert head.startswith(b"POST /generate?x=1 HTTP/1.1\r\n") and b"\r\nAuthorization: Bearer k\r\n" in head
    assert b"\r\nContent-Length: 7\r\n" in head and b"Transfer-Encoding" not in head and body == b'{"a":1}'
    for stamp in stamps:
        assert stamp.sent is not None and [data for _, data in stamp.pieces] == [b"data: 1\n\n", b"data: 2\n\n"]
        first, second = (now for now, _ in stamp.pieces)
        assert stamp.sent < first and second - first >= 0.025


def test_iterating_a_body_yields_each_read_as_it_arrives() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNK_HEAD + chunk(b"first"))
        await release.wait()
        writer.write(chunk(b"second") + b"0\r\n\r\n")

    async def go() -> list[bytes]:
        got = []
        async with serving(handler) as url, httpx.AsyncClient(transport=StampingTransport()) as client:
            async with client.stream("GET", url + "/s") as response:
                async for piece in response.aiter_raw():
                    got.append(piece)
                    release.set()  # the second piece is sent only once the first was read
        return got

    assert asyncio.run(go()) == [b"first", b"second"]


def test_a_whole_response_reads_as_any_httpx_response() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            if head.startswith(b"HEAD"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n")
            else:
                writer.write(b'HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n'
                             b'{"ok": 1}')

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with serving(handler) as url, httpx.AsyncClient(transport=StampingTransport()) as client:
            return await client.post(url + "/x", content=b"abc"), await client.head(url + "/x")

    whole, head = asyncio.run(go())
    assert whole.status_code == 201 and whole.json() == {"ok": 1}
    assert head.status_code == 200 and head.content == b""


def test_failures_are_httpx_exceptions_and_the_stamps_keep_what_happened() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNK_HEAD + chunk(b"partial"))
        await writer.drain()
        writer.transport.abort()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SPDY/9 nonsense\r\n\r\n")

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def attempt(handler: Handler, limits: httpx.Timeout) -> tuple[type[BaseException], Stamps]:
        stamps = Stamps()
        async with serving(handler) as url, httpx.AsyncClient(transport=StampingTransport(), timeout=limits) as c:
            with pytest.raises(httpx.HTTPError) as caught:
                request = c.build_request("POST", url + "/g", content=b"{}", extensions={STAMPS: stamps})
                response = await c.send(request, stream=True)
                try:
                    await wait_complete(response)
                finally:
                    await response.aclose()
        return caught.type, stamps

    async def refused() -> type[BaseException]:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        async with httpx.AsyncClient(transport=StampingTransport()) as client:
            with pytest.raises(httpx.HTTPError) as caught:
                await client.get(f"http://127.0.0.1:{port}/")
        return caught.type

    kind, stamps = asyncio.run(attempt(cut, httpx.Timeout(5)))
    assert kind is httpx.ReadError and [data for _, data in stamps.pieces] == [b"partial"] and stamps.sent
    kind, _ = asyncio.run(attempt(garbage, httpx.Timeout(5)))
    assert kind is httpx.RemoteProtocolError
    kind, stamps = asyncio.run(attempt(silent, httpx.Timeout(5, read=0.1)))
    assert kind is httpx.ReadTimeout and stamps.sent is not None and stamps.status == 0
    assert asyncio.run(refused()) is httpx.ConnectError


def test_a_header_that_would_split_the_request_is_refused() -> None:
    async def go() -> None:
        async with httpx.AsyncClient(transport=StampingTransport()) as client:
            await client.get("http://127.0.0.1:9/", headers={"x-a": "1\r\nx-smuggled: 2"})

    with pytest.raises(httpx.LocalProtocolError, match="x-a"):
        asyncio.run(go())


def test_a_response_of_another_transport_is_refused_by_wait_complete() -> None:
    async def go() -> None:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=b"x"))
        async with httpx.AsyncClient(transport=transport) as client:
            await wait_complete(await client.get("http://test/"))

    with pytest.raises(TypeError, match="StampingTransport"):
        asyncio.run(go())


def test_https_is_verified_as_httpx_verifies_it(tmp_path: Path) -> None:
    """A server whose certificate the client trusts is reached; the same server with httpx's default trust store is
    refused as a connect error, before any request byte is sent."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecure")
        await writer.drain()

    async def go(verify: ssl.SSLContext | bool) -> bytes:
        server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=served)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        try:
            async with httpx.AsyncClient(transport=StampingTransport(verify=verify)) as client:
                return (await client.get(url)).content
        finally:
            server.close()

    assert asyncio.run(go(ssl.create_default_context(cafile=str(cert)))) == b"secure"
    with pytest.raises(httpx.ConnectError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        asyncio.run(go(True))
