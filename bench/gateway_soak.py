"""Soak: a slowloris flood beside normal streams, through one `dfserve gateway` in front of one simulated engine.

The same 64 closed-loop native streams run twice in one run: alone, then beside 1,000 slow connections that each
send a request head one byte at a time (a byte every `--dribble-s`) and, once the gateway cuts them off at its head
deadline (`limits.head_timeout_s`, 408), connect again at once, so that 1,000 stay open all along. The attack runs in
a process of its own, its connections' starts spread over one head deadline so that they are not all cut at once.
Normal clients must keep their latency (TTFT and chunk gap, the streams alone against the streams beside the flood),
and the gateway's descriptors must come back to where they were once the flood stops. The flood and the streams
after it run `--rounds` times. Resident memory alone cannot show a leak (Python's allocator and the C heap keep pages
they once used), so at each idle point the gateway, started through `bench/heap_probe.py`, also reports what it holds
live: its gc-tracked objects created since start-up and the blocks of Python's allocator, after a full collection,
then its resident memory once `malloc_trim(0)` has given back the C heap's free pages. A leak is live objects or
blocks growing round after round; `--tracemalloc` names the source lines whose allocations grew.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/gateway_soak.py

The engine is the sim with gateway_overhead.py's latency (a chunk every 10 ms at any load); the client, the sim and
the attack share CPU 0 and the gateway has the other cores (`--no-pin`: none pinned). Prints its figures and
replaces its own section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import SIM_CONFIG, SIM_SNIPPET  # noqa: E402
from bench.heap_probe import SNIPPET, ask, rss_mib  # noqa: E402
from bench.results import write_section  # noqa: E402
from dfserve import sglang  # noqa: E402
from dfserve.gateway.config import Limits, ScrapeConfig  # noqa: E402
from dfserve.listen import raise_open_files_limit  # noqa: E402
from tests.integration.servers import LOOPBACK, serve  # noqa: E402

SECTION = "gateway_soak"
HEAD_TIMEOUT_S = Limits().head_timeout_s
"""The gateway runs with its default limits; its head deadline paces the attack's reconnections."""
SLOW_HEAD = b"POST /generate HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
SLOW_LINE = b"X-Slow: a\r\n"


@dataclass
class Streams:
    """What the normal clients saw in one phase."""

    ttft_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    requests: int = 0
    errors: int = 0


@dataclass
class Gauge:
    """The gateway's open descriptors and resident memory, and the attack's open connections, sampled."""

    descriptors: list[int] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    slow_open: list[int] = field(default_factory=list)


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def one_stream(session: aiohttp.ClientSession, url: str, body: bytes, streams: Streams) -> None:
    start = last = time.perf_counter()
    first = True
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            if response.status != 200:
                streams.errors += 1
                await response.read()
                return
            async for data in response.content.iter_any():
                if b"data: {" not in data:
                    continue
                now = time.perf_counter()
                (streams.ttft_s if first else streams.gaps_s).append(now - (start if first else last))
                first, last = False, now
    except (aiohttp.ClientError, TimeoutError):
        streams.errors += 1
        return
    streams.requests += 1


async def run_streams(url: str, concurrency: int, seconds: float, max_tokens: int,
                      sample: Callable[[], None] | None = None) -> Streams:
    """`concurrency` closed-loop workers for `seconds` (after an unmeasured warm-up request each); `sample` is called
    once a second meanwhile."""
    sampling = sglang.SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    numbered = itertools.count()

    def body() -> bytes:  # a prompt of its own per request: the sim seeds acceptance by prompt
        return json.dumps(sglang.generate_body(f"def add_{next(numbered)}(a, b):", sampling, stream=True)).encode()

    measured = Streams()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(one_stream(session, url, body(), Streams()) for _ in range(concurrency)))
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                await one_stream(session, url, body(), measured)

        async def sampler() -> None:
            while sample is not None and time.perf_counter() < deadline:
                sample()
                await asyncio.sleep(1.0)

        await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
    return measured


@dataclass
class Attack:
    """What the slow connections met, from the attacking process."""

    opened: int = 0
    timed_out: int = 0
    """Answered 408 by the gateway's head deadline."""
    closed_silently: int = 0
    refused: int = 0
    """Answered 503: past `max_connections`."""
    reset: int = 0
    connect_failed: int = 0
    lifetimes_s: list[float] = field(default_factory=list)


async def slow_connection(host: str, port: int, delay_s: float, gap_s: float, stop_at: float,
                          attack: Attack, open_now: Synchronized[int]) -> None:
    await asyncio.sleep(delay_s)
    while time.monotonic() < stop_at:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            attack.connect_failed += 1
            await asyncio.sleep(gap_s)
            continue
        attack.opened += 1
        open_now.value += 1
        opened = time.monotonic()
        answer = asyncio.ensure_future(reader.read(64))
        try:
            writer.write(SLOW_HEAD)
            for byte in itertools.cycle(SLOW_LINE):
                done, _ = await asyncio.wait({answer}, timeout=gap_s)
                if done or time.monotonic() >= stop_at:
                    break
                writer.write(bytes([byte]))
            first = await answer if answer.done() else None
        except ConnectionError:
            first = None
            attack.reset += 1
        finally:
            answer.cancel()
            writer.close()
            open_now.value -= 1
        if first is not None:
            attack.lifetimes_s.append(time.monotonic() - opened)
            if first.startswith(b"HTTP/1.1 408"):
                attack.timed_out += 1
            elif first.startswith(b"HTTP/1.1 503"):
                attack.refused += 1
            elif not first:
                attack.closed_silently += 1


def attacker(url: str, connections: int, gap_s: float, seconds: float, open_now: Synchronized[int],
             report: multiprocessing.Queue[Attack]) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    attack = Attack()
    stop_at = time.monotonic() + seconds

    async def main() -> None:
        spread_s = HEAD_TIMEOUT_S / connections
        await asyncio.gather(*(slow_connection(host, int(port), i * spread_s, gap_s, stop_at, attack, open_now)
                               for i in range(connections)))

    uvloop.run(main())
    report.put(attack)


@dataclass
class Idle:
    """The gateway at rest: its descriptors, and its memory as `heap_probe.ask` reports it."""

    descriptors: int
    memory: dict[str, Any]


def idle(pid: int, probe: Path) -> Idle:
    return Idle(descriptors(pid), ask(pid, probe))


@dataclass
class Round:
    """One flood: the streams beside it and after it, the gateway gauged meanwhile, and its idle figures after."""

    beside: Streams
    gauge: Gauge
    attack: Attack
    settled_s: float
    after: Streams
    idle: Idle


def flood_round(gateway_url: str, pid: int, probe: Path, idle_descriptors: int, args: argparse.Namespace) -> Round:
    """`--slow` slow connections kept open, the streams measured beside them once all are, then the streams alone."""
    url = gateway_url + "/generate"
    open_now: Synchronized[int] = multiprocessing.Value("i", 0)
    report: multiprocessing.Queue[Attack] = multiprocessing.Queue()
    ramp_s = HEAD_TIMEOUT_S + 2
    flood = multiprocessing.get_context("fork").Process(
        target=attacker, args=(gateway_url, args.slow, args.dribble_s, ramp_s + args.seconds + 5, open_now, report))
    flood.start()
    time.sleep(ramp_s)
    gauge = Gauge()

    def sample() -> None:
        gauge.descriptors.append(descriptors(pid))
        gauge.rss_mib.append(rss_mib(pid))
        gauge.slow_open.append(open_now.value)

    beside = uvloop.run(run_streams(url, args.streams, args.seconds, args.max_tokens, sample))
    attack = report.get(timeout=60)
    flood.join(30)
    settled_s = settle(pid, idle_descriptors)
    after = uvloop.run(run_streams(url, args.streams, args.after_seconds, args.max_tokens))
    time.sleep(1.0)
    return Round(beside, gauge, attack, settled_s, after, idle(pid, probe))


def settle(pid: int, baseline: int, timeout_s: float = 30.0) -> float:
    """Seconds until the gateway's descriptors are back at `baseline` or fewer (at most `timeout_s`)."""
    start = time.monotonic()
    while descriptors(pid) > baseline and time.monotonic() - start < timeout_s:
        time.sleep(0.1)
    return time.monotonic() - start


def ms(values: list[float], q: float) -> float:
    """NaN for a phase in which no stream got an event (its errors column says why): the other figures still print."""
    return float(np.percentile(np.asarray(values), q)) * 1e3 if values else float("nan")


def row(name: str, s: Streams) -> str:
    return (f"| {name} | {s.requests} | {s.errors} | {ms(s.ttft_s, 50):.2f} / {ms(s.ttft_s, 99):.2f} | "
            f"{ms(s.gaps_s, 50):.2f} / {ms(s.gaps_s, 99):.2f} |")


def idle_row(name: str, at: Idle) -> str:
    memory = at.memory
    return (f"| {name} | {at.descriptors} | {memory['rss_mib']:.1f} | {memory['gc_objects']} | "
            f"{memory['allocated_blocks']} | {memory['trimmed_rss_mib']:.1f} |")


def grown_types(before: Idle, after: Idle, count: int = 6) -> str:
    """The types whose live objects changed most in number between two idle points."""
    old, new = before.memory["types"], after.memory["types"]
    change = {name: new.get(name, 0) - old.get(name, 0) for name in old.keys() | new.keys()}
    moved = sorted((item for item in change.items() if item[1]), key=lambda item: -abs(item[1]))[:count]
    return ", ".join(f"{name} {delta:+d}" for name, delta in moved) or "none"


def memory_reading(before: Idle, rounds: list[Round]) -> str:
    """The idle points read for a leak: the first round's rise (pools, tables and arenas sized to the flood), then
    what each later round added."""
    if not rounds:
        return ""
    first, last = rounds[0].idle, rounds[-1].idle
    text = (f"Memory: the first round raised the idle gateway's resident memory "
            f"{first.memory['rss_mib'] - before.memory['rss_mib']:+.1f} MiB and its live objects "
            f"{first.memory['gc_objects'] - before.memory['gc_objects']:+d} ({grown_types(before, first)}).")
    if len(rounds) > 1:
        later = len(rounds) - 1
        change = {key: last.memory[key] - first.memory[key]
                  for key in ("rss_mib", "trimmed_rss_mib", "gc_objects", "allocated_blocks")}
        opened = sum(done.attack.opened for done in rounds[1:])
        grown = grown_types(first, last)
        text += (f" The {later} round{'s' if later > 1 else ''} after it, opening {opened} slow connections in all, "
                 f"added: resident memory {change['rss_mib']:+.1f} MiB ({change['trimmed_rss_mib']:+.1f} MiB after "
                 f"malloc_trim), live objects {change['gc_objects']:+d} ({grown}), allocated blocks {change['allocated_blocks']:+d}; per 1,000 "
                 f"connections, {change['gc_objects'] * 1000 / opened:+.1f} objects and "
                 f"{change['allocated_blocks'] * 1000 / opened:+.1f} blocks.")
        if "CounterSample" in grown:
            scrape = ScrapeConfig()
            text += (f" `CounterSample` is the gateway's scrape window, bounded: a reading per replica every "
                     f"{scrape.interval_s:g} s, kept {scrape.window_s:g} s.")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", type=int, default=1000, help="Slow connections held open during the attack.")
    parser.add_argument("--streams", type=int, default=64, help="Normal streams, in both phases.")
    parser.add_argument("--seconds", type=float, default=60.0, help="Measured time of each phase.")
    parser.add_argument("--after-seconds", type=float, default=20.0, help="Measured time of the streams after it.")
    parser.add_argument("--rounds", type=int, default=2, help="Floods, each followed by the streams alone.")
    parser.add_argument("--dribble-s", type=float, default=1.0, help="Seconds between a slow connection's bytes.")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--no-write", action="store_true", help="Print only; leave RESULTS.md alone.")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="Trace the gateway's allocations and print the lines that grew; slows the gateway, so its "
                             "latency figures mean little. Implies --no-write.")
    args = parser.parse_args()
    args.no_write = args.no_write or args.tracemalloc
    wanted = args.slow + args.streams + 256
    if raise_open_files_limit(wanted) < wanted:
        raise SystemExit(f"--slow {args.slow}: needs {wanted} open descriptors, more than `ulimit -Hn` allows")
    gc.collect()
    gc.freeze()
    cpus = sorted(os.sched_getaffinity(0))
    gateway_cpus = ",".join(map(str, cpus[1:])) if args.pin and len(cpus) > 1 else None
    if gateway_cpus is not None:
        os.sched_setaffinity(0, {cpus[0]})
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(serve([sys.executable, "-c", SIM_SNIPPET, json.dumps({**SIM_CONFIG, "port": 0})]))
        probe = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dfserve-soak-"))) / "memory.json"
        argv = [sys.executable, "-c", SNIPPET, str(probe), "gateway", "--host", LOOPBACK, "--port", "0",
                "--arm", f"a=1@{sim.url}"]
        gateway = stack.enter_context(serve(["taskset", "-c", gateway_cpus, *argv] if gateway_cpus else argv,
                                            env={"PYTHONTRACEMALLOC": "1"} if args.tracemalloc else None))
        pid, url = gateway.process.pid, gateway.url + "/generate"

        uvloop.run(run_streams(url, args.streams, 5.0, args.max_tokens))  # warm-up: imports, pools, caches
        alone = uvloop.run(run_streams(url, args.streams, args.seconds, args.max_tokens))
        time.sleep(1.0)  # the streams' connections closed; the gateway's upstream pool stays, as it will after
        idle_before = idle(pid, probe)

        rounds = [flood_round(gateway.url, pid, probe, idle_before.descriptors, args) for _ in range(args.rounds)]
        metrics = httpx.get(gateway.url + "/metrics", trust_env=False).text
    counted = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("dfserve_client_connections_refused_total{")}

    header = "| normal streams | requests | errors | TTFT p50 / p99 ms | chunk gap p50 / p99 ms |\n|---|---|---|---|---|"
    rows = [row(f"{args.streams} alone", alone)]
    resources = ["| gateway | open descriptors | resident memory MiB | live objects | allocated blocks | "
                 "resident after malloc_trim MiB |", "|---|---|---|---|---|---|",
                 idle_row("idle, before the attack", idle_before)]
    attack_lines = []
    for number, done in enumerate(rounds, 1):
        beside, gauge, attack = done.beside, done.gauge, done.attack
        rows += [row(f"{args.streams} beside {args.slow} slow connections, round {number}", beside),
                 f"| change from alone | | | {ms(beside.ttft_s, 50) - ms(alone.ttft_s, 50):+.2f} / "
                 f"{ms(beside.ttft_s, 99) - ms(alone.ttft_s, 99):+.2f} | "
                 f"{ms(beside.gaps_s, 50) - ms(alone.gaps_s, 50):+.2f} / {ms(beside.gaps_s, 99) - ms(alone.gaps_s, 99):+.2f} |",
                 row(f"{args.streams} alone again, after round {number}", done.after)]
        resources += [f"| during round {number}, median / max | {int(np.median(gauge.descriptors))} / "
                      f"{max(gauge.descriptors)} | {np.median(gauge.rss_mib):.1f} / {max(gauge.rss_mib):.1f} | | | |",
                      idle_row(f"idle, after round {number} and the streams alone again", done.idle)]
        lifetimes = np.asarray(attack.lifetimes_s or [float("nan")])
        attack_lines.append(
            f"Round {number}: slow connections open at once during the measured window: median "
            f"{int(np.median(gauge.slow_open))}, min {min(gauge.slow_open)}. The attacker opened {attack.opened}; the "
            f"gateway answered {attack.timed_out} of them 408 at the head deadline (held p50 "
            f"{np.median(lifetimes):.1f} s, max {lifetimes.max():.1f} s; `head_timeout_s` {HEAD_TIMEOUT_S:g}), closed "
            f"{attack.closed_silently} without an answer, refused {attack.refused} with 503, reset {attack.reset}; "
            f"{attack.connect_failed} connects failed. When it stopped, the gateway's descriptors were back at the idle "
            f"count in {done.settled_s:.1f} s.")
    attack_lines.append(
        f"Over all rounds the gateway counted head_timeout {counted.get('head_timeout', 0):.0f}, body_timeout "
        f"{counted.get('body_timeout', 0):.0f}, over_capacity {counted.get('over_capacity', 0):.0f}.")
    attack_line = " ".join(attack_lines)
    memory_line = memory_reading(idle_before, rounds)
    for number, at in enumerate([idle_before, *(done.idle for done in rounds)]):
        if "traced_mib" in at.memory:
            print(f"idle point {number}: traced {at.memory['traced_mib']:.2f} MiB; grown since idle point 0:",
                  *at.memory["grown"], sep="\n  ")
    resources_table = "\n".join(resources)
    for block in (header, *rows, "", resources_table, "", attack_line, "", memory_line):
        print(block, flush=True)
    if args.no_write:
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    command = " ".join(["flock /tmp/dfserve-bench.lock .venv/bin/python bench/gateway_soak.py", *sys.argv[1:]])
    write_section(SECTION, "\n".join([
        "## Gateway soak: slow clients beside normal streams (`bench/gateway_soak.py`)", "",
        f"`{command}` on {time.strftime('%Y-%m-%d')}, dfserve at commit {commit.stdout.strip() or 'unknown'} "
        f"({platform.machine()}, {os.cpu_count()} cores shared with other work, Python {platform.python_version()}, "
        "loopback). One gateway with its default limits in front of one simulated engine (a chunk every 10 ms, "
        f"{args.max_tokens}-token native streams). The same {args.streams} closed-loop streams ran {args.seconds:g} s "
        f"alone, then {args.seconds:g} s beside {args.slow} connections, each sending a request head a byte every "
        f"{args.dribble_s:g} s and connecting again as soon as the gateway cut it off, so that {args.slow} were open "
        "all along (their starts spread over one head deadline, and the streams measured once all were open), then "
        f"{args.after_seconds:g} s alone again; the flood and the streams after it ran {args.rounds} times. The idle "
        "figures are taken a second after the streams stopped, with the gateway's upstream connections still pooled "
        "each time: its resident memory as found, then, after a full collection, its live gc-tracked objects created "
        "since start-up and the blocks Python's allocator holds (`bench/heap_probe.py`, asked by signal), then its "
        "resident memory once `malloc_trim(0)` has handed the C heap's free pages back (so the next round starts from "
        "there). A leak is live objects or blocks that grow with the connections cut off, round after round; resident "
        "memory that rises in the first round and then stays is the high-water of the allocator's arenas and of sets "
        "and free lists sized to the flood. "
        + ("Client, engine and attack on CPU 0, the gateway on the other cores. " if gateway_cpus else "Nothing "
           "pinned. ") + "Client-side times: TTFT to the first event, chunk gap between events.", "",
        header, *rows, "", resources_table, "", attack_line, "", memory_line,
    ]))


if __name__ == "__main__":
    main()
