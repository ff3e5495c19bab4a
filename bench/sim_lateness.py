"""Benchmark: how late the simulated engine sends stream chunks against its own model schedule.

The sim schedules every step on an absolute clock (prefill and verify-round durations from its latency model);
with `--record-chunk-times` the final chunk of each native stream lists when each chunk was due and when it was
sent. Lateness = sent - due. Target: p99 under 2 ms at 256 concurrent streams, time scale 1, one sim process.
A closed-loop aiohttp client keeps `--streams` native streams open; the sim's CPU comes from /proc.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/sim_lateness.py --streams 256 --seconds 60

It prints its figures and replaces its own section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_section  # noqa: E402
from dfserve import sglang as proto  # noqa: E402
from tests.integration.servers import LOOPBACK, dfserve_argv, serve  # noqa: E402

SECTION = "sim_lateness"


@dataclass
class Samples:
    lateness_ms: list[float] = field(default_factory=list)
    client_ms: list[float] = field(default_factory=list)
    due_unix_s: list[float] = field(default_factory=list)
    requests: int = 0
    errors: int = 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_once(session: aiohttp.ClientSession, url: str, body: bytes, window: tuple[float, float],
                      samples: Samples) -> None:
    received: list[float] = []
    last = b""
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as response:
        if response.status != 200:
            samples.errors += 1
            return
        async for line in response.content:
            if line.startswith(b"data: {"):
                received.append(time.time())
                last = line
    meta = proto.parse_native_event(last[6:].decode())
    if not isinstance(meta, proto.NativeChunk) or meta.meta.sim_chunk_due_unix_s is None:
        samples.errors += 1
        return
    due = meta.meta.sim_chunk_due_unix_s
    sent = meta.meta.sim_chunk_sent_unix_s or ()
    inside = [i for i, d in enumerate(due) if window[0] <= d <= window[1]]
    if inside:
        samples.requests += 1
    samples.lateness_ms.extend((sent[i] - due[i]) * 1e3 for i in inside)
    samples.client_ms.extend((received[i] - due[i]) * 1e3 for i in inside)
    samples.due_unix_s.extend(due[i] for i in inside)


async def drive(base: str, streams: int, seconds: float, warmup: float, max_new_tokens: int) -> Samples:
    samples = Samples()
    body = json.dumps(proto.generate_body(
        "def solve(data):", proto.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True), stream=True,
    )).encode()
    start = time.time()
    window = (start + warmup, start + warmup + seconds)
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def worker(i: int) -> None:
            await asyncio.sleep(i * 0.004)  # stagger arrivals instead of one thundering herd
            while not stop.is_set():
                await stream_once(session, f"{base}/generate", body, window, samples)

        workers = [asyncio.create_task(worker(i)) for i in range(streams)]
        await asyncio.sleep(warmup + seconds)
        stop.set()
        await asyncio.sleep(0)
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return samples


def percentiles(values: list[float]) -> tuple[float, float, float]:
    array = np.asarray(values)
    return float(np.percentile(array, 50)), float(np.percentile(array, 99)), float(array.max())


def rounds(samples: Samples) -> tuple[float, float]:
    """Chunks due at the same instant belong to one engine step: p99 lateness of each step's first chunk (how
    precisely the sim wakes) and the median cost per further chunk of a step (how fast it hands chunks over)."""
    steps: dict[float, list[float]] = {}
    for due, late in zip(samples.due_unix_s, samples.lateness_ms, strict=True):
        steps.setdefault(due, []).append(late)
    first = [min(lates) for lates in steps.values()]
    spread_us = [(max(g) - min(g)) / (len(g) - 1) * 1e3 for g in steps.values() if len(g) > 1]
    return float(np.percentile(first, 99)), float(np.median(spread_us)) if spread_us else 0.0


def run(args: argparse.Namespace, max_running: int) -> tuple[str, float]:
    argv = dfserve_argv("sim", "--host", LOOPBACK, "--port", "0", "--time-scale", "1", "--seed", "0",
                        "--record-chunk-times", "--max-running-requests", str(max_running))
    with serve(argv) as sim:
        process = sim.process
        if args.pin and (os.cpu_count() or 1) >= 2:
            os.sched_setaffinity(process.pid, {0})  # the sim alone on one core, as the target is stated
            os.sched_setaffinity(0, set(range(1, os.cpu_count() or 2)))
        cpu_before = cpu_seconds(process.pid)
        wall_before = time.monotonic()
        samples = uvloop.run(drive(sim.url, args.streams, args.seconds, args.warmup,
                                   args.max_new_tokens))
        cpu = (cpu_seconds(process.pid) - cpu_before) / (time.monotonic() - wall_before) * 100
    if not samples.lateness_ms:
        raise SystemExit(f"no chunk of a finished request was due inside the {args.seconds} s window; run longer")
    p50, p99, worst = percentiles(samples.lateness_ms)
    c50, c99, _ = percentiles(samples.client_ms)
    first99, per_chunk_us = rounds(samples)
    row = (f"| {args.streams} | {max_running} | {samples.requests} | {len(samples.lateness_ms)} | {p50:.2f} | "
           f"{p99:.2f} | {worst:.2f} | {first99:.2f} | {per_chunk_us:.0f} | {c50:.2f} | {c99:.2f} | {cpu:.0f}% | "
           f"{samples.errors} |")
    print(row, flush=True)
    return row, p99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window, after the warm-up")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-running", type=int, nargs="+", default=[48, 256],
                        help="one run per value of the sim's --max-running-requests")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="let the OS place the sim and the client (default: sim on CPU 0, client elsewhere)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    header = ("| streams | max running | requests | chunks | late p50 ms | p99 ms | max ms | step's first chunk p99 ms "
              "| µs per further chunk | client recv p50 ms | p99 ms | sim CPU (one core) | errors |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(header, flush=True)
    results = {n: run(args, n) for n in args.max_running}
    rows = [row for row, _ in results.values()]
    verdicts = "; ".join(f"{n} running: p99 {p99:.2f} ms, {'met' if p99 < 2 else 'NOT met'}"
                         for n, (_, p99) in results.items())
    command = " ".join(["flock /tmp/dfserve-bench.lock .venv/bin/python bench/sim_lateness.py", *sys.argv[1:]])
    body = f"""## Simulated engine: chunk lateness against its own schedule

`{command}` on {time.strftime('%Y-%m-%d')} ({platform.machine()}, {os.cpu_count()} cores, Python
{platform.python_version()}). The machine was shared with other work while this ran, so tails include noise from
other processes. Lateness = when the sim handed a chunk to the transport minus when its latency model scheduled it
(per chunk, from `--record-chunk-times`); "client recv" adds loopback and the benchmark client's own delay. Each
request streams {args.max_new_tokens} tokens (`ignore_eos`), closed loop, {args.warmup:.0f} s warm-up, {args.seconds:.0f} s measured;
chunks count when the model scheduled them inside the window. The sim runs pinned to CPU 0 and the client to the other cores
unless `--no-pin`. With 48 running, 208 streams wait in the queue (SGLang's DFlash default).
Target: p99 < 2 ms at {args.streams} streams. This run: {verdicts}.

{header}
{chr(10).join(rows)}

Reading the rows: a step's chunks are due at one instant and leave one after another, so a chunk's lateness is
about the step's wake error plus its place in the step times the per-chunk cost. With every stream running, a
step carries {args.streams} chunks, so its last one leaves about {args.streams} times the per-chunk cost late.
Every request here has the same prompt, so their acceptance draws match and requests admitted together finish in the
same step; with every stream running, the requests that replace them all arrive at once and are parsed on the
sim's one event loop (SGLang tokenizes in a separate process), which can make the next step wake late: that
row's max and first-chunk p99 (a percentile over about a hundred steps).
"""
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
