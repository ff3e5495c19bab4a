"""Benchmark: the load tester's own timing error and rate accuracy, measured against the simulated engine.

1. TTFT error at 128 concurrent streams (target: p99 < 1 ms with the tester on one core). The tester stamps
   `sent` immediately before writing the request to the socket and stamps each read as it arrives; the simulator,
   run with `--record-chunk-times`, reports when it really sent each chunk. Everything between the write and the
   simulator's first chunk is true TTFT, so measured - true = first chunk received - simulator sent it (loopback
   plus the tester's own delay). The same lateness is reported for every chunk, and, for information, the
   simulator's intake lag (when its engine took the request, its last due time minus its `e2e_latency`, minus
   the tester's write): that part belongs to the server, not to the tester. Clocks: one machine; the tester maps its
   perf_counter offsets to wall time through the run's `t0_unix_s`.
2. Open-loop rate at 200 req/s (target: achieved within 1% of requested), for constant and Poisson arrivals:
   achieved = (sent - 1) / (last send - first send); the schedule's own rate is shown beside it (a Poisson
   schedule's realised rate differs from the nominal one by chance, not by the tester), and send lateness
   (sent - scheduled) p50/p99.

The simulator and the tester are pinned to different cores with taskset when it exists.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/tester_timing.py

It prints its figures and replaces its own section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_section as _write  # noqa: E402
from dfserve.loadtest.records import RequestRecord, read_records  # noqa: E402
from tests.integration.servers import LOOPBACK, dfserve_argv, serve  # noqa: E402

SECTION = "loadtest_tester_timing"
PIN = shutil.which("taskset") is not None


def pinned(core: int, argv: list[str]) -> list[str]:
    return ["taskset", "-c", str(core), *argv] if PIN else argv


def tester(args: list[str]) -> tuple[float, float]:
    """Run `dfserve loadtest run` on core 1; returns (wall seconds, CPU seconds) of the tester process."""
    started = time.perf_counter()
    process = subprocess.Popen(pinned(1, dfserve_argv("loadtest", "run", "--quiet", *args)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"tester_timing: loadtest failed: {process.stderr.read().decode() if process.stderr else ''}")
    return wall, usage.ru_utime + usage.ru_stime


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def ttft_error(records: list[RequestRecord], t0_unix: float) -> dict[str, list[float]]:
    """Milliseconds: first-chunk lateness (the TTFT error), every chunk's lateness, the simulator's intake lag."""
    out: dict[str, list[float]] = {"ttft": [], "chunks": [], "intake": []}
    for r in records:
        if not r.ok or r.warmup or not r.sim_chunk_sent_unix_s or not r.sim_chunk_due_unix_s:
            continue
        assert r.sent_s is not None and r.first_token_s is not None and r.server_e2e_latency_s is not None
        out["ttft"].append((t0_unix + r.first_token_s - r.sim_chunk_sent_unix_s[0]) * 1e3)
        out["intake"].append((r.sim_chunk_due_unix_s[-1] - r.server_e2e_latency_s - t0_unix - r.sent_s) * 1e3)
        out["chunks"].extend((t0_unix + got - sent) * 1e3 for got, sent in zip(r.chunk_times_s, r.sim_chunk_sent_unix_s,
                                                                                 strict=False))
    return out


def run_ttft(work: Path, streams: int, requests: int, trial: int) -> str:
    argv = pinned(0, dfserve_argv("sim", "--host", LOOPBACK, "--port", "0", "--profile", "zlab", "--time-scale",
                                  "1", "--record-chunk-times", "--max-running-requests", str(streams)))
    with serve(argv) as sim:
        wall, cpu = tester(["--arm", f"zlab={sim.url}", "--concurrency", str(streams), "--num-requests",
                            str(requests), "--warmup", str(streams), "--max-new-tokens", "256", "--out", str(work),
                            "--name", f"ttft-{streams}-{trial}"])
    run = work / f"ttft-{streams}-{trial}"
    samples = ttft_error(list(read_records(run / "requests.jsonl")), json.loads((run / "config.json").read_text())["t0_unix_s"])
    ttft, chunks, intake = samples["ttft"], samples["chunks"], samples["intake"]
    row = (f"| {streams} | {trial} | {len(ttft)} | {pct(ttft, 50):.3f} | {pct(ttft, 99):.3f} | {max(ttft):.3f} | "
           f"{pct(chunks, 50):.3f} / {pct(chunks, 99):.3f} ({len(chunks)}) | "
           f"{pct(intake, 50):.3f} / {pct(intake, 99):.3f} | {cpu / wall:.0%} |")
    print(row, flush=True)
    return row


def run_rate(work: Path, rate: float, seconds: float, arrival: str) -> str:
    count = int(rate * seconds)
    argv = pinned(0, dfserve_argv("sim", "--host", LOOPBACK, "--port", "0", "--profile", "zlab", "--time-scale",
                                  "1", "--max-running-requests", "512"))
    with serve(argv) as sim:
        wall, cpu = tester(["--arm", f"zlab={sim.url}", "--rate", str(rate), "--arrival", arrival,
                            "--num-requests", str(count), "--warmup", "0", "--max-new-tokens", "16", "--out", str(work),
                            "--name", f"rate-{arrival}"])
    records = sorted(read_records(work / f"rate-{arrival}" / "requests.jsonl"), key=lambda r: r.index)
    sent = sorted(r.sent_s for r in records if r.sent_s is not None)
    scheduled = [r.scheduled_s or 0.0 for r in records]
    achieved = (len(sent) - 1) / (sent[-1] - sent[0])
    schedule_rate = (len(scheduled) - 1) / (scheduled[-1] - scheduled[0])
    late = [((r.sent_s or 0) - (r.scheduled_s or 0)) * 1e3 for r in records]
    errors = sum(not r.ok for r in records)
    row = (f"| {arrival} | {rate:.0f} | {len(sent)} | {schedule_rate:.2f} | {achieved:.2f} | "
           f"{(achieved / rate - 1) * 100:+.2f}% | {(achieved / schedule_rate - 1) * 100:+.3f}% | "
           f"{pct(late, 50):.3f} / {pct(late, 99):.3f} | {errors} | {cpu / wall:.0%} |")
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[128])
    parser.add_argument("--requests", type=int, default=1024, help="measured requests per TTFT run")
    parser.add_argument("--trials", type=int, default=1, help="TTFT runs per stream count (the tail varies run to run)")
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each open-loop run")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ttft_rows = [run_ttft(work, streams, args.requests, trial)
                     for streams in args.streams for trial in range(1, args.trials + 1)]
        rate_rows = [run_rate(work, args.rate, args.seconds, arrival) for arrival in ("constant", "poisson")]
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python bench/tester_timing.py " + " ".join(sys.argv[1:])
    body = "\n".join([
        "## Load tester: its own timing error and rate accuracy",
        "",
        f"`{command.strip()}` — {time.strftime('%Y-%m-%d', time.gmtime())}, {platform.machine()}, "
        f"{os.cpu_count()} cores shared with other work; simulator (zlab, time scale 1) "
        + ("on core 0, tester on core 1 (taskset)" if PIN else "unpinned")
        + ". Milliseconds. Targets: TTFT error p99 < 1 ms at 128 streams; achieved rate within 1% at 200 req/s.",
        "",
        "| streams | trial | requests | TTFT error p50 | TTFT error p99 | max | every chunk's lateness p50 / p99 (n) | "
        "simulator intake lag p50 / p99 (server's) | tester CPU |",
        "|---|---|---|---|---|---|---|---|---|",
        *ttft_rows,
        "",
        "| arrival | requested req/s | sent | schedule's own rate | achieved | vs requested | vs schedule | "
        "send lateness p50 / p99 | errors | tester CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rate_rows,
        "",
        "TTFT error = first chunk received by the tester - simulator sent it (the tester stamps its request "
        "just before the socket write, so nothing on the send side is its own). The lateness includes loopback and "
        "the simulator's socket write after its stamp, so it is an upper bound on the tester's share. Measured "
        "before this client replaced aiohttp on the hot path (same command and day, aiohttp 3.14.5 + uvloop, JSON "
        "parsed per chunk): TTFT error p50 0.29 / p99 3.97 ms, every chunk p50 2.96 / p99 13.2 ms at 128 streams: "
        "a verify round delivers every stream's chunk at once, and per-chunk task wake-ups and parsing queued them.",
        "",
        "Reading the rows: the tester's CPU column shows how busy its loop was; when the p99 at few streams is about "
        "the p99 at 128, the tail comes from the machine (other processes preempting the simulator between its "
        "stamp and its write, or the tester before its read), not from the tester's load.",
    ])
    if not args.no_write:
        _write(SECTION, body)


if __name__ == "__main__":
    main()
