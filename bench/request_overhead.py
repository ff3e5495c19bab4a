"""Benchmark: the load tester's CPU per request on the send side, by how a request reaches the wire.

One process sends requests one after another to a loopback server (an asyncio protocol answering each read with a
fixed 2-byte response, in the same process: its cost is the same in every row) and measures process CPU time per
request, the paths interleaved in rounds so that a slow spell of the shared machine falls on all of them:

- `AsyncClient.build_request + send`: httpx's client API over `StampingTransport` (cookies, auth flow, URL merging);
- `AsyncClient.send`: an `httpx.Request` built from a parsed URL and prepared headers, sent by the client;
- `transport`: the same request handed to `StampingTransport.handle_async_request` (what the tester does);
- `http1.Pool`: dfserve's HTTP/1.1 client alone, with bytes for a request.

Each request waits for its whole (stamped) response. At 128 streams that end together, the difference between two
rows times 128 is loop time spent while the next wave's first chunks arrive.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/request_overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_section  # noqa: E402
from dfserve.http1 import Pool, Response  # noqa: E402
from dfserve.transport import STAMPS, StampingTransport, Stamps, wait_complete  # noqa: E402

SECTION = "request_overhead"
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Answering(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(ANSWER)  # type: ignore[attr-defined]


async def measure(requests: int, rounds: int) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Answering, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    body = json.dumps({"text": "x" * 2000, "sampling_params": {"max_new_tokens": 64}, "stream": True}).encode()
    headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity", "Content-Type": "application/json"}
    transport = StampingTransport()
    client = httpx.AsyncClient(transport=transport, base_url=base, timeout=None, trust_env=False, headers=headers)
    url = httpx.URL(base + "/generate")
    prepared = httpx.Headers({"Host": url.netloc.decode(), **headers})
    pool = Pool(base, time.perf_counter)
    raw_headers = b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())

    async def built_and_sent() -> None:
        request = client.build_request("POST", "/generate", content=body, extensions={STAMPS: Stamps()})
        response = await client.send(request, stream=True)
        await wait_complete(response)
        await response.aclose()

    async def sent() -> None:
        request = httpx.Request("POST", url, headers=prepared, content=body, extensions={STAMPS: Stamps()})
        response = await client.send(request, stream=True)
        await wait_complete(response)
        await response.aclose()

    async def through_transport() -> None:
        request = httpx.Request("POST", url, headers=prepared, content=body, extensions={STAMPS: Stamps()})
        response = await transport.handle_async_request(request)
        await wait_complete(response)
        await response.aclose()

    async def pool_alone() -> None:
        call = await pool.open(b"POST", "/generate", body, raw_headers, Response())
        await call.finish()
        call.close()

    paths: dict[str, Callable[[], Awaitable[None]]] = {
        "AsyncClient.build_request + send": built_and_sent,
        "AsyncClient.send": sent,
        "transport": through_transport,
        "http1.Pool": pool_alone,
    }
    per_request: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, one in paths.items():
            for _ in range(requests // 10):
                await one()  # warm
            started = time.process_time()
            for _ in range(requests):
                await one()
            per_request[name].append((time.process_time() - started) / requests * 1e6)
    await client.aclose()
    pool.close()
    server.close()
    return per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per path in each round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    per_request = asyncio.run(measure(args.requests, args.rounds))
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python bench/request_overhead.py" + "".join(
        f" {a}" for a in sys.argv[1:])
    floor = float(np.median(per_request["http1.Pool"]))
    rows = [f"| {name} | {float(np.median(v)):.1f} | {min(v):.1f} / {max(v):.1f} | "
            f"+{float(np.median(v)) - floor:.1f} | {(float(np.median(v)) - floor) * 128 / 1000:.1f} |"
            for name, v in per_request.items()]
    body = "\n".join([
        "## Load tester: CPU per request on the send side (`bench/request_overhead.py`)",
        "",
        f"`{command}` — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, Python "
        f"{platform.python_version()}, httpx {httpx.__version__}; {args.rounds} interleaved rounds of "
        f"{args.requests} sequential requests per path, to a loopback server in the same process (a fixed 2-byte "
        "answer; its cost is in every row). Microseconds of process CPU per request; the median round, the "
        "fastest and slowest beside it; the last column is the extra loop time over `http1.Pool` when 128 "
        "requests go out together.",
        "",
        "| path | µs per request | rounds min / max | over http1.Pool | ms per 128-request wave |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "The load tester takes the `transport` path: httpx's request and response models and exceptions over "
        "dfserve's stamping client, without `AsyncClient.send`.",
    ])
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
