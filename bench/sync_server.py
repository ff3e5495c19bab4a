"""A streaming server whose timing is known, for bench/tester_timing.py: every request gets its first chunk a fixed
TTFT after it arrived, then the rest a fixed gap apart, every stream the same length, so in a closed loop all
streams end within the same few milliseconds (as in any benchmark with fixed output lengths).

It speaks SGLang's two streaming routes as far as a load tester reads them (POST /generate with meta_info, POST
/v1/chat/completions with usage at the end), stamps each request's arrival (when the last byte of its body reached
the kernel: `dfserve.stamped_socket`, so the time this loop takes to get to a request is its own lateness, not the
client's) and each first chunk's send, and serves them at GET /log: per request, the number in its prompt's `req-N` marker,
arrival and first-chunk send on the wall clock, and the server's own lateness (first chunk sent - due, and the
worst chunk's). GET /progress counts ended streams and chunks sent, for a CPU window over a run.

    python bench/sync_server.py --port 0 --ttft-ms 20 --gap-ms 10 --chunks 64

`--first-together K` sends the first K chunks in one write when the first is due, as a server that flushes late
does: a client reads them in one read, and is right to date them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import time
from dataclasses import dataclass
from typing import cast

import uvloop

from dfserve.stamped_socket import StampedSocket, available, stamp_arrivals

MARKER = re.compile(rb"req-(\d+)")
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
LAST_CHUNK = b"0\r\n\r\n"


def chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chat_chunk(finish: str | None) -> dict[str, object]:
    return {"id": "chatcmpl-sync", "object": "chat.completion.chunk", "created": 0, "model": "sync",
            "choices": [{"index": 0, "delta": {"content": " tok"}, "logprobs": None, "finish_reason": finish}]}


def native_chunk(tokens: int, finish: dict[str, object] | None) -> dict[str, object]:
    return {"text": " tok" * tokens, "output_ids": [], "meta_info": {
        "id": "sync", "prompt_tokens": 8, "completion_tokens": tokens, "finish_reason": finish}}


@dataclass
class Streams:
    """Each stream's bytes, prebuilt: chunk k of a route is the same for every request."""

    chat: list[bytes]
    native: list[bytes]

    @classmethod
    def build(cls, chunks: int) -> Streams:
        usage = {"id": "chatcmpl-sync", "object": "chat.completion.chunk", "created": 0, "model": "sync",
                 "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": chunks, "total_tokens": 8 + chunks}}
        chat = [chunked(sse(chat_chunk(None))) for _ in range(chunks - 1)]
        chat.append(chunked(sse(chat_chunk("stop")) + sse(usage) + b"data: [DONE]\n\n") + LAST_CHUNK)
        native = [chunked(sse(native_chunk(k + 1, None))) for k in range(chunks - 1)]
        finish = {"type": "length", "length": chunks}
        native.append(chunked(sse(native_chunk(chunks, finish)) + b"data: [DONE]\n\n") + LAST_CHUNK)
        return cls(chat, native)


@dataclass
class Served:
    """One request as the server saw it; times in seconds."""

    marker: int
    arrival_unix: float
    first_sent_unix: float = 0.0
    first_late: float = 0.0
    worst_late: float = 0.0


class Server:
    def __init__(self, ttft_s: float, gap_s: float, chunks: int, first_together: int = 1) -> None:
        self.ttft_s = ttft_s
        self.gap_s = gap_s
        self.streams = Streams.build(chunks)
        self.first_together = first_together
        self.log: list[Served] = []
        self.ended = 0
        self.chunks_sent = 0

    def progress(self) -> bytes:
        return json.dumps({"ended": self.ended, "chunks": self.chunks_sent}).encode()

    def dump(self) -> bytes:
        return json.dumps([[s.marker, s.arrival_unix, s.first_sent_unix, s.first_late, s.worst_late]
                           for s in self.log]).encode()


class Connection(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.buffer = b""
        self.streaming = False
        self.transport: StampedSocket | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(StampedSocket, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        now_pc = self.transport.arrival()
        now_unix = time.time() - (time.perf_counter() - now_pc)
        self.buffer += data
        while not self.streaming:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buffer[:end].decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self.handle(method, path, body, now_pc, now_unix)

    def reply(self, status: str, body: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status.encode(), len(body), body))

    def handle(self, method: str, path: str, body: bytes, now_pc: float, now_unix: float) -> None:
        server = self.server
        if method == "POST" and path in ("/generate", "/v1/chat/completions"):
            found = MARKER.search(body)
            served = Served(int(found.group(1)) if found else -1, now_unix)
            server.log.append(served)
            assert self.transport is not None
            self.transport.write(HEAD)
            self.streaming = True
            chunks = server.streams.chat if path.startswith("/v1") else server.streams.native
            self.send(chunks, 0, served, now_pc)
        elif method == "GET" and path == "/health":
            self.reply("200 OK", b"{}")
        elif method == "GET" and path == "/progress":
            self.reply("200 OK", server.progress())
        elif method == "GET" and path == "/log":
            self.reply("200 OK", server.dump())
        else:
            self.reply("404 Not Found", b'{"error": "not served"}')

    def send(self, chunks: list[bytes], k: int, served: Served, arrival_pc: float) -> None:
        """Chunk `k` is due `ttft + k * gap` after arrival; sent now (a timer's callback) or, for k = 0, scheduled."""
        server = self.server
        due = arrival_pc + server.ttft_s + k * server.gap_s
        now = time.perf_counter()
        if now < due:
            self.loop.call_at(self.loop.time() + (due - now), self.send, chunks, k, served, arrival_pc)
            return
        if self.transport is None:
            server.ended += 1
            return
        together = server.first_together if k == 0 else 1
        self.transport.write(b"".join(chunks[k : k + together]))
        server.chunks_sent += len(chunks[k : k + together])
        late = now - due
        if k == 0:
            served.first_sent_unix = served.arrival_unix + (now - arrival_pc)
            served.first_late = late
        served.worst_late = max(served.worst_late, late)
        if k + together < len(chunks):
            self.send(chunks, k + together, served, arrival_pc)
        else:
            server.ended += 1
            self.streaming = False
            if self.buffer:
                self.data_received(b"")


async def serve(port: int, server: Server) -> None:
    """Accept connections and read each through a `StampedSocket`, so that a request's arrival is when its last
    byte reached the kernel, not when this loop got to it (a burst of 128 requests is read one after another)."""
    if not available():
        raise SystemExit("sync-server: the kernel does not stamp TCP reads here")
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", port))
    listener.listen(1024)
    listener.setblocking(False)
    stamp_arrivals(listener)
    print(f"sync-server: listening on http://127.0.0.1:{listener.getsockname()[1]}", flush=True)
    while True:
        sock, _ = await loop.sock_accept(listener)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stamp_arrivals(sock)
        StampedSocket(loop, sock, Connection(server))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--first-together", type=int, default=1, help="chunks sent in the first write")
    args = parser.parse_args()
    if not 1 <= args.first_together <= args.chunks:
        parser.error("--first-together: from 1 to --chunks")
    uvloop.run(serve(args.port, Server(args.ttft_ms / 1e3, args.gap_ms / 1e3, args.chunks, args.first_together)))


if __name__ == "__main__":
    main()
