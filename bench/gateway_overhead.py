"""What the gateway adds to a stream, beside the SGLang router and a LiteLLM proxy, in one run on one simulator.

One simulated engine (dfserve's sim, latency set so that chunks come at a steady pace whatever the load) is reached
five ways: directly, through `dfserve gateway`, through `sglang-router`, through a LiteLLM proxy, and through
`tcp_floor_proxy.py`, which relays the bytes unparsed on the gateway's event loop: the floor for any proxy on
CPython and uvloop, so that what each proxy costs above it is its own work. A closed-loop
aiohttp + uvloop client streams native `/generate` and chat completions at 1, 64 and 256 concurrent streams through
each and records, per request, the time to the first chunk and the gaps between chunks; for native streams the
simulator's own send times split each figure into the engine's part and the path's. Added latency is each path's
percentile minus the direct path's; CPU per streamed chunk is the proxy's process-group CPU time over the chunks
the client received. The client and the simulator run on CPU 0 and each proxy on the other cores (`--no-pin` to
not), and each path's runs are interleaved with the others' and summed up by their median (`--repeats`). The
peers live in a git-ignored venv (bench/.peers), installed on first use.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/gateway_overhead.py --cpu-split

Writes its section of bench/RESULTS.md. Targets: p99 added TTFT < 2 ms and p99 added chunk gap < 1 ms at 64 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import math
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_section  # noqa: E402
from dfserve import sglang  # noqa: E402
from tests.integration.servers import serve  # noqa: E402

PEERS_VENV = ROOT / "bench" / ".peers"
PEER_PINS = ("sglang-router==0.3.2", "litellm[proxy]==1.108.7")
SECTION = "gateway_overhead"
LOOPBACK = "127.0.0.1"
LITELLM_KEY = "sk-dfserve-bench-local-only"

# The sim's latency for this benchmark: a 2 ms prefill step (a short prompt), then one chunk every 10 ms, at any
# load. Prefill steps hold up decoding (DFlash runs no mixed prefill), and with requests arriving one by one there
# is one almost every other step: a longer one would halve the chunks a proxy has to carry at a given concurrency.
PREFILL_S = 0.002
ROUND_S = 0.010
SIM_CONFIG = {
    "profile": "zlab", "seed": 0, "time_scale": 1.0, "max_running_requests": 1024, "record_chunk_times": True,
    "incremental_streaming_output": True,
    "latency": {"round_fixed_s": ROUND_S, "round_per_token_s": 0.0, "prefill_fixed_s": PREFILL_S,
                "prefill_per_token_s": 0.0, "jitter": 0.0},
}
SIM_SNIPPET = (
    "import json, sys\n"
    "from dfserve.deploy.sim.config import SimConfig\n"
    "from dfserve.deploy.sim.server import run\n"
    "run(SimConfig.model_validate(json.loads(sys.argv[1])))\n"
)


CONTENT = re.compile(rb'"content":\s*"[^"]')
NATIVE_EVENT = re.compile(rb"data: \{")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def ensure_peers() -> Path:
    """The peers' venv, created on first use; pinned so every run measures the same versions."""
    python = PEERS_VENV / "bin" / "python"
    marker = PEERS_VENV / ".installed"
    if not marker.exists() or marker.read_text() != "\n".join(PEER_PINS):
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PEER_PINS], check=True)
        marker.write_text("\n".join(PEER_PINS))
    return python


def pin_processes() -> str | None:
    """Put this client (and the sim it starts) on CPU 0 and return the other CPUs, for the proxy: each proxy then
    has cores of its own, as in a deployment, instead of being preempted by the client it wakes with every write
    (bench/RESULTS.md). None on a single-core machine."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    os.sched_setaffinity(0, {cpus[0]})
    return ",".join(str(cpu) for cpu in cpus[1:])


@contextmanager
def process(argv: Sequence[str], ready_url: str, log: Path, env: dict[str, str] | None = None,
            cpus: str | None = None) -> Iterator[int]:
    """Run `argv` (on `cpus`, every thread, if given) in its own process group until `ready_url` answers and the
    block ends; yields the group id (for its CPU time)."""
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    base, _, path = ready_url.partition("//")[2].partition("/")
    with serve(argv, log, "/" + path, timeout_s=120, env=env, url="http://" + base) as started:
        yield started.process.pid


def group_cpu_s(pgid: int) -> float:
    """CPU seconds run by every live process in a process group, threads that have ended included, read from each
    process's CPU-time clock (nanoseconds): user and system time in /proc/PID/stat come in whole clock ticks
    (10 ms), too coarse for runs that use a fraction of a second."""
    total_ns = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat[stat.rfind(")") + 2 :].split()[2]) == pgid:
                total_ns += time.clock_gettime_ns(process_cpu_clock(int(entry)))
        except (OSError, ValueError):
            continue  # a process that ended meanwhile
    return total_ns / 1e9


def loop_cpu_s(pid: int) -> float:
    """CPU seconds run by the main thread of process `pid` (the proxy's event loop; its other threads are its
    observers'), from the scheduler's own count in nanoseconds."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


def process_cpu_clock(pid: int) -> int:
    """Linux's clock id for another process's CPU time, scheduler-precise (`MAKE_PROCESS_CPUCLOCK(pid,
    CPUCLOCK_SCHED)` in the kernel's posix-timers.h)."""
    return (~pid << 3) | 2


@dataclass
class Sample:
    ttft_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    transport_s: list[float] = field(default_factory=list)
    delivery_s: list[float] = field(default_factory=list)
    gap_path_s: list[float] = field(default_factory=list)
    sim_late_s: list[float] = field(default_factory=list)
    chunks: int = 0
    errors: int = 0
    unattributed: int = 0
    elapsed_s: float = 0.0
    cpu_s: float | None = None
    loop_cpu_s: float | None = None
    """Of `cpu_s`, the proxy's event loop's (its main thread's)."""

    def absorb(self, other: Sample) -> None:
        """Pool another run's figures into these (the runs of one path are interleaved with the other paths')."""
        for name in ("ttft_s", "gaps_s", "transport_s", "delivery_s", "gap_path_s", "sim_late_s"):
            getattr(self, name).extend(getattr(other, name))
        self.chunks += other.chunks
        self.errors += other.errors
        self.unattributed += other.unattributed
        self.elapsed_s += other.elapsed_s
        if other.cpu_s is not None:
            self.cpu_s = (self.cpu_s or 0.0) + other.cpu_s
        if other.loop_cpu_s is not None:
            self.loop_cpu_s = (self.loop_cpu_s or 0.0) + other.loop_cpu_s


class Stream:
    """One streamed request as the client saw it: wall-clock send time and the arrival of each event."""

    def __init__(self) -> None:
        self.sent_unix = time.time()
        self.start = time.perf_counter()
        self.last: float | None = None
        self.buffer = b""
        self.event_arrivals: list[float] = []
        self.final = b""
        self.times = b""
        """The events that carried a simulated OpenAI stream's chunk times (an SSE comment at its end)."""

    def feed(self, data: bytes, sample: Sample, counter: re.Pattern[bytes]) -> None:
        now, wall = time.perf_counter(), time.time()
        self.buffer += data
        events, _, self.buffer = self.buffer.rpartition(b"\n\n")
        if sglang.SIM_TIMES_COMMENT in events:
            self.times = events
        produced = len(counter.findall(events))
        if produced <= 0:
            return
        self.event_arrivals.extend([wall] * produced)
        self.final = events[events.rfind(b"data: {") :].partition(b"\n\n")[0]
        sample.chunks += produced
        if self.last is None:
            sample.ttft_s.append(now - self.start)
        else:
            sample.gaps_s.append(now - self.last)
        self.last = now


def attribute(stream: Stream, sample: Sample, native: bool) -> bool:
    """Split a stream's latency into engine time and transport, from the simulator's own chunk records (the final
    native `meta_info`, or the comment an OpenAI stream ends with).

    The sim reports when it sent each chunk, when its model scheduled each chunk, and the request's queue time, so
    it received the request at `due[0] - prefill - queue_time`. Transport is then (receipt - client send) plus
    (first chunk's arrival - its send): all the time the path, not the engine, spent on the first token. A gap's
    path share is the client's gap minus the engine's gap between the same two chunks (the change in delivery
    time): what the path added to it, free of the engine's steps, which a prefill can stretch by a whole round.
    """
    if native:
        meta = sglang.parse_native_event(stream.final[6:].decode())
        if not isinstance(meta, sglang.NativeChunk):
            return False
        sent, due, queue_time_s = meta.meta.sim_chunk_sent_unix_s, meta.meta.sim_chunk_due_unix_s, meta.meta.queue_time_s
    else:
        times = sglang.parse_sim_times_comment(stream.times)
        if times is None:
            return False
        sent, due, queue_time_s = times.sent_unix_s, times.due_unix_s, times.queue_time_s
    if not sent or not due or queue_time_s is None or len(sent) != len(stream.event_arrivals):
        return False
    received = due[0] - PREFILL_S - queue_time_s
    sample.transport_s.append(received - stream.sent_unix + stream.event_arrivals[0] - sent[0])
    delivery = [a - s for a, s in zip(stream.event_arrivals, sent, strict=True)]
    sample.delivery_s.extend(delivery)
    sample.gap_path_s.extend(later - earlier for earlier, later in itertools.pairwise(delivery))
    sample.sim_late_s.extend(s - d for s, d in zip(sent, due, strict=False))
    return True


async def one_stream(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                     sample: Sample, native: bool) -> None:
    stream = Stream()
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                sample.errors += 1
                await response.read()
                return
            async for data in response.content.iter_any():
                stream.feed(data, sample, NATIVE_EVENT if native else CONTENT)
    except (aiohttp.ClientError, TimeoutError):
        sample.errors += 1
        return
    if not attribute(stream, sample, native):
        sample.unattributed += 1  # a path that re-encodes the stream (LiteLLM) drops the sim's times


def context_text(size: int) -> str:
    """About `size` bytes of Python source before each prompt, as a coding assistant sends the file it works in
    (this benchmark's own): a body of that size is what a capture writes and a shadow record hashes and reads."""
    source = Path(__file__).read_text()
    return (source * (size // len(source) + 1))[:size]


async def closed_loop(targets: Sequence[tuple[str, dict[str, str]]], concurrency: int, requests: int,
                      args: argparse.Namespace, native: bool) -> list[Sample]:
    """`concurrency` workers per target (URL and headers), all at once, each streaming one request after another
    until its target has had `requests` or time is up; one sample per target.

    Each worker pauses a random 0-10 ms (seeded) between requests, so arrivals do not lock onto the simulator's
    step clock: a closed loop would otherwise send each request right after a step and measure the phase of the
    engine's schedule rather than the path. Each request has a prompt of its own, as live traffic does: the sim
    seeds acceptance by prompt, and with one prompt for all, requests admitted together would finish together and
    come back as a crowd, every time.
    """
    sampling = sglang.SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)

    context = context_text(args.prompt_bytes)

    def body(n: int) -> bytes:
        if native:
            payload = sglang.generate_body(f"{context}def add_{n}(a, b):", sampling, stream=True)
        else:
            payload = sglang.chat_body("qwen", [{"role": "user", "content": f"{context}Write a function that adds "
                                                 f"({n})."}], sampling, stream=True)
        return json.dumps(payload).encode()

    samples = [Sample() for _ in targets]
    issued = [0] * len(targets)
    numbered = itertools.count()
    deadline = time.perf_counter() + args.budget_s
    rng = random.Random(concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        # Warm-up: open the connections and let every path settle, unmeasured.
        await asyncio.gather(*(one_stream(session, url, body(-1 - n), {"Content-Type": "application/json", **h},
                                          Sample(), native) for url, h in targets for n in range(concurrency)))

        async def worker(target: int) -> None:
            url, headers = targets[target][0], {"Content-Type": "application/json", **targets[target][1]}
            while issued[target] < requests and time.perf_counter() < deadline:
                issued[target] += 1
                request = body(next(numbered))
                await asyncio.sleep(rng.uniform(0, ROUND_S))
                await one_stream(session, url, request, headers, samples[target], native)

        started = time.perf_counter()
        await asyncio.gather(*(worker(t) for t in range(len(targets)) for _ in range(concurrency)))
    for sample in samples:
        sample.elapsed_s = time.perf_counter() - started
    return samples


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1e3 if values else float("nan")


@dataclass
class Row:
    api: str
    path: str
    concurrency: int
    requests: int
    errors: int
    ttft: tuple[float, float]
    gap: tuple[float, float]
    transport: tuple[float, float]
    delivery: tuple[float, float]
    gap_path: tuple[float, float]
    sim_late: tuple[float, float]
    cpu_us_per_chunk: float | None
    chunks_per_s: float
    chunks_per_request: float
    gap_p99_spread: float
    """Interquartile range of the runs' own p99 chunk gap: how far a p99 moves from run to run."""
    gap_path_p99_spread: float
    """The same for the gap on path."""
    cpu_us_per_chunk_runs: tuple[float, ...]
    """Each run's own, in run order: run i of every path was measured in the same round, one path after another."""


def before_dfserve(folder: Path) -> list[str]:
    """The command line of `dfserve` imported from `folder` (`--before`)."""
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(folder)!r}); from dfserve.cli import main; main()"]


def measure(api: str, targets: Sequence[tuple[str, dict[str, str], int | None]], concurrency: int,
            args: argparse.Namespace) -> list[Sample]:
    """One run through each of `targets` (URL, headers, the proxy's process group) at once; CPU per target."""
    requests = max(args.min_requests, concurrency * args.rounds)
    gc.collect()
    gc.disable()  # a full collection of this client's heap takes ~25 ms: one would show up as every path's latency
    try:
        cpu_before = [group_cpu_s(pgid) if pgid else 0.0 for _, _, pgid in targets]
        loop_before = [loop_cpu_s(pgid) if pgid else 0.0 for _, _, pgid in targets]
        samples = uvloop.run(closed_loop([(url, headers) for url, headers, _ in targets], concurrency, requests, args,
                                         api == "native"))
        for sample, before, (_, _, pgid) in zip(samples, cpu_before, targets, strict=True):
            sample.cpu_s = (group_cpu_s(pgid) - before) if pgid else None
        for sample, before, (_, _, pgid) in zip(samples, loop_before, targets, strict=True):
            sample.loop_cpu_s = (loop_cpu_s(pgid) - before) if pgid else None
    finally:
        gc.enable()
    return samples


def summarize(api: str, path: str, concurrency: int, runs: list[Sample]) -> Row:
    """One row from a path's runs: each percentile is the median of the runs' own, so that a stall of the shared
    host (tens of ms, now and then, on any path) moves one run's p99, not the row's; CPU and rate are pooled."""
    pooled = Sample()
    for run in runs:
        pooled.absorb(run)

    def p50_p99(name: str) -> tuple[float, float]:
        per_run = [(pct(getattr(run, name), 50), pct(getattr(run, name), 99)) for run in runs]
        return float(np.median([p50 for p50, _ in per_run])), float(np.median([p99 for _, p99 in per_run]))

    def p99_spread(name: str) -> float:
        p99s = [pct(getattr(run, name), 99) for run in runs]
        return float(np.subtract(*np.percentile(p99s, [75, 25])))

    cpu = pooled.cpu_s
    row = Row(api, path, concurrency, len(pooled.ttft_s), pooled.errors, p50_p99("ttft_s"), p50_p99("gaps_s"),
              p50_p99("transport_s"), p50_p99("delivery_s"), p50_p99("gap_path_s"), p50_p99("sim_late_s"),
              cpu / pooled.chunks * 1e6 if cpu is not None and pooled.chunks else None,
              pooled.chunks / pooled.elapsed_s if pooled.elapsed_s else 0.0,
              pooled.chunks / len(pooled.ttft_s) if pooled.ttft_s else 0.0, p99_spread("gaps_s"),
              p99_spread("gap_path_s"),
              tuple(run.cpu_s / run.chunks * 1e6 for run in runs if run.cpu_s is not None and run.chunks))
    loop_us = pooled.loop_cpu_s / pooled.chunks * 1e6 if pooled.loop_cpu_s is not None and pooled.chunks else 0.0
    print(f"{api:>6} {path:>14} x{concurrency:<4} n={row.requests:<5} err={row.errors:<3} "
          f"unattributed={pooled.unattributed:<5} "
          f"ttft {row.ttft[0]:7.2f} / {row.ttft[1]:7.2f} ms | gap {row.gap[0]:6.2f} / {row.gap[1]:6.2f} ms | "
          f"transport {row.transport[0]:6.2f} / {row.transport[1]:6.2f} | delivery {row.delivery[0]:6.2f} / "
          f"{row.delivery[1]:6.2f} | gap on path {row.gap_path[0]:5.2f} / {row.gap_path[1]:5.2f} | "
          f"cpu/chunk {row.cpu_us_per_chunk or 0:7.1f} us (loop {loop_us:5.1f}) | "
          f"{row.chunks_per_request:5.1f} chunks/request | "
          f"{row.chunks_per_s:7.0f}/s", flush=True)
    return row


def fmt(pair: tuple[float, float]) -> str:
    return "—" if math.isnan(pair[0]) else f"{pair[0]:.2f} / {pair[1]:.2f}"


def added(row: Row, direct: Row | None, name: str) -> str:
    if direct is None or row is direct:
        return "—"
    mine, base = getattr(row, name), getattr(direct, name)
    if math.isnan(mine[0]) or math.isnan(base[0]):
        return "—"
    return f"{mine[0] - base[0]:+.2f} / {mine[1] - base[1]:+.2f}"


def table(rows: list[Row], api: str) -> str:
    """One markdown table per API: what the client saw, then the exact attribution (— where a path drops it)."""
    rows = [r for r in rows if r.api == api]
    direct = {r.concurrency: r for r in rows if r.path == "direct"}
    head = ("| path | streams | requests | errors | TTFT p50 / p99 | added TTFT | chunk gap p50 / p99 | added gap "
            "| transport p50 / p99 | added transport | delivery p50 / p99 | added delivery "
            "| gap on path p50 / p99 | added gap on path | sim lateness | CPU per chunk (µs) | chunks/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        d = direct.get(r.concurrency)  # none when `--paths` leaves the direct connection out
        cells = [r.path, str(r.concurrency), str(r.requests), str(r.errors)]
        for name in ("ttft", "gap", "transport", "delivery", "gap_path"):
            cells += [fmt(getattr(r, name)), added(r, d, name)]
        cells += [fmt(r.sim_late), "—" if r.cpu_us_per_chunk is None else f"{r.cpu_us_per_chunk:.1f}",
                  f"{r.chunks_per_s:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(rows: list[Row], streams: int = 64) -> str:
    """The targets at `streams`, checked on this run's exact figures (transport and gap on path): p99 added TTFT
    < 2 ms, p99 added chunk gap < 1 ms, less added latency than each peer, and CPU per chunk beside each peer's.
    CPU per chunk is pooled over the runs, and each run is also set against the peer's run of the same round
    (measured next to it in time), so that a slow spell of the host shows as one odd pair. A p99 gap within either
    path's run-to-run spread of a peer's is called level: two proxies that both add next
    to nothing to a gap differ there by noise, whichever is lower in one run. LiteLLM drops the sim's
    comment, so it is compared on what its clients see, where its overhead is hundreds of times the step clock's
    noise."""
    def find(api: str, path: str) -> Row | None:
        return next((r for r in rows if (r.api, r.path, r.concurrency) == (api, path, streams)), None)

    checks = []
    for api in ("native", "chat"):
        direct, gateway = find(api, "direct"), find(api, "gateway")
        if direct is None or gateway is None:
            continue
        for name, limit in (("transport", 2.0), ("gap_path", 1.0)):
            extra = getattr(gateway, name)[1] - getattr(direct, name)[1]
            checks.append(f"{api} {name} p99 {extra:+.2f} ms (< {limit:g}: {'met' if extra < limit else 'NOT met'})")
        for peer in ("sglang-router", "litellm"):
            other = find(api, peer)
            if other is None:
                continue
            ttft_name, gap_name = ("ttft", "gap") if math.isnan(other.transport[0]) else ("transport", "gap_path")
            ttft_lower = (getattr(gateway, ttft_name)[0] <= getattr(other, ttft_name)[0]
                          and getattr(gateway, ttft_name)[1] <= getattr(other, ttft_name)[1])
            checks.append(f"{api} vs {peer}: {ttft_name} p50/p99 {'lower' if ttft_lower else 'NOT lower'}")
            # Gap p50 is left out: a saturated proxy delivers chunks in bunches, which shrinks it.
            extra = getattr(gateway, gap_name)[1] - getattr(other, gap_name)[1]
            noise = float(np.nanmax([getattr(gateway, f"{gap_name}_p99_spread"),
                                     getattr(other, f"{gap_name}_p99_spread")]))
            gap_verdict = ("lower" if extra < -noise else f"level (within the runs' spread, {noise:.2f} ms)"
                           if abs(extra) <= noise else "NOT lower")
            checks.append(f"{api} vs {peer}: {gap_name} p99 {extra:+.2f} ms, {gap_verdict}")
            if gateway.cpu_us_per_chunk is not None and other.cpu_us_per_chunk is not None:
                ratio = gateway.cpu_us_per_chunk / other.cpu_us_per_chunk
                paired = [mine / theirs for mine, theirs in zip(gateway.cpu_us_per_chunk_runs,
                                                                 other.cpu_us_per_chunk_runs, strict=False)]
                runs = (f"; run by run {min(paired):.2f}-{max(paired):.2f}, lower in {sum(r < 1 for r in paired)} "
                        f"of {len(paired)}") if paired else ""
                checks.append(f"{api} CPU per chunk {ratio:.2f}x {peer}'s ({'lower' if ratio < 1 else 'NOT lower'}"
                              f"{runs})")
    return f"Targets at {streams} streams, this run: " + "; ".join(checks) + "."


def behind(rows: list[Row], limit_ms: float = 5.0) -> list[str]:
    """A warning (and a blank line) naming the concurrencies where the simulator fell behind its schedule, so that
    their attribution is not to be read; none when it kept up everywhere."""
    late = sorted({r.concurrency for r in rows if r.sim_late[0] > limit_ms})
    if not late:
        return []
    return [f"At {', '.join(map(str, late))} streams the simulator fell behind its own schedule (sim lateness p50 "
            f"over {limit_ms:g} ms: it shares a core with the client), so those rows' transport, delivery and gap "
            "on path are not attributable: they show load, not the path.", ""]


@dataclass
class Cost:
    path: str
    per_request_us: float
    per_chunk_us: float
    chunks_per_request: tuple[float, float]


SPLIT_TOKENS = (64, 1024)
SPLIT_STREAMS = 32
SPLIT_ROUNDS = 6
SPLIT_BUDGET_S = 60.0


def cpu_split(endpoints: dict[str, tuple[str, dict[str, str], int | None]], args: argparse.Namespace) -> list[Cost]:
    """Each proxy's CPU time split into a cost per request and a cost per chunk: native streams of two lengths,
    `SPLIT_STREAMS` through every proxy at the same time, so that a slow spell of the shared host falls on all of
    them alike; then CPU = per_request x requests + per_chunk x chunks, solved from the two lengths."""
    pooled: dict[tuple[str, int], Sample] = {}
    paths = list(endpoints)
    for _ in range(args.repeats):
        for tokens in SPLIT_TOKENS:
            run_args = argparse.Namespace(**{**vars(args), "max_tokens": tokens, "rounds": SPLIT_ROUNDS,
                                              "min_requests": 0, "budget_s": SPLIT_BUDGET_S})
            targets = [(base + "/generate", headers, pgid) for base, headers, pgid in endpoints.values()]
            for path, sample in zip(paths, measure("native", targets, SPLIT_STREAMS, run_args), strict=True):
                pooled.setdefault((path, tokens), Sample()).absorb(sample)
    costs = []
    for path in paths:
        (short, long) = (pooled[path, tokens] for tokens in SPLIT_TOKENS)
        matrix = [[len(s.ttft_s), s.chunks] for s in (short, long)]
        per_request_s, per_chunk_s = np.linalg.solve(np.asarray(matrix, float), [short.cpu_s or 0, long.cpu_s or 0])
        costs.append(Cost(path, per_request_s * 1e6, per_chunk_s * 1e6,
                          (short.chunks / len(short.ttft_s), long.chunks / len(long.ttft_s))))
    return costs


def cost_at(costs: list[Cost], rows: list[Row], streams: int = 64) -> str:
    """Each proxy's CPU per chunk all in (its cost per request spread over the chunks) at the stream length of the
    native rows at `streams`, from the at-once split: the fair comparison, since CPU measured one path after another
    moves by a third between runs. Also where the gateway's total falls below the router's."""
    row = next((r for r in rows if (r.api, r.path, r.concurrency) == ("native", "gateway", streams)), None)
    if row is None or not row.chunks_per_request:
        return ""
    n = row.chunks_per_request
    totals = ", ".join(f"{c.path} {c.per_chunk_us + c.per_request_us / n:.1f} µs" for c in costs)
    line = f"At the stream length of the native rows at {streams} streams ({n:.0f} chunks per request), all in: {totals}."
    by_path = {c.path: c for c in costs}
    gateway, router = by_path.get("gateway"), by_path.get("sglang-router")
    if gateway is not None and router is not None and gateway.per_chunk_us < router.per_chunk_us:
        even = (gateway.per_request_us - router.per_request_us) / (router.per_chunk_us - gateway.per_chunk_us)
        line += (f" The gateway costs less than sglang-router for every stream longer than {max(even, 0):.0f} "
                 "chunks.")
    return line


def cost_table(costs: list[Cost]) -> str:
    if not costs:
        return ""
    lines = ["| proxy | CPU per request (µs) | CPU per chunk (µs) | chunks per request |", "|---|---|---|---|"]
    for c in costs:
        lines.append(f"| {c.path} | {c.per_request_us:.0f} | {c.per_chunk_us:.1f} | "
                     f"{c.chunks_per_request[0]:.1f} and {c.chunks_per_request[1]:.1f} |")
    return "\n".join(lines)


def write_results(rows: list[Row], command: str, versions: str, pinned: bool, repeats: int,
                  costs: list[Cost]) -> None:
    section = "\n".join([
        "## Gateway overhead (`bench/gateway_overhead.py`)",
        "",
        f"Command: `{command}`",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()}, {os.cpu_count()} cores "
        "(a VM whose host is shared, so run-to-run noise is large), loopback only. One simulated engine (zlab "
        f"profile, a {PREFILL_S * 1e3:g} ms prefill step, then a {ROUND_S * 1e3:g} ms verify round per chunk at any "
        "load, no jitter) served every "
        "path. The client (aiohttp + uvloop, closed loop, an unmeasured warm-up round, a random 0-10 ms pause "
        "between requests so arrivals do not lock onto the engine's step clock) and the simulator share CPU 0; "
        + ("each proxy runs alone on the other cores, as it would in a deployment (sharing a core with the client "
           "it wakes on every write, a proxy is preempted mid-burst and its tail shows the scheduler, not the "
           "proxy). " if pinned else "nothing is pinned (`--no-pin`). ")
        + f"Each path ran {repeats} times, its runs interleaved with the other paths' so that slow spells of the "
        "host fall on every path alike, and each percentile in a row is the median of its runs' own, so that one "
        "spell moves one run's p99, not the row's. Each request has a prompt of its own (the sim seeds acceptance "
        "by prompt; with one prompt, requests admitted together finish together and come back as a crowd) and the "
        "client collects no garbage during a run (a full collection of its heap takes ~25 ms). All times in ms; "
        "`added` = the path's p50 / p99 minus the direct connection's "
        "at the same concurrency. CPU per chunk is the proxy's process-group CPU time (each process's CPU-time "
        f"clock, in nanoseconds) over the chunks the client received. {versions}",
        "",
        "**Exact attribution.** The simulator records when it sent each chunk and when it received each request "
        "(`--record-chunk-times`: in a native stream's final `meta_info`, in an SSE comment at the end of an "
        "OpenAI stream), so *transport* = (engine receipt - client send) + (first chunk's arrival - its send): "
        "the part of TTFT spent on the path, free of the engine's schedule; *delivery* = each chunk's arrival - "
        "its send; *gap on path* = the client's gap between two chunks minus the engine's gap between sending "
        "them: the part of each chunk gap spent on the path. The raw TTFT and gap also carry the engine's "
        "schedule: a request waits up to a round for the next step, and a prefill step (DFlash runs no mixed "
        "prefill) stretches every running stream's gap by its length, so a raw p99 moves by several ms from run "
        "to run on the direct path alone and cannot resolve a 2 ms target; the targets are checked on transport "
        "and gap on path. The attribution holds while the simulator keeps to its model's schedule: *sim "
        "lateness* (chunk sent - chunk due) says how far it fell behind. sglang-router holds each stream's first "
        "chunk for about 40 ms.",
        "",
        "**Native `/generate`** (LiteLLM has no native route):",
        "",
        table(rows, "native"),
        "",
        "**OpenAI chat** (content chunks only; LiteLLM re-encodes the stream and drops the comment, so only what its "
        "clients see is shown for it):",
        "",
        table(rows, "chat"),
        "",
        *behind(rows),
        verdict(rows),
        *(["", f"**Where the CPU goes.** Native streams of {SPLIT_TOKENS[0]} and {SPLIT_TOKENS[1]} tokens, "
            f"{SPLIT_STREAMS} at a time through every proxy at once (so that the host's slow spells fall on all "
            "of them alike; run after run, the CPU figures of proxies measured one after the other moved by a "
            "third), each proxy's CPU time solved into a cost per request and a cost per chunk "
            f"(`--cpu-split`, {repeats} runs pooled). Every proxy makes the same system calls per chunk "
            "(strace: about as many reads and writes as the engine's sends, one epoll wait per burst). "
            "*tcp-floor* (`bench/tcp_floor_proxy.py`) relays the same bytes without parsing them, on the event loop the gateway runs on (CPython and uvloop): the least any "
            "proxy on that loop can cost, so each proxy's cost above it is its own work.", "", cost_table(costs),
            "", cost_at(costs, rows)]
          if costs else []),
    ])
    write_section(SECTION, section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,64,256", help="Comma-separated stream counts.")
    parser.add_argument("--paths", default="direct,gateway,sglang-router,litellm,tcp-floor")
    parser.add_argument("--rounds", type=int, default=6, help="Requests per stream slot in each run.")
    parser.add_argument("--repeats", type=int, default=5,
                        help="Runs per (path, API, concurrency), interleaved across the paths; rows give their median.")
    parser.add_argument("--min-requests", type=int, default=20, help="Requests per run at least (for 1 stream).")
    parser.add_argument("--budget-s", type=float, default=25.0, help="Time cap per run.")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-bytes", type=int, default=0,
                        help="Put this much source code before each prompt (a coding assistant's file context).")
    parser.add_argument("--no-write", action="store_true", help="Print only; leave RESULTS.md alone.")
    parser.add_argument("--cpu-split", action="store_true",
                        help="Also split each proxy's CPU into a cost per request and a cost per chunk.")
    parser.add_argument("--before", type=Path, default=None,
                        help="Also measure `dfserve gateway` imported from this folder (an export of an earlier "
                             "commit's dfserve/, its extension built in place): the path gateway-before beside "
                             "gateway, and gateway-recorded-before beside gateway-recorded.")
    parser.add_argument("--before-label", default="an earlier commit", help="What --before holds, for RESULTS.md.")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="Let the OS place every process (default: client and sim on CPU 0, the proxy on the rest).")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the servers it started are stopped too
    gc.collect()
    gc.freeze()  # start-up objects are never scanned again
    proxy_cpus = pin_processes() if args.pin else None
    paths = args.paths.split(",")
    if args.before:
        befores = [f"{path}-before" for path in ("gateway", "gateway-recorded") if path in paths]
        if not befores:
            parser.error("--before: measures gateway or gateway-recorded as it was; name one in --paths")
        paths = list(dict.fromkeys(paths + befores))
    levels = [int(c) for c in args.concurrency.split(",")]
    peer_python = ensure_peers() if {"sglang-router", "litellm"} & set(paths) else None
    logs = Path(tempfile.mkdtemp(prefix="dfserve-bench-"))
    rows: list[Row] = []
    with ExitStack() as stack:
        sim_port = free_port()
        sim_url = f"http://{LOOPBACK}:{sim_port}"
        stack.enter_context(process([sys.executable, "-c", SIM_SNIPPET, json.dumps({**SIM_CONFIG, "port": sim_port})],
                                    sim_url + "/health", logs / "sim.log"))
        endpoints: dict[str, tuple[str, dict[str, str], int | None]] = {"direct": (sim_url, {}, None)}
        if "gateway" in paths:
            port = free_port()
            argv = [str(ROOT / ".venv" / "bin" / "dfserve"), "gateway", "--host", LOOPBACK, "--port", str(port),
                    "--arm", f"a=1@{sim_url}", "--scrape-interval", "15"]
            pgid = stack.enter_context(process(argv, f"http://{LOOPBACK}:{port}/health", logs / "gateway.log",
                                               cpus=proxy_cpus))
            endpoints["gateway"] = (f"http://{LOOPBACK}:{port}", {}, pgid)
        for path in ("gateway-shadow", "gateway-recorded", "gateway-recorded-before"):
            if path in paths:
                # shadow mode mirroring every request to a second arm on the same engine; -recorded adds the
                # observers that write (capture and shadow records), so the two differ only by them
                port = free_port()
                dfserve = (before_dfserve(args.before) if path.endswith("-before")
                           else [str(ROOT / ".venv" / "bin" / "dfserve")])
                argv = [*dfserve, "gateway", "--host", LOOPBACK, "--port", str(port),
                        "--mode", "shadow", "--primary", "a", "--arm", f"a=1@{sim_url}", "--arm", f"b=1@{sim_url}",
                        "--scrape-interval", "15"]
                if path.startswith("gateway-recorded"):
                    argv += ["--record", str(logs / path / "shadow"), "--capture", str(logs / path / "capture")]
                pgid = stack.enter_context(process(argv, f"http://{LOOPBACK}:{port}/health", logs / f"{path}.log",
                                                   cpus=proxy_cpus))
                endpoints[path] = (f"http://{LOOPBACK}:{port}", {}, pgid)
        if "gateway-before" in paths:
            port = free_port()
            argv = [*before_dfserve(args.before), "gateway", "--host", LOOPBACK, "--port", str(port),
                    "--arm", f"a=1@{sim_url}", "--scrape-interval", "15"]
            pgid = stack.enter_context(process(argv, f"http://{LOOPBACK}:{port}/health", logs / "gateway-before.log",
                                               cpus=proxy_cpus))
            endpoints["gateway-before"] = (f"http://{LOOPBACK}:{port}", {}, pgid)
        if "tcp-floor" in paths:
            port = free_port()
            argv = [sys.executable, str(ROOT / "bench" / "tcp_floor_proxy.py"), str(port), str(sim_port)]
            pgid = stack.enter_context(process(argv, f"http://{LOOPBACK}:{port}/health", logs / "tcp-floor.log",
                                               cpus=proxy_cpus))
            endpoints["tcp-floor"] = (f"http://{LOOPBACK}:{port}", {}, pgid)
        if "sglang-router" in paths and peer_python:
            port = free_port()
            argv = [str(peer_python), "-m", "sglang_router.launch_router", "--host", LOOPBACK, "--port", str(port),
                    "--worker-urls", sim_url, "--policy", "round_robin",
                    # its metrics exporter would otherwise listen on 0.0.0.0:29000
                    "--prometheus-host", LOOPBACK, "--prometheus-port", str(free_port())]
            pgid = stack.enter_context(process(argv, f"http://{LOOPBACK}:{port}/health", logs / "router.log",
                                               cpus=proxy_cpus))
            endpoints["sglang-router"] = (f"http://{LOOPBACK}:{port}", {}, pgid)
        if "litellm" in paths and peer_python:
            port = free_port()
            config = logs / "litellm.yaml"
            config.write_text(json.dumps({
                "model_list": [{"model_name": "qwen", "litellm_params": {
                    "model": "openai/qwen", "api_base": sim_url + "/v1", "api_key": "none"}}],
                "litellm_settings": {"telemetry": False, "drop_params": True},
                "general_settings": {"master_key": LITELLM_KEY},
            }))
            argv = [str(peer_python.parent / "litellm"), "--config", str(config), "--host", LOOPBACK,
                    "--port", str(port), "--num_workers", "1"]
            env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
            pgid = stack.enter_context(process(argv, f"http://{LOOPBACK}:{port}/health/liveliness",
                                               logs / "litellm.log", env, cpus=proxy_cpus))
            endpoints["litellm"] = (f"http://{LOOPBACK}:{port}", {"Authorization": f"Bearer {LITELLM_KEY}"}, pgid)
        for concurrency in levels:
            runs: dict[tuple[str, str], list[Sample]] = {}
            for repeat in range(args.repeats):
                for api, route in (("native", "/generate"), ("chat", "/v1/chat/completions")):
                    for path in paths:
                        # LiteLLM speaks only the OpenAI routes.
                        if path in endpoints and not (api == "native" and path == "litellm"):
                            base, headers, group = endpoints[path]
                            [sample] = measure(api, [(base + route, headers, group)], concurrency, args)
                            print(f"  run {repeat + 1}/{args.repeats}: ", end="")
                            summarize(api, path, concurrency, [sample])
                            runs.setdefault((api, path), []).append(sample)
            print(f"median of {args.repeats} runs:")
            rows.extend(summarize(api, path, concurrency, samples) for (api, path), samples in runs.items())
        costs = []
        if args.cpu_split:
            proxies = [p for p in paths if p in endpoints and p not in ("direct", "litellm")]
            costs = cpu_split({p: endpoints[p] for p in proxies}, args)
    print(table(rows, "native"))
    print(table(rows, "chat"))
    print(cost_table(costs))
    print(cost_at(costs, rows))
    print(f"logs: {logs}")
    if not args.no_write:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        versions = (f"dfserve at commit {commit.stdout.strip() or 'unknown'}; peers " + ", ".join(PEER_PINS)
                    + f"; Python {platform.python_version()}.")
        if args.before:
            versions += (f" {', '.join(p for p in paths if p.endswith('-before'))}: `dfserve gateway` from "
                         f"{args.before_label}, measured in the same runs.")
        write_results(rows, "flock /tmp/dfserve-bench.lock .venv/bin/python bench/gateway_overhead.py "
                      + " ".join(sys.argv[1:]), versions, proxy_cpus is not None, args.repeats, costs)


if __name__ == "__main__":
    main()
