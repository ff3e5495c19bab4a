"""The floor of bench/tester_timing.py: a minimal streaming client (aiohttp + uvloop, a coroutine per request, no
records kept) against bench/sync_server.py. Per request it keeps only its number, the wall-clock time just before
the request is handed to aiohttp, and the time of the first read that carries a token; at the end it writes them as
JSON to --out.

    python bench/floor_client.py --url http://127.0.0.1:PORT --api chat --concurrency 128 --requests 896 --out f.json
    python bench/floor_client.py --url ... --rate 200 --requests 1000 --out f.json   # Poisson arrivals
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import time
from pathlib import Path

import aiohttp
import uvloop

ROUTES = {"chat": "/v1/chat/completions", "native": "/generate"}
TOKEN = {"chat": b'"content"', "native": b'"text"'}


def body(api: str, number: int) -> bytes:
    prompt = f"req-{number}: write a function"
    if api == "chat":
        return json.dumps({"model": "default", "messages": [{"role": "user", "content": prompt}], "stream": True,
                           "max_tokens": 64}).encode()
    return json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": 64}, "stream": True}).encode()


async def one(session: aiohttp.ClientSession, url: str, api: str, number: int, out: list[list[float]]) -> None:
    payload = body(api, number)
    marker = TOKEN[api]
    first = 0.0
    sent = time.time()
    async with session.post(url, data=payload, headers={"content-type": "application/json"}) as response:
        async for data in response.content.iter_any():
            if not first and marker in data:
                first = time.time()
    out.append([number, sent, first])


async def run(args: argparse.Namespace) -> list[list[float]]:
    out: list[list[float]] = []
    url = args.url.rstrip("/") + ROUTES[args.api]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        if args.rate is None:
            numbers = iter(range(args.requests))

            async def worker() -> None:
                for number in numbers:
                    await one(session, url, args.api, number, out)

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        else:
            rng = random.Random(args.seed)
            start = time.perf_counter()
            due = 0.0
            tasks = []
            for number in range(args.requests):
                delay = start + due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(session, url, args.api, number, out)))
                due += rng.expovariate(args.rate)
            await asyncio.gather(*tasks)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--api", choices=sorted(ROUTES), default="chat")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals at this many requests per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gc.collect()
    gc.freeze()  # as dfserve's tester does: no full collection over the imported heap during the run
    args.out.write_text(json.dumps(uvloop.run(run(args))))


if __name__ == "__main__":
    main()
