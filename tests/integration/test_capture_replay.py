"""Capture then replay, over real sockets: clients send requests to a loopback server whose handler hands each one,
shaped as the gateway's finished exchanges, to the capture observer, or through `dfserve gateway --capture` to the
simulator; `dfserve loadtest run --tasks capture:DIR` replays them to the simulator on their captured schedule, and
to a second capturing server, which shows the bodies arrive as captured, each on the route it came on."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from dfserve.capture.format import CaptureManifest, CapturePolicy, CaptureRecord
from dfserve.capture.gateway import CaptureObserver
from dfserve.capture.read import read_capture
from dfserve.capture.writer import CaptureWriter
from dfserve.loadtest.records import read_records
from dfserve.loadtest.schedule import trace_offsets, trace_sha256
from tests.integration.servers import LOOPBACK, dfserve_argv, serve, sim_server

pytestmark = pytest.mark.slow
FLAGS = ("--max-new-tokens", "24", "--temperature", "0", "--top-p", "1")


@dataclass(frozen=True)
class Finished:
    """The fields of the gateway's record of a finished exchange that capture reads."""

    mirror: bool
    method: str
    path: str
    headers: bytes
    body: bytes
    start_s: float
    request: dict[str, Any] | None = None


@contextlib.contextmanager
def capturing_server(policy: CapturePolicy) -> Iterator[str]:
    """A loopback HTTP server that captures every POST and answers `{}`; the capture is closed when it stops."""
    observer = CaptureObserver(CaptureWriter.open(policy))
    turns = threading.Lock()  # the gateway observes from one thread; this server's handlers take turns

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            arrived = time.perf_counter()
            body = self.rfile.read(int(self.headers["Content-Length"]))
            headers = b"".join(f"{name.lower()}: {value}\r\n".encode() for name, value in self.headers.items())
            self._answer(200, b"{}")
            with turns:
                observer.observe(Finished(False, "POST", self.path, headers, body, arrived))
                observer.observe(Finished(True, "POST", self.path, headers, body, arrived))  # a shadow copy: not kept
                observer.flush()

        def do_GET(self) -> None:
            self._answer(404, b"")

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{LOOPBACK}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        observer.close()


def send(url: str, requests: list[tuple[str, dict[str, Any]]], gap_s: float = 0.0) -> None:
    with httpx.Client(base_url=url, trust_env=False) as client:
        for number, (path, body) in enumerate(requests):
            assert client.post(path, json=body, headers={"Authorization": "Bearer secret",
                                                         "X-Team": "infra"}).status_code == 200
            time.sleep(gap_s * (1 + number % 3))


def native(number: int) -> dict[str, Any]:
    settings = [{"temperature": 0.0, "max_new_tokens": 16}, {"temperature": 0.7, "top_p": 0.9}, {}][number % 3]
    return {"text": f"def task_{number}(xs):\n    return sorted(xs)", "sampling_params": settings, "stream": False,
            "rid": f"client-{number}"}


def chat(number: int) -> dict[str, Any]:
    settings = [{"temperature": 0.0, "max_tokens": 12}, {"top_p": 0.5}][number % 2]
    return {"model": "their-model", "messages": [{"role": "user", "content": f"write task {number}"}], **settings}


def loadtest(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dfserve_argv("loadtest", "run", "--out", str(out), "--quiet", *args), capture_output=True,
                          text=True, timeout=120)


def by_prompt(records: list[CaptureRecord], key: Any) -> dict[str, dict[str, Any]]:
    return {key(r.body): r.body for r in records}


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("captures")
    with capturing_server(CapturePolicy(dir=root / "native")) as url:
        send(url, [("/generate", native(i)) for i in range(12)], gap_s=0.04)
    with capturing_server(CapturePolicy(dir=root / "chat")) as url:
        send(url, [("/v1/chat/completions", chat(i)) for i in range(6)])
    with capturing_server(CapturePolicy(dir=root / "hashed", redact="hash")) as url:
        send(url, [("/generate", native(i)) for i in range(2)])
    return root


def test_captured_requests_keep_body_and_settings_but_never_credentials(captures: Path) -> None:
    manifest, records = read_capture(captures / "native")
    assert manifest.complete and manifest.counts.written == 12
    assert [r.body for r in records] == [native(i) for i in range(12)]
    assert records[1].sampling == {"temperature": 0.7, "top_p": 0.9}
    headers = dict(records[0].headers)
    assert headers["x-team"] == "infra" and "authorization" not in headers
    offsets = [r.offset_s for r in records]
    assert offsets == sorted(offsets) and offsets[-1] - offsets[0] >= 0.04 * 20


def test_a_trace_replay_sends_the_captured_tasks_on_the_captured_schedule(captures: Path, tmp_path: Path) -> None:
    _, captured = read_capture(captures / "native")
    with sim_server() as url:
        result = loadtest(tmp_path, "--arm", f"sim={url}", "--tasks", f"capture:{captures / 'native'}", "--arrival",
                          "trace", "--speed", "4", "--num-requests", "10", "--warmup", "2", "--name", "replay", *FLAGS)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "replay"
    records = sorted(read_records(run / "requests.jsonl"), key=lambda r: r.index)
    assert [r.task_id.split("-")[0] for r in records] == [f"c{i:06d}" for i in range(12)]
    assert all(r.ok for r in records)
    assert [r.temperature for r in records] == [[0.0, 0.7, 0.0][i % 3] for i in range(12)]  # each its own, or the flag
    assert [r.scheduled_s for r in records] == pytest.approx(trace_offsets([r.offset_s for r in captured], 4.0))
    fidelity = json.loads((run / "summary.json").read_text())["schedule_fidelity"]["sim"]
    assert fidelity["n"] == 10 and fidelity["late_max_ms"] >= fidelity["late_p99_ms"] >= fidelity["late_p50_ms"]
    assert "schedule fidelity, sim: sent late by p50" in result.stdout
    config = json.loads((run / "config.json").read_text())
    assert config["load"]["kind"] == "trace" and config["load"]["speed"] == 4.0
    assert config["load"]["trace_sha256"] == trace_sha256([r.offset_s for r in captured])  # the replayed schedule
    assert config["sampling"] == {"max_new_tokens": 24, "temperature": 0.7, "top_p": 1.0,  # the loosest replayed
                                  "min_temperature": 0.0}


def test_the_replayed_bodies_are_the_captured_ones(captures: Path, tmp_path: Path) -> None:
    """Captured again on the way in: what arrives is what was captured, streamed, less the client's rid, with the
    run's flags only where the request set nothing."""
    with capturing_server(CapturePolicy(dir=tmp_path / "again")) as url:
        result = loadtest(tmp_path, "--arm", f"rec={url}", "--tasks", f"capture:{captures / 'native'}", "--arrival",
                          "trace", "--speed", "8", "--num-requests", "12", "--warmup", "0", "--max-error-rate", "1",
                          *FLAGS)
    assert result.returncode == 0, result.stderr
    # what the flags filled is said: SGLang would have sampled a request without a temperature at its own default
    assert re.search(r"of its (\d+) requests, \d+ no max_new_tokens \(sent with --max-new-tokens 24\), \d+ no "
                     r"temperature \(sent with --temperature 0\), \d+ no top_p \(sent with --top-p 1\): the run's flags, "
                     r"not the server's defaults", result.stderr), result.stderr
    expected = {}
    for i in range(12):
        body = {**native(i), "stream": True}
        body.pop("rid")
        body["sampling_params"] = {"max_new_tokens": 24, "temperature": 0.0, "top_p": 1.0, **body["sampling_params"]}
        expected[body["text"]] = body
    assert by_prompt(read_capture(tmp_path / "again")[1], lambda b: b["text"]) == expected


def test_a_chat_capture_replays_with_its_own_settings(captures: Path, tmp_path: Path) -> None:
    with capturing_server(CapturePolicy(dir=tmp_path / "again")) as url:
        result = loadtest(tmp_path, "--arm", f"rec={url}", "--api", "chat", "--tasks", f"capture:{captures / 'chat'}",
                          "--rate", "100", "--num-requests", "6", "--warmup", "0", "--max-error-rate", "1", *FLAGS)
    assert result.returncode == 0, result.stderr
    expected = {}
    for i in range(6):
        body = {"max_tokens": 24, "temperature": 0.0, "top_p": 1.0, **chat(i), "model": "default", "stream": True,
                "return_spec_tokens_details": True, "stream_options": {"include_usage": True}}
        expected[body["messages"][0]["content"]] = body
    assert by_prompt(read_capture(tmp_path / "again")[1], lambda b: b["messages"][0]["content"]) == expected


@pytest.mark.parametrize(("capture", "extra", "message"), [
    ("hashed", (), "record 0 (segment-000001.jsonl:1) cannot be replayed: its user text was hashed (redact: hash)"),
    ("chat", ("--api", "native"), "--api: capture:chat holds requests of other routes than native (6 to "
                                  "/v1/chat/completions); bodies are not converted between APIs"),
    ("native", (), "--arm: a=http://127.0.0.1:9: server does not answer"),  # after its notes were known, before said
])
def test_a_capture_that_cannot_be_replayed_refuses_in_one_line(captures: Path, tmp_path: Path, capture: str,
                                                               extra: tuple[str, ...], message: str) -> None:
    result = loadtest(tmp_path, "--arm", "a=http://127.0.0.1:9", "--tasks", f"capture:{captures / capture}",
                      "--rate", "10", *extra)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # refused before any run folder was made


def test_a_truncated_capture_refuses(captures: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in (captures / "native").iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    segment = copy / "segment-000001.jsonl"
    segment.write_bytes(segment.read_bytes()[:-40])
    result = loadtest(tmp_path / "runs", "--arm", "a=http://127.0.0.1:9", "--tasks", f"capture:{copy}", "--rate", "1")
    assert result.returncode == 2, result.stderr
    assert "segment-000001.jsonl: 11 lines in" in result.stderr and "says 12 in" in result.stderr
    assert "(truncated or edited)" in result.stderr and len(result.stderr.strip().splitlines()) == 1


# --- live traffic mixes routes: captured by the gateway, replayed each on its own route ----------------------------

def completions(number: int) -> dict[str, Any]:
    settings = [{"max_tokens": 10, "temperature": 0.0}, {"top_p": 0.8, "stream": True}][number % 2]
    return {"model": "their-model", "prompt": f"# task {number}\ndef f():", **settings}


MIXED = [("/generate", native(0)), ("/v1/chat/completions", {**chat(0), "stream": True}),
         ("/v1/completions", completions(0)), ("/generate", native(1)), ("/v1/chat/completions", chat(1)),
         ("/v1/completions", completions(1))]


@pytest.fixture(scope="module")
def live_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Native, chat and completions requests through `dfserve gateway --capture` to the simulator."""
    folder = tmp_path_factory.mktemp("live") / "capture"
    with sim_server() as engine, serve(dfserve_argv("gateway", "--host", LOOPBACK, "--port", "0", "--arm",
                                                    f"sim=1@{engine}", "--capture", str(folder))) as gateway:
        send(gateway.url, MIXED)
    return folder


def test_a_mixed_capture_is_replayed_each_request_on_its_route_with_its_prompt_and_settings(
        live_capture: Path, tmp_path: Path) -> None:
    assert [(r.path, r.body) for r in read_capture(live_capture)[1]] == MIXED
    with capturing_server(CapturePolicy(dir=tmp_path / "again")) as url:
        result = loadtest(tmp_path, "--arm", f"rec={url}", "--model", "served", "--tasks", f"capture:{live_capture}",
                          "--arrival", "trace", "--speed", "8", "--num-requests", "6", "--warmup", "0",
                          "--max-error-rate", "1", *FLAGS)
    assert result.returncode == 0, result.stderr
    flags = {"max_tokens": 24, "temperature": 0.0, "top_p": 1.0}
    openai = {"model": "served", "stream": True, "return_spec_tokens_details": True,
              "stream_options": {"include_usage": True}}
    expected = [
        ("/generate", {"text": native(0)["text"], "stream": True,
                       "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0}}),
        ("/v1/chat/completions", {**flags, **chat(0), **openai}),
        ("/v1/completions", {**flags, **completions(0), **openai}),
        ("/generate", {"text": native(1)["text"], "stream": True,
                       "sampling_params": {"max_new_tokens": 24, "temperature": 0.7, "top_p": 0.9}}),
        ("/v1/chat/completions", {**flags, **chat(1), **openai}),
        ("/v1/completions", {**flags, **completions(1), **openai}),
    ]
    arrived = sorted(read_capture(tmp_path / "again")[1], key=lambda r: json.dumps(r.body, sort_keys=True))
    assert [(r.path, r.body) for r in arrived] == sorted(expected, key=lambda e: json.dumps(e[1], sort_keys=True))


def test_a_mixed_replay_records_each_route_with_exact_acceptance(live_capture: Path, tmp_path: Path) -> None:
    with sim_server() as url:
        result = loadtest(tmp_path, "--arm", f"a={url}", "--arm", f"b={url}", "--tasks", f"capture:{live_capture}",
                          "--rate", "50", "--num-requests", "12", "--warmup", "0", "--name", "mixed", *FLAGS)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "mixed"
    records = list(read_records(run / "requests.jsonl"))
    routes = {r.task_id: r.route for r in records if r.arm == "a"}
    assert {r.task_id: r.route for r in records if r.arm == "b"} == routes  # a task has its route on every arm
    assert sorted(set(routes.values())) == ["chat", "completions", "native"]
    assert all(r.ok and r.acceptance == "exact" and r.completion_tokens for r in records)
    assert all((r.chunk_tokens is not None) == (r.route == "native") for r in records)
    config = json.loads((run / "config.json").read_text())
    counts = {route: sum(1 for r in records if r.arm == "a" and r.route == route) for route in set(routes.values())}
    assert config["api"] == "mixed" and config["routes"] == counts and sum(counts.values()) == 12
    # both arms are one server: refused unless forced (then stamped)
    compared = subprocess.run(dfserve_argv("compare", str(run), "--force"), capture_output=True, text=True,
                              timeout=120)
    assert compared.returncode in (0, 1, 3), compared.stderr  # a verdict, not a refusal
    assert "12 pairs over 6 tasks" in compared.stdout
    assert "lossless: 10/10 identical outputs (the greedy pairs of 12)" in compared.stdout  # the sampled task's two


def test_an_api_other_than_the_captured_routes_refuses_in_one_line(live_capture: Path, tmp_path: Path) -> None:
    result = loadtest(tmp_path, "--arm", "a=http://127.0.0.1:9", "--tasks", f"capture:{live_capture}", "--rate", "10",
                      "--api", "chat")
    assert result.returncode == 2
    assert result.stderr.strip() == ("dfserve: error: --api: capture:capture holds requests of other routes than chat (2 to "
                                     "/generate, 2 to /v1/completions); bodies are not converted between APIs "
                                     "(without it, each is replayed on its own route)")
    assert not list(tmp_path.iterdir())


def test_a_capture_that_lost_requests_between_its_own_is_replayed_only_by_force_and_says_so(
        captures: Path, tmp_path: Path) -> None:
    """A full queue or a failed write leaves holes in the traffic a capture holds: its replay is not that traffic."""
    holed = tmp_path / "holed"
    holed.mkdir()
    for path in (captures / "native").iterdir():
        (holed / path.name).write_bytes(path.read_bytes())
    manifest = CaptureManifest.model_validate_json((holed / "manifest.json").read_text())
    holes = manifest.counts.model_copy(update={"dropped_queue_full": 30})
    (holed / "manifest.json").write_text(manifest.model_copy(update={"counts": holes}).sealed().model_dump_json())
    args = ("--tasks", f"capture:{holed}", "--rate", "50", "--num-requests", "6", "--warmup", "0", *FLAGS)
    refused = loadtest(tmp_path / "runs", "--arm", "a=http://127.0.0.1:9", *args)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "the capture lost 30 of its requests between the 12 it holds (30 because its queue was full)" in refused.stderr
    assert "--force replays" in refused.stderr and not (tmp_path / "runs").exists()
    with sim_server() as url:
        forced = loadtest(tmp_path / "runs", "--arm", f"a={url}", "--arm", f"b={url}", *args, "--name", "r", "--force")
    assert forced.returncode == 0, forced.stderr
    run = tmp_path / "runs" / "r"
    assert "lost 30" in json.loads((run / "config.json").read_text())["tasks"]["incomplete"]
    compared = subprocess.run(dfserve_argv("compare", str(run), "--force", "--out", str(tmp_path / "v")),
                              capture_output=True, text=True, timeout=120)
    assert compared.returncode in (0, 1, 3), compared.stderr
    verdict = json.loads(next((tmp_path / "v").glob("*/verdict.json")).read_text())
    assert any("lost 30" in line for line in verdict["incomplete"])
