"""The floor for a proxy on CPython and uvloop: bytes relayed between two sockets, parsed not at all.

Each client connection gets its own upstream connection and every read is written straight to the other side, so
HTTP keep-alive passes through untouched. Per chunk it costs one read, one write and one Python callback, the least
any proxy on this event loop can do; `gateway_overhead.py` runs it beside the gateway to show how much of the
gateway's CPU is the loop and the kernel rather than its own work.

Usage: tcp_floor_proxy.py LISTEN_PORT UPSTREAM_PORT (both on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import sys

import uvloop

LOOPBACK = "127.0.0.1"


class Pipe(asyncio.Protocol):
    """One side of a relayed connection: what it reads goes to `peer`; back-pressure pauses the other side."""

    transport: asyncio.Transport

    def __init__(self) -> None:
        self.peer: Pipe | None = None
        self.early: list[bytes] = []
        """What arrived before `peer` was connected (uvloop may read once before `pause_reading` takes hold)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.early.append(data)
        else:
            self.peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer.transport.resume_reading()


class Client(Pipe):
    """The client's side: what it reads waits for its upstream connection to open."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__()
        self.upstream_port = upstream_port
        self.connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.pause_reading()  # type: ignore[attr-defined]
        self.connecting = asyncio.ensure_future(self.connect())

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(Pipe, LOOPBACK, self.upstream_port)
        except OSError:
            self.transport.close()
            return
        if self.transport.is_closing():  # the client left while this connected
            upstream.transport.close()
            return
        upstream.peer, self.peer = self, upstream
        upstream.transport.write(b"".join(self.early))
        self.early.clear()
        self.transport.resume_reading()


async def serve(listen_port: int, upstream_port: int) -> None:
    """Port 0 takes a free port; the line `tcp-floor: listening on http://HOST:PORT` says which."""
    server = await asyncio.get_running_loop().create_server(lambda: Client(upstream_port), LOOPBACK, listen_port)
    port = server.sockets[0].getsockname()[1]
    print(f"tcp-floor: listening on http://{LOOPBACK}:{port}", file=sys.stderr, flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1]), int(sys.argv[2])))
