"""Arrival processes: when each request of a run is due. Pure and seeded, so every arm gets the identical schedule.

Closed loop keeps `concurrency` requests in flight and has no offsets (the next request leaves when one finishes);
open loop (Poisson or constant) fixes every request's offset from the start of the run in advance, optionally with a
concurrency cap whose waiting time the runner records; a trace replays a capture's recorded arrival offsets, scaled
by `speed`. How late each request of an open loop went out against its offset is the schedule's fidelity.

    load = LoadShape(kind="poisson", rate=20.0, seed=1)
    offsets = load.offsets(200)   # the same list for every arm
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from itertools import pairwise
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from dfserve.verdict.stats import quantile

ArrivalKind = Literal["closed", "poisson", "constant", "trace"]


class LoadShape(BaseModel):
    """Everything that shapes the load; recorded in config.json and compared by the judge."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: ArrivalKind = Field(description="closed loop, or open loop with Poisson, evenly spaced or captured "
                              "(trace) arrivals")
    concurrency: int | None = Field(None, validate_default=True,
                                    description="closed loop: requests in flight; open loop: optional cap")
    rate: float | None = Field(None, validate_default=True, allow_inf_nan=False,
                               description="open loop: requests per second")
    speed: float | None = Field(None, validate_default=True, allow_inf_nan=False,
                                description="trace: how many times faster than captured (2.0: twice)")
    seed: int = Field(0, description="seeds the Poisson gaps and the task order")
    trace_sha256: str | None = Field(None, description="trace: the hash of its arrival offsets (`trace_sha256`), "
                                     "set when the run is recorded; None in runs recorded before it was kept")

    @field_validator("concurrency")
    @classmethod
    def _check_concurrency(cls, concurrency: int | None, info: ValidationInfo) -> int | None:
        if info.data.get("kind") == "closed" and concurrency is None:
            raise ValueError("closed loop needs requests in flight (>= 1)")
        if concurrency is not None and concurrency < 1:
            raise ValueError("must be >= 1")
        return concurrency

    @field_validator("rate")
    @classmethod
    def _check_rate(cls, rate: float | None, info: ValidationInfo) -> float | None:
        kind = info.data.get("kind")
        if kind in ("closed", "trace"):
            if rate is not None:
                raise ValueError("closed loop takes none" if kind == "closed"
                                 else "trace arrivals take none (the capture's arrival times set it)")
        elif kind is not None and (rate is None or rate <= 0):
            raise ValueError(f"{kind} arrivals need > 0")
        return rate

    @field_validator("speed")
    @classmethod
    def _check_speed(cls, speed: float | None, info: ValidationInfo) -> float | None:
        if info.data.get("kind") == "trace":
            if speed is None or speed <= 0:
                raise ValueError("trace arrivals need > 0")
        elif speed is not None:
            raise ValueError("only with trace arrivals")
        return speed

    @field_validator("trace_sha256")
    @classmethod
    def _check_trace_sha256(cls, digest: str | None, info: ValidationInfo) -> str | None:
        if digest is not None and info.data.get("kind") != "trace":
            raise ValueError("only with trace arrivals")
        return digest

    def describe(self) -> str:
        """The load in words, as a report's reader wants it."""
        if self.kind == "closed":
            return f"closed loop, {self.concurrency} in flight per arm"
        if self.kind == "trace":
            cap = f", at most {self.concurrency} in flight" if self.concurrency is not None else ""
            return f"captured arrival times at {self.speed:g}x speed{cap}"
        arrivals = "Poisson" if self.kind == "poisson" else "evenly spaced"
        cap = f", at most {self.concurrency} in flight" if self.concurrency is not None else ""
        return f"{arrivals} arrivals at {self.rate:g} req/s per arm{cap}, seed {self.seed}"

    def offsets(self, count: int, trace_s: Sequence[float] = ()) -> list[float] | None:
        """Seconds from the start of the run at which request i is due; None for closed loop. A trace needs the
        captured arrival offsets (`trace_s`, one per request)."""
        if self.kind == "closed":
            return None
        if self.kind == "trace":
            assert self.speed is not None
            if len(trace_s) < count:
                raise ValueError(f"a trace of {count} requests needs as many arrival times, not {len(trace_s)}")
            return trace_offsets(trace_s[:count], self.speed)
        assert self.rate is not None
        if self.kind == "constant":
            return [i / self.rate for i in range(count)]
        return poisson_offsets(self.rate, count, random.Random(self.seed))


def poisson_offsets(rate: float, count: int, rng: random.Random) -> list[float]:
    """Poisson arrivals conditioned on the run's span: the first at 0, the last at (count - 1) / rate, the others
    uniform in between, sorted. Given how many arrivals fall in an interval, a Poisson process places them exactly
    so; conditioning makes the run's rate the requested one instead of drifting by chance (about 2% over 2,000
    arrivals), while the gaps stay exponential."""
    if count <= 1:
        return [0.0] * count
    span = (count - 1) / rate
    return [0.0, *sorted(rng.uniform(0.0, span) for _ in range(count - 2)), span]


def trace_offsets(arrivals_s: Sequence[float], speed: float) -> list[float]:
    """Captured arrival offsets as a run's: the first at 0, every gap divided by `speed`. Arrivals must be in
    order (a capture's are sorted by arrival when it is read)."""
    if any(later < earlier for earlier, later in pairwise(arrivals_s)):
        raise ValueError("trace arrival times are not in order")
    start = arrivals_s[0] if arrivals_s else 0.0
    return [(arrival - start) / speed for arrival in arrivals_s]


def trace_sha256(arrivals_s: Sequence[float]) -> str:
    """What identifies a trace's schedule: its arrival offsets from the first, to the microsecond (the same gaps from
    another start differ in their last bits), hashed. Two captures of the same requests at other times hold the
    same tasks, and replay other loads."""
    offsets_us = [round(offset_s * 1e6) for offset_s in trace_offsets(arrivals_s, 1.0)]
    return hashlib.sha256(json.dumps(offsets_us).encode()).hexdigest()


class ScheduleFidelity(BaseModel):
    """How late requests went out against their scheduled offsets (sent - scheduled, in ms; negative: early)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int
    late_p50_ms: float
    late_p99_ms: float
    late_max_ms: float

    def describe(self) -> str:
        return (f"sent late by p50 {self.late_p50_ms:.2f} ms, p99 {self.late_p99_ms:.2f} ms, "
                f"max {self.late_max_ms:.2f} ms (n={self.n})")


def schedule_fidelity(sends: Sequence[tuple[float, float]]) -> ScheduleFidelity | None:
    """The lateness of requests sent, from each one's (scheduled, actual) send time in seconds; None without any."""
    late_ms = [(sent - due) * 1e3 for due, sent in sends]
    p50, p99 = quantile(late_ms, 0.5), quantile(late_ms, 0.99)
    if p50 is None or p99 is None:
        return None
    return ScheduleFidelity(n=len(late_ms), late_p50_ms=p50, late_p99_ms=p99, late_max_ms=max(late_ms))
