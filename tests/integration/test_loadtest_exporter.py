"""Live Prometheus export of a load test: dfserve.metrics names, per arm, warm-up left out, served on loopback."""

from __future__ import annotations

import http.server
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import Metric

from dfserve import metrics
from dfserve.errors import FieldError
from dfserve.loadtest.exporter import Exporter
from tests.integration.servers import dfserve_argv, refusing_port, sim_server, url_of
from tests.synthetic import synthetic


def test_records_become_per_arm_families_and_are_served_on_loopback() -> None:
    exporter = Exporter(route="/generate")
    records = synthetic("zlab", 5, 8.0, seed=1, tokens=32) + synthetic("inhouse", 5, 8.0, seed=1, tokens=32, errors=1.0)
    records.append(records[0].model_copy(update={"warmup": True, "index": 99}))
    for r in records:
        exporter.observe(r)
    sample = exporter.registry.get_sample_value
    labels = {"arm": "zlab", "route": "/generate"}
    assert sample(f"{metrics.REQUESTS}_total", {**labels, "replica": "", "status": "2xx", "error": ""}) == 5
    assert sample(f"{metrics.REQUESTS}_total", {"arm": "inhouse", "route": "/generate", "replica": "",
                                                "status": "5xx", "error": "http_status"}) == 5
    assert sample(f"{metrics.OUTPUT_TOKENS}_total", labels) == 5 * 32
    assert sample(f"{metrics.TTFT}_count", labels) == 5
    assert sample(f"{metrics.ITL_PER_TOKEN}_count", labels) == 5 * 31
    assert sample(f"{metrics.ACCEPT_LENGTH}_count", {**labels, "measure": "exact"}) == 5
    url = exporter.serve(0)
    try:
        body = httpx.get(f"{url}/metrics").text
        assert f'{metrics.SPEC_VERIFY_ROUNDS}_total{{arm="zlab",route="/generate"}}' in body
        with pytest.raises(FieldError, match=r"^metrics_port: cannot listen on 127\.0\.0\.1:"):
            Exporter(route="/generate").serve(int(url.rsplit(":", 1)[1]))
    finally:
        exporter.close()


def test_pooled_acceptance_counts_the_tokens_of_exact_requests_only() -> None:
    """Streamed chat (estimated acceptance, no verify rounds) mixed with exact requests: the pooled figure's
    numerator must leave its tokens out, or Σ tokens / Σ rounds reads too high."""
    exporter = Exporter(route="chat")
    exact = synthetic("zlab", 4, 8.0, seed=1, tokens=32)
    estimated = [r.model_copy(update={"index": r.index + 4, "acceptance": "estimated", "spec_verify_ct": None,
                                      "chunk_tokens": None, "chunk_times_s": r.chunk_times_s[::4]}) for r in exact]
    for r in exact + estimated:
        exporter.observe(r)
    sample = exporter.registry.get_sample_value
    labels = {"arm": "zlab", "route": "chat"}
    rounds = sum(r.spec_verify_ct or 0 for r in exact)
    assert sample(f"{metrics.SPEC_VERIFY_ROUNDS}_total", labels) == rounds
    assert sample(f"{metrics.SPEC_OUTPUT_TOKENS}_total", labels) == 4 * 32
    assert sample(f"{metrics.OUTPUT_TOKENS}_total", labels) == 8 * 32
    assert sample(f"{metrics.ACCEPT_LENGTH}_count", {**labels, "measure": "estimated"}) == 4


def test_failures_are_labelled_like_the_gateway_labels_them() -> None:
    exporter = Exporter(route="native")
    ok = synthetic("zlab", 1, 8.0, seed=1, tokens=8)[0]
    failures = [
        ok.model_copy(update={"error_kind": "connect", "http_status": None}),
        ok.model_copy(update={"error_kind": "disconnect"}),
        ok.model_copy(update={"error_kind": "http_status", "http_status": 429}),
    ]
    for r in failures:
        exporter.observe(r)
    found = {(s.labels["status"], s.labels["error"]) for family in exporter.registry.collect()
             if family.name == metrics.REQUESTS for s in family.samples if s.name.endswith("_total")}
    assert found == {("error", "connect"), ("error", "disconnect"), ("4xx", "http_status")}


def test_requests_the_tester_cancelled_are_not_exported() -> None:
    """Cancelled at the tester's stop: no answer and no error of the arm, as the summary and the verdict count
    them; exported as 499 they would raise the dashboards' error rate."""
    exporter = Exporter(route="native")
    records = synthetic("zlab", 4, 8.0, seed=1, tokens=8)
    records[3] = records[3].model_copy(update={"error_kind": "cancelled", "http_status": None})
    for r in records:
        exporter.observe(r)
    counts = {(s.labels["status"], s.labels["error"]): s.value for family in exporter.registry.collect()
              if family.name == metrics.REQUESTS for s in family.samples if s.name.endswith("_total")}
    assert counts == {("2xx", ""): 3}


def test_push_sends_the_run_to_a_pushgateway_on_loopback() -> None:
    received: list[tuple[str, str, bytes]] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.command, self.path, body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        exporter = Exporter(route="/generate")
        for r in synthetic("zlab", 3, 8.0, seed=1, tokens=16):
            exporter.observe(r)
        exporter.push(f"http://127.0.0.1:{server.server_address[1]}", "run-7")
    finally:
        server.shutdown()
        server.server_close()
    assert len(received) == 1
    method, path, body = received[0]
    assert method == "PUT" and path == "/metrics/job/dfserve_loadtest/run_id/run-7"
    assert f"{metrics.OUTPUT_TOKENS}_total".encode() in body
    with refusing_port() as sock, pytest.raises(FieldError, match=r"^pushgateway: push to "):
        Exporter(route="/generate").push(url_of(sock), "run-8")


def _requests(body: str) -> float:
    line = next(line for line in body.splitlines()
                if line.startswith(f"{metrics.REQUESTS}_total") and 'arm="zlab"' in line)
    return float(line.rsplit(" ", 1)[1])


def test_a_scraped_exporter_serves_the_final_figures_until_the_next_scrape() -> None:
    """Requests that finish after the last scrape of a run would never reach Prometheus: the exporter waits for one
    more scrape (bounded by twice the interval it saw), which reads them; one never scraped does not wait."""
    idle = Exporter(route="native")
    idle.serve(0)
    said: list[str] = []
    started = time.monotonic()
    idle.linger(said.append)
    assert time.monotonic() - started < 0.2 and not said
    idle.close()

    exporter = Exporter(route="native")
    url = exporter.serve(0)
    records = synthetic("zlab", 3, 8.0, seed=1, tokens=32)
    try:
        exporter.observe(records[0])
        for _ in range(2):
            assert _requests(httpx.get(f"{url}/metrics").text) == 1
            time.sleep(0.3)
        for r in records[1:]:
            exporter.observe(r)  # the run's last requests, after its last scrape
        scraped: list[float] = []
        scraper = threading.Timer(0.5, lambda: scraped.append(_requests(httpx.get(f"{url}/metrics").text)))
        scraper.start()
        started = time.monotonic()
        exporter.linger(said.append)
        waited = time.monotonic() - started
        scraper.join()
        assert scraped == [3] and 0.4 < waited < 2 * exporter._scrapes.interval_s + 1, (scraped, waited)
        assert said and "until the next scrape (at most" in said[0]
        interval_s = exporter._scrapes.interval_s
        assert interval_s is not None
        started = time.monotonic()
        exporter.linger(said.append)  # nobody scrapes again: twice the interval seen, plus a second, at most
        assert 2 * interval_s + 1 <= time.monotonic() - started < 2 * interval_s + 5
    finally:
        exporter.close()


def test_a_scrape_begun_before_the_end_does_not_end_the_wait() -> None:
    """A scrape that began reading before the run's last requests were counted served older figures, however late it
    finished: the wait goes on for the next one (here, none: the bound)."""
    exporter = Exporter(route="native")
    requests = exporter.metrics.requests
    read = requests.collect
    reading = threading.Event()

    def slow_to_read() -> list[Metric]:  # as a big registry is
        reading.set()
        time.sleep(0.6)
        return read()

    requests.collect = slow_to_read  # type: ignore[method-assign]
    url = exporter.serve(0)
    try:
        httpx.get(f"{url}/metrics")
        httpx.get(f"{url}/metrics")
        reading.clear()
        late = threading.Thread(target=httpx.get, args=(f"{url}/metrics",))
        late.start()
        assert reading.wait(10)              # it has begun reading, and finishes after the wait begins
        started = time.monotonic()
        exporter.linger(lambda line: None)
        assert time.monotonic() - started > 1.0
        late.join()
    finally:
        exporter.close()


def test_ctrl_c_while_the_load_tester_waits_for_a_scrape_keeps_the_whole_run(tmp_path: Path) -> None:
    """The wait comes after the run's summary, report and push: a Ctrl-C in it only stops waiting."""
    with sim_server() as engine:
        run = subprocess.Popen(dfserve_argv("loadtest", "run", "--arm", f"zlab={engine}", "--num-requests", "4",
                                            "--warmup", "0", "--concurrency", "1", "--max-new-tokens", "32",
                                            "--metrics-port", "0", "--out", str(tmp_path), "--name", "r", "--quiet"),
                               stderr=subprocess.PIPE, text=True)
        try:
            assert run.stderr is not None
            metrics_url = re.search(r"http://\S+", run.stderr.readline())
            assert metrics_url is not None
            httpx.get(f"{metrics_url.group(0)}/metrics")
            for line in run.stderr:
                if "serving the final figures" in line:
                    break
            assert (tmp_path / "r" / "summary.json").exists()
            run.send_signal(signal.SIGINT)
            assert run.wait(30) == 0
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
            if run.stderr is not None:
                run.stderr.close()
    assert (tmp_path / "r" / "report.html").exists()
