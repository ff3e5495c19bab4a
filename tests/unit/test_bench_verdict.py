"""bench/gateway_overhead.py's verdict line: what it calls lower, level and not lower."""

from __future__ import annotations

import dataclasses

from bench.gateway_overhead import Row, verdict

NAN = float("nan")


def row(path: str, transport: tuple[float, float], gap_path_p99: float, spread: float, cpu: float | None,
        cpu_runs: tuple[float, ...] = ()) -> Row:
    return Row("native", path, 64, 100, 0, (NAN, NAN), (10.0, 12.0), transport, (1.0, 2.0), (0.0, gap_path_p99),
               (0.5, 2.0), cpu, 5000.0, 31.0, 0.2, spread, cpu_runs)


def test_a_p99_gap_is_lower_level_or_not_lower_against_the_runs_spread() -> None:
    direct = row("direct", (1.0, 5.0), 3.0, 0.3, None)
    router = row("sglang-router", (37.0, 45.0), 3.2, 0.3, 30.0, (30.0, 20.0, 40.0))
    gateway = row("gateway", (1.5, 5.5), 2.8, 0.2, 27.0, (27.0, 21.0, 32.0))
    line = verdict([direct, gateway, router])
    assert "native transport p99 +0.50 ms (< 2: met)" in line
    assert "native gap_path p99 -0.20 ms (< 1: met)" in line
    assert "native vs sglang-router: transport p50/p99 lower" in line
    assert "native vs sglang-router: gap_path p99 -0.40 ms, lower" in line
    assert "native CPU per chunk 0.90x sglang-router's (lower; run by run 0.80-1.05, lower in 2 of 3)" in line

    for p99, extra in ((3.45, "+0.25"), (2.95, "-0.25")):
        level = verdict([direct, dataclasses.replace(gateway, gap_path=(0.0, p99)), router])
        assert f"gap_path p99 {extra} ms, level (within the runs' spread, 0.30 ms)" in level
    worse = verdict([direct, dataclasses.replace(gateway, gap_path=(0.0, 3.6), transport=(40.0, 50.0),
                                                 cpu_us_per_chunk=31.0, cpu_us_per_chunk_runs=()), router])
    assert "gap_path p99 +0.40 ms, NOT lower" in worse
    assert "transport p50/p99 NOT lower" in worse and "1.03x sglang-router's (NOT lower)" in worse
