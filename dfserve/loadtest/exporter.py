"""Prometheus export of a load test: live on `--metrics-port` (127.0.0.1) while it runs, pushed at the end.

Families and names are `dfserve.metrics.DfserveMetrics`, the same the gateway exports, labelled by arm and each
record's route (`native`, `chat`, `completions`: a replayed capture sends several), and each record goes through the same `dfserve.metrics.observe` as a relayed request, so one
dashboard reads both and a series means the same from either. Warm-up requests are left out, as they are from the
summary, and so are requests the tester cancelled at its stop (Ctrl-C): the summary and the verdict count them as
neither answers nor errors of the arm, and in `dfserve_requests_total` they would read as failures (499).

A run's last requests finish after Prometheus's last scrape of it: a live exporter that stops with the run loses
them (a 15 s scrape, up to 15 s of requests). Where something scraped it during the run, it serves on at the end
until the next scrape has read the final figures (`linger`), for at most twice the interval seen between scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Metric, push_to_gateway, start_http_server
from prometheus_client.registry import Collector

from dfserve.errors import FieldError
from dfserve.loadtest import records as rec
from dfserve.loadtest.records import RequestRecord
from dfserve.metrics import Binned, DfserveMetrics, Outcome, observe

LOOPBACK = "127.0.0.1"
PUSH_JOB = "dfserve_loadtest"
LINGER_MAX_S = 60.0
"""The longest an exporter waits at the end for the next scrape (also where only one scrape was seen)."""


class _Scrapes(Collector):
    """A collector that exports nothing and notes when each scrape reads the registry."""

    def __init__(self) -> None:
        self.last_s: float | None = None
        self.interval_s: float | None = None

    def describe(self) -> Iterable[Metric]:
        return ()  # registering it reads nothing

    def collect(self) -> Iterable[Metric]:
        now = time.monotonic()
        if self.last_s is not None:
            self.interval_s = now - self.last_s
        self.last_s = now
        return ()


def outcome(r: RequestRecord, route: str) -> Outcome:
    """A request record as the per-request families see it (what the gateway's relay sees of the same request)."""
    exact = r.acceptance == "exact"
    return Outcome(
        arm=r.arm, route=route, replica="", status=r.error_code or r.http_status, error=r.error_kind,
        ttft_s=rec.ttft_s(r), e2e_s=rec.e2e_s(r),
        chunk_gaps=Binned.of(rec.itl_per_chunk_s(r)),
        token_gaps=Binned.of(rec.itl_per_token_s(r)) if r.chunk_tokens is not None else None,
        output_tokens=r.completion_tokens, verify_rounds=rec.verify_rounds(r) if exact else None,
        accept_length=rec.request_accept_length(r), measure=r.acceptance if r.acceptance != "unknown" else None,
    )


class Exporter:
    """`route` labels a record that does not carry its own (one written before records carried it)."""

    def __init__(self, route: str) -> None:
        self.registry = CollectorRegistry()
        self._scrapes = _Scrapes()
        self.registry.register(self._scrapes)  # first: a scrape's time is when it began reading the figures
        self.metrics = DfserveMetrics.build(self.registry)
        self.route = route
        self._server: WSGIServer | None = None

    def observe(self, r: RequestRecord) -> None:
        if not r.warmup and not r.cancelled:
            observe(self.metrics, outcome(r, r.route or self.route))

    def serve(self, port: int) -> str:
        """Serve `/metrics` on 127.0.0.1:`port` (0: a free port) in a thread; returns the URL it listens on."""
        try:
            server, _ = start_http_server(port, addr=LOOPBACK, registry=self.registry)
        except OSError as exc:
            raise FieldError("metrics_port", f"cannot listen on {LOOPBACK}:{port} ({exc.strerror})") from None
        self._server = server
        return f"http://{LOOPBACK}:{server.server_port}"

    def linger(self, say: Callable[[str], None]) -> None:
        """Serve until a scrape begun after this call has read the final figures, where something scraped during the
        run: for at most twice the interval between its last two scrapes, plus a second (`LINGER_MAX_S` at most).
        Ctrl-C stops the wait."""
        scrapes = self._scrapes
        if self._server is None or scrapes.last_s is None:
            return
        ended = time.monotonic()
        wait_s = min(LINGER_MAX_S, 2 * scrapes.interval_s + 1) if scrapes.interval_s is not None else LINGER_MAX_S
        try:  # from the line on: a Ctrl-C that follows it stops the wait, however soon
            say(f"dfserve loadtest metrics: serving the final figures until the next scrape (at most {wait_s:.0f} s; "
                "Ctrl-C stops waiting)")
            while (scrapes.last_s or 0) <= ended and time.monotonic() < ended + wait_s:
                time.sleep(0.05)
        except KeyboardInterrupt:
            say("dfserve loadtest metrics: stopped waiting for the next scrape")

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def push(self, url: str, run_id: str) -> None:
        try:
            push_to_gateway(url, job=PUSH_JOB, registry=self.registry, grouping_key={"run_id": run_id}, timeout=10)
        except OSError as exc:
            raise FieldError("pushgateway", f"push to {url} failed ({exc})") from None
