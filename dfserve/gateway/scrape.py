"""Per-arm acceptance over a window, from each replica's own SGLang counters.

Every `interval_s` the gateway reads `GET /metrics` of each replica and keeps `sglang:generation_tokens_total` and
`sglang:spec_verify_calls_total`. An arm's windowed acceptance length is Σ Δgeneration_tokens / Σ Δverify_calls over
its replicas within the window: exact (the engine counted every token and round), covering traffic from any
client, and free of warm-up, unlike `/server_info`'s running `avg_spec_accept_length`. A counter that goes down
means the replica restarted; its new value is the increase since the restart.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dfserve.metrics import SGLANG_GENERATION_TOKENS, SGLANG_SPEC_VERIFY_CALLS, DfserveMetrics


@dataclass(frozen=True)
class CounterSample:
    at: float
    generation_tokens: float
    verify_calls: float


def read_counters(text: str, at: float) -> CounterSample | None:
    """The two counters from a Prometheus exposition, summed over label sets; None if either is missing."""
    totals: dict[str, float] = {}
    wanted = {SGLANG_GENERATION_TOKENS + "_total", SGLANG_SPEC_VERIFY_CALLS + "_total"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    if len(totals) < len(wanted):
        return None
    return CounterSample(at, totals[SGLANG_GENERATION_TOKENS + "_total"], totals[SGLANG_SPEC_VERIFY_CALLS + "_total"])


def increase(values: Sequence[float]) -> float:
    """How much a counter grew across successive readings, counting through restarts (a drop starts from 0)."""
    grown = 0.0
    for previous, current in itertools.pairwise(values):
        grown += current - previous if current >= previous else current
    return grown


def windowed_accept_length(replicas: Iterable[Sequence[CounterSample]], now: float, window_s: float) -> float:
    """Σ Δgeneration_tokens / Σ Δverify_calls over each replica's readings in the window; NaN without rounds."""
    tokens = rounds = 0.0
    for samples in replicas:
        recent = [s for s in samples if s.at >= now - window_s]
        tokens += increase([s.generation_tokens for s in recent])
        rounds += increase([s.verify_calls for s in recent])
    return tokens / rounds if rounds > 0 else math.nan


class Scraper:
    """Reads every replica's counters periodically and publishes each arm's windowed acceptance length."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        replicas: Callable[[], Mapping[str, Sequence[str]]],
        metrics: DfserveMetrics,
        interval_s: float,
        window_s: float,
        timeout_s: float,
    ) -> None:
        self.http = http
        self.replicas = replicas
        self.metrics = metrics
        self.interval_s = interval_s
        self.window_s = window_s
        self.timeout_s = timeout_s
        self.samples: dict[str, deque[CounterSample]] = {}

    async def _scrape(self, url: str) -> None:
        try:
            response = await self.http.get(url + "/metrics", timeout=self.timeout_s)
            text = response.content.decode() if response.status_code == 200 else ""
        except (httpx.HTTPError, UnicodeDecodeError):
            return
        try:
            sample = read_counters(text, time.monotonic())
        except ValueError:
            return
        if sample is not None:
            history = self.samples.setdefault(url, deque())
            history.append(sample)
            while history and history[0].at < sample.at - self.window_s - self.interval_s:
                history.popleft()

    async def scrape_once(self) -> None:
        arms = self.replicas()
        await asyncio.gather(*(self._scrape(url) for urls in arms.values() for url in urls))
        now = time.monotonic()
        for arm, urls in arms.items():
            value = windowed_accept_length((self.samples.get(url, ()) for url in urls), now, self.window_s)
            self.metrics.arm_windowed_accept_length.labels(arm).set(value)

    async def run(self) -> None:
        """Scrape forever (cancel to stop)."""
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval_s)
