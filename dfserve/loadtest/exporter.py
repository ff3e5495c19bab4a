"""Prometheus export of a load test: live on `--metrics-port` (127.0.0.1) while it runs, pushed at the end.

Families and names are `dfserve.metrics.DfserveMetrics`, the same the gateway exports, labelled by arm, so one
dashboard reads both. Warm-up requests are left out, as they are from the summary.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, push_to_gateway, start_http_server

from dfserve.errors import UserError
from dfserve.loadtest import records as rec
from dfserve.loadtest.records import RequestRecord
from dfserve.metrics import DfserveMetrics

LOOPBACK = "127.0.0.1"
PUSH_JOB = "dfserve_loadtest"


class Exporter:
    def __init__(self, route: str) -> None:
        self.registry = CollectorRegistry()
        self.metrics = DfserveMetrics.build(self.registry)
        self.route = route
        self._server: WSGIServer | None = None

    def observe(self, r: RequestRecord) -> None:
        if r.warmup:
            return
        m, arm, route = self.metrics, r.arm, self.route
        m.finished(arm, route, "", r.http_status, r.error_kind).inc()
        if not r.ok:
            return
        ttft, e2e = rec.ttft_s(r), rec.e2e_s(r)
        if ttft is not None:
            m.ttft.labels(arm, route).observe(ttft)
        if e2e is not None:
            m.e2e.labels(arm, route).observe(e2e)
        per_token, per_chunk = m.itl_per_token.labels(arm, route), m.itl_per_chunk.labels(arm, route)
        for gap in rec.itl_per_token_s(r):
            per_token.observe(gap)
        for gap in rec.itl_per_chunk_s(r):
            per_chunk.observe(gap)
        m.output_tokens.labels(arm, route).inc(r.completion_tokens or 0)
        rounds, length = rec.verify_rounds(r), rec.request_accept_length(r)
        if rounds and r.acceptance == "exact":
            m.spec_verify_rounds.labels(arm, route).inc(rounds)
            m.spec_output_tokens.labels(arm, route).inc(r.completion_tokens or 0)
        if length is not None and r.acceptance != "unknown":
            m.accept_length.labels(arm, route, r.acceptance).observe(length)

    def serve(self, port: int) -> str:
        """Serve `/metrics` on 127.0.0.1:`port` (0: a free port) in a thread; returns the URL it listens on."""
        try:
            server, _ = start_http_server(port, addr=LOOPBACK, registry=self.registry)
        except OSError as exc:
            raise UserError(f"--metrics-port: cannot listen on {LOOPBACK}:{port} ({exc.strerror})") from None
        self._server = server
        return f"http://{LOOPBACK}:{server.server_port}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def push(self, url: str, run_id: str) -> None:
        try:
            push_to_gateway(url, job=PUSH_JOB, registry=self.registry, grouping_key={"run_id": run_id}, timeout=10)
        except OSError as exc:
            raise UserError(f"--pushgateway: push to {url} failed ({exc})") from None
