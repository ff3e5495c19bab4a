"""Shadow records and capture through a real `dfserve gateway` in front of simulated engines: clients' chat and
native requests are recorded once per arm, paired by request; `dfserve compare` judges the folder (FAIL for the
undertrained drafter), with the noise floor of a secondary arm; greedy outputs are identical; the capture holds
each client request once. Streamed chat is recorded with the text its client read and its chunk times, so the
verdict judges TPOT and losslessness on it."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dfserve.capture.read import read_capture
from dfserve.loadtest.records import read_records
from dfserve.shadow.verdict import NO_HASH
from tests import ROOT
from tests.integration.servers import (
    LOOPBACK,
    dfserve_argv,
    gateway_server,
    refusing_port,
    sim_server,
    url_of,
)

pytestmark = pytest.mark.slow

REQUESTS = 24


def _bodies() -> list[tuple[str, dict[str, Any]]]:
    """Chat (whole) and native (whole and streamed), greedy; each prompt twice, so identical requests are one
    cluster."""
    bodies: list[tuple[str, dict[str, Any]]] = []
    for i in range(REQUESTS):
        prompt = f"def task_{i % (REQUESTS // 2)}(x):"
        if i % 2:
            bodies.append(("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": prompt}],
                                                    "max_tokens": 24, "temperature": 0}))
        else:
            bodies.append(("/generate", {"text": prompt, "stream": i % 4 == 0,
                                         "sampling_params": {"max_new_tokens": 24, "temperature": 0}}))
    return bodies


def _wait_for_mirrors(client: httpx.Client, count: int) -> None:
    """Mirrors finish after the client's answer; the gateway is stopped once all of them have."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = client.get("/metrics").text
        done = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("dfserve_shadow_requests_total{"))
        if done >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"mirrors did not finish: {done} of {count}")


def _compare(folder: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dfserve_argv("compare", str(folder), "--out", str(out), *extra), capture_output=True,
                          text=True, timeout=120)


def test_shadow_records_pair_by_request_and_judge(tmp_path: Path) -> None:
    with sim_server("zlab", 0.02, 0) as primary, sim_server("inhouse", 0.02, 0) as candidate, \
            sim_server("zlab", 0.02, 1) as secondary:
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump({
            "mode": "shadow", "primary": "baseline", "scrape": {"enabled": False}, "health": {"interval_s": 60},
            "arms": {"baseline": {"weight": 1, "replicas": [primary]},
                     "candidate": {"weight": 1, "replicas": [candidate]},
                     "baseline2": {"weight": 1, "replicas": [secondary]}}}))
        answers: list[tuple[str, int, bytes]] = []
        with gateway_server(config, "--record", str(tmp_path / "shadow"), "--secondary", "baseline2",
                            "--capture", str(tmp_path / "capture")) as url, httpx.Client(base_url=url,
                                                                                       timeout=60) as client:
            for path, body in _bodies():
                response = client.post(path, json=body)
                assert response.status_code == 200, response.text
                answers.append((path, response.status_code, response.content))
            _wait_for_mirrors(client, 2 * REQUESTS)
    folders = sorted((tmp_path / "shadow").iterdir())
    assert len(folders) == 1 and (folders[0] / "summary.json").exists()
    records = list(read_records(folders[0] / "requests.jsonl"))
    by_arm: dict[str, list[Any]] = {}
    for r in records:
        by_arm.setdefault(r.arm, []).append(r)
    assert sorted(by_arm) == ["baseline", "baseline2", "candidate"]
    for r in records:  # each arm timed from when its own copy was written to its replica
        assert r.route in ("native", "chat") and r.dispatched_s < (r.sent_s or 0) < (r.end_s or 0), r
    indexes = {arm: sorted(r.index for r in rs) for arm, rs in by_arm.items()}
    assert len(indexes["baseline"]) == REQUESTS and indexes["baseline"] == indexes["candidate"] == indexes["baseline2"]
    primary_records = sorted(by_arm["baseline"], key=lambda r: r.index)
    for record, (path, _, content) in zip(primary_records, answers, strict=True):
        assert record.ok and record.acceptance == "exact" and record.temperature == 0
        if path == "/v1/chat/completions":
            text = json.loads(content)["choices"][0]["message"]["content"]
            assert record.output_sha256 == hashlib.sha256(text.encode()).hexdigest()
    manifest, captured = read_capture(tmp_path / "capture")
    assert manifest.complete
    assert [(c.path, c.body) for c in captured] == _bodies()  # each client request once, its mirrors not

    judged = _compare(folders[0], tmp_path / "verdicts")
    assert judged.returncode == 1, judged.stdout + judged.stderr
    assert "noise floor baseline vs baseline2" in judged.stdout
    assert NO_HASH not in judged.stdout
    verdict_file = next((tmp_path / "verdicts").glob("*/verdict.json"))
    verdict = json.loads(verdict_file.read_text())
    assert verdict["verdict"] == "FAIL" and verdict["judgement"]["pairs"] == REQUESTS and not verdict["forced"]
    assert verdict["baseline"]["drafter"] != verdict["candidate"]["drafter"]  # as each engine's /server_info says
    accept = next(r for r in verdict["judgement"]["rules"] if r["metric"] == "accept_length")
    assert accept["status"] == "FAIL"
    lossless = verdict["judgement"]["lossless"]
    assert lossless["applicable"] and lossless["identical"] == REQUESTS
    floor = json.loads((verdict_file.parent / "noise-floor.json").read_text())["judgement"]
    assert floor["candidate"] == "baseline2" and floor["lossless"]["identical"] == REQUESTS
    assert next(r for r in floor["rules"] if r["metric"] == "accept_length")["status"] != "FAIL"


def test_a_mirror_goes_without_the_clients_request_id(tmp_path: Path) -> None:
    """SGLang refuses a second request of one id while the first runs: arms sharing a server (an A/A shadow) failed
    the mirror of every request that named one. The client's own request keeps its id."""
    bodies = [("/generate", {"text": f"def f{i}(x):", "rid": f"client-{i}", "stream": i % 2 == 0,
                             "sampling_params": {"max_new_tokens": 16, "temperature": 0}}) for i in range(4)]
    bodies += [("/v1/chat/completions", {"model": "m", "rid": f"client-chat-{i}", "max_tokens": 16, "temperature": 0,
                                         "messages": [{"role": "user", "content": f"def g{i}(x):"}]}) for i in range(2)]
    with sim_server("zlab", 0.02, 0) as engine:
        with gateway_server(_two_arms(tmp_path, engine, engine), "--record", str(tmp_path / "shadow")) as url, \
                httpx.Client(base_url=url, timeout=60) as client:
            for path, body in bodies:
                response = client.post(path, json=body)
                assert response.status_code == 200 and b"Duplicate" not in response.content, response.text
            _wait_for_mirrors(client, len(bodies))
        with httpx.Client(base_url=engine, timeout=60) as direct:  # as SGLang, the engine refuses an id it runs
            first = {"text": "def h(x):", "rid": "twice", "stream": True, "sampling_params": {"max_new_tokens": 4000,
                                                                                          "ignore_eos": True}}
            with direct.stream("POST", "/generate", json=first) as running:
                lines = running.iter_lines()  # held: a generator let go closes the stream
                assert next(lines).startswith("data:")
                second = direct.post("/generate", json={**first, "stream": False})
            assert second.status_code == 400 and "Duplicate request ID detected: twice" in second.text
    records = list(read_records(next((tmp_path / "shadow").iterdir()) / "requests.jsonl"))
    assert len(records) == 2 * len(bodies)
    assert all(r.ok and r.acceptance == "exact" for r in records), [r.error_message for r in records if not r.ok]


@contextlib.contextmanager
def _dropping() -> Iterator[str]:
    """A replica that reads each request and closes its connection without an answer (killed while generating)."""
    listener = socket.create_server((LOOPBACK, 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = listener.accept()
                with conn:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        head += conn.recv(65536)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield url_of(listener)
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_a_replica_that_closes_after_taking_the_request_is_a_disconnect_not_a_connect_failure(tmp_path: Path) -> None:
    """As the load tester records it: the request was sent, and the replica went away before answering."""
    with sim_server("zlab", 0.02, 0) as engine, _dropping() as dropping:
        with gateway_server(_two_arms(tmp_path, engine, dropping), "--record", str(tmp_path / "shadow")) as url, \
                httpx.Client(base_url=url, timeout=60) as client:
            for stream in (False, True):
                body = {"text": "def f(x):", "stream": stream, "sampling_params": {"max_new_tokens": 8}}
                assert client.post("/generate", json=body).status_code == 200
            _wait_for_mirrors(client, 2)
            metrics = client.get("/metrics").text
    records = list(read_records(next((tmp_path / "shadow").iterdir()) / "requests.jsonl"))
    assert [(r.arm, r.error_kind) for r in records] == [("baseline", None), ("candidate", "disconnect")] * 2
    assert f'dfserve_requests_total{{arm="candidate",error="disconnect",replica="{dropping}",route="native",' \
           'status="5xx"} 2.0' in metrics and 'error="connect"' not in metrics


def test_a_retried_request_is_captured_once(tmp_path: Path) -> None:
    """The gateway tries another replica of the arm within one exchange, so capture sees each request once."""
    with sim_server("zlab", 0.02, 0) as engine, refusing_port() as dead:
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump({
            "scrape": {"enabled": False}, "health": {"interval_s": 60, "eject_after_failures": 1000},
            "arms": {"baseline": {"weight": 1, "replicas": [url_of(dead), engine]}}}))
        bodies = [{"text": f"prompt {i}", "sampling_params": {"max_new_tokens": 4}} for i in range(12)]
        with gateway_server(config, "--capture", str(tmp_path / "capture")) as url, \
                httpx.Client(base_url=url, timeout=60) as client:
            for body in bodies:
                assert client.post("/generate", json=body).status_code == 200
            retried = sum(float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
                          if line.startswith("dfserve_upstream_errors_total{") and 'kind="connect"' in line)
    assert retried > 0  # some requests went to the dead replica first and were retried on the engine
    manifest, captured = read_capture(tmp_path / "capture")
    assert manifest.complete and [c.body for c in captured] == bodies


def _series(client: httpx.Client, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
               if line.startswith(prefix))


def _settled(client: httpx.Client, prefix: str) -> float:
    """`prefix`'s value once no request is in flight on the gateway (the mirrors under way at the stop finish)."""
    deadline = time.monotonic() + 30
    while _series(client, "dfserve_requests_in_flight{") > 0:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)
    return _series(client, prefix)


def _two_arms(tmp_path: Path, primary: str, candidate: str) -> Path:
    """A shadow gateway's config: `baseline` answers, `candidate` is mirrored to."""
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({
        "mode": "shadow", "primary": "baseline", "scrape": {"enabled": False}, "health": {"interval_s": 60},
        "arms": {"baseline": {"weight": 1, "replicas": [primary]}, "candidate": {"weight": 1, "replicas": [candidate]}}}))
    return config


def test_until_decided_stops_mirroring_and_compare_agrees(tmp_path: Path) -> None:
    """An undertrained candidate behind a shadow gateway deciding as it records: mirroring stops with FAIL, the
    metric says so, later requests reach only the primary, and `dfserve compare` replays the same decision."""
    gate = tmp_path / "gate.yaml"
    gate.write_text(yaml.safe_dump({"rules": [{"metric": "accept_length", "max_worse": 0.02},
                                              {"metric": "error_rate", "max_worse": 0.01}]}))
    log = tmp_path / "gateway.log"
    with sim_server("zlab", 0.02, 0) as primary, sim_server("inhouse", 0.02, 0) as candidate:
        config = _two_arms(tmp_path, primary, candidate)
        with gateway_server(config, "--record", str(tmp_path / "shadow"), "--until-decided", "--gate", str(gate),
                            "--look-every", "4", log=log) as url, httpx.Client(base_url=url, timeout=60) as client:
            sent = 0
            while _series(client, 'dfserve_shadow_decision{state="fail"}') == 0:
                assert sent < 64, "no decision after 64 requests"
                body = {"text": f"def task_{sent}(x):", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
                assert client.post("/generate", json=body).status_code == 200
                sent += 1
            assert _series(client, 'dfserve_shadow_decision{state="deciding"}') == 0
            judged_pairs = _series(client, "dfserve_shadow_decision_pairs")
            mirrored = _settled(client, 'dfserve_requests_total{arm="candidate"')
            served = _series(client, 'dfserve_requests_total{arm="baseline"')
            for i in range(4):
                body = {"text": f"later {i}", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
                assert client.post("/generate", json=body).status_code == 200
            assert _settled(client, 'dfserve_requests_total{arm="candidate"') == mirrored  # mirroring stopped
            assert _series(client, 'dfserve_requests_total{arm="baseline"') == served + 4  # clients still served
    [folder] = sorted((tmp_path / "shadow").iterdir())
    assert (folder / "summary.json").exists() and (folder / "decision.json").exists()
    said = [line for line in log.read_text().splitlines() if "shadow decided" in line]
    assert len(said) == 1 and "FAIL" in said[0] and str(folder) in said[0]
    judged = _compare(folder, tmp_path / "verdicts")
    assert judged.returncode == 1, judged.stdout + judged.stderr
    assert "sequential on live traffic" in judged.stdout
    verdict = json.loads(next((tmp_path / "verdicts").glob("*/verdict.json")).read_text())
    decision = json.loads((folder / "decision.json").read_text())
    assert verdict["verdict"] == "FAIL" and not verdict["forced"] and verdict["sequential"]["live"]
    assert verdict["sequential"]["stopped_after_pairs"] == decision["pairs"] == judged_pairs
    assert next(r for r in verdict["judgement"]["rules"] if r["metric"] == "accept_length")["status"] == "FAIL"


STREAMS = 12


def _streamed_content(raw: bytes) -> list[str]:
    """The non-empty content deltas of a chat stream as its client read it, in order."""
    contents = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices") or ():
                if choice.get("delta", {}).get("content"):
                    contents.append(choice["delta"]["content"])
    return contents


def test_streamed_chat_is_recorded_with_the_clients_text_and_chunk_times(tmp_path: Path) -> None:
    with sim_server("zlab", 0.02, 0) as primary, sim_server("inhouse", 0.02, 0) as candidate:
        config = _two_arms(tmp_path, primary, candidate)
        received: list[list[str]] = []
        with gateway_server(config, "--record", str(tmp_path / "shadow")) as url, \
                httpx.Client(base_url=url, timeout=60) as client:
            for i in range(STREAMS):
                body = {"model": "m", "messages": [{"role": "user", "content": f"def task_{i}(x):"}],
                        "max_tokens": 24, "temperature": 0, "stream": True}
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    received.append(_streamed_content(response.read()))
            _wait_for_mirrors(client, STREAMS)
    folder = next((tmp_path / "shadow").iterdir())
    records = list(read_records(folder / "requests.jsonl"))
    for arm in ("baseline", "candidate"):
        mine = sorted((r for r in records if r.arm == arm), key=lambda r: r.index)
        assert len(mine) == STREAMS
        for record, contents in zip(mine, received, strict=True):
            assert record.ok and contents
            assert record.output_sha256 == hashlib.sha256("".join(contents).encode()).hexdigest()
            times = record.chunk_times_s
            assert times == sorted(times) and times[0] == pytest.approx(record.first_token_s, abs=1e-9)
            assert record.end_s is not None and times[-1] <= record.end_s
            if arm == "baseline":  # the chunks its client read; the candidate's were its own, read by nobody
                assert len(times) == len(contents)
            else:
                assert 1 <= len(times) <= (record.completion_tokens or 0)

    gate = tmp_path / "gate.yaml"
    gate.write_text("rules:\n  - {metric: tpot_p95, max_worse: 0.5}\n  - {metric: lossless_fraction, at_least: 0.99}\n")
    judged = _compare(folder, tmp_path / "verdicts", "--gate", str(gate))
    assert re.search(r"^\s*tpot_p95\s+[\d.]+ ms\s+[\d.]+ ms", judged.stdout, re.M), judged.stdout + judged.stderr
    assert NO_HASH not in judged.stdout
    verdict = json.loads(next((tmp_path / "verdicts").glob("*/verdict.json")).read_text())["judgement"]
    assert verdict["lossless"]["applicable"] and verdict["lossless"]["identical"] == STREAMS
    tpot = next(r for r in verdict["rules"] if r["metric"] == "tpot_p95")
    assert tpot["detail"].startswith("worse by "), tpot  # judged on the recorded streams, not "no paired data"


TOOL_STREAM = (ROOT / "tests" / "fixtures" / "sglang" / "chat_stream_tool_calls.sse").read_bytes().split(b"\n\n", 1)[1]
"""SGLang 0.5.23's stream of a turn that is one tool call (written by its own models: make_fixtures.py)."""


@contextlib.contextmanager
def _tool_calling_engine(path_argument: str) -> Iterator[str]:
    """An engine that answers every chat request with SGLang's tool-call stream, calling `run_tests` on
    `path_argument`: two of them differ only inside a tool call's arguments."""
    body = TOOL_STREAM.replace(b'tests/\\"}', path_argument.encode() + b'\\"}')
    assert body != TOOL_STREAM or path_argument == "tests/"

    class Engine(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer((LOOPBACK, 0), Engine) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://{LOOPBACK}:{server.server_address[1]}"
        finally:
            server.shutdown()


def test_a_tool_call_is_the_output_and_arguments_that_differ_are_not_lossless(tmp_path: Path) -> None:
    """A coding agent's turn that is only a tool call has an output (its name and arguments, as the client read
    them) and chunks; a candidate whose arguments differ at temperature 0 is not lossless."""
    with _tool_calling_engine("tests/") as primary, _tool_calling_engine("src/") as candidate:
        with gateway_server(_two_arms(tmp_path, primary, candidate), "--record", str(tmp_path / "shadow")) as url, \
                httpx.Client(base_url=url, timeout=60) as client:
            for i in range(4):
                body = {"model": "m", "messages": [{"role": "user", "content": f"fix test {i}"}], "temperature": 0,
                        "stream": True, "tools": [{"type": "function", "function": {"name": "run_tests"}}]}
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200 and b'"arguments":"tests/' in response.read()
            _wait_for_mirrors(client, 4)
    folder = next((tmp_path / "shadow").iterdir())
    records = {(r.arm, r.index): r for r in read_records(folder / "requests.jsonl")}
    assert len(records) == 8
    for (arm, _), record in records.items():
        called = "tests/" if arm == "baseline" else "src/"
        text = 'run_tests{"path": "' + called + '"}'
        assert record.ok and record.finish_reason == "tool_calls", record
        assert record.output_sha256 == hashlib.sha256(text.encode()).hexdigest()
        assert len(record.chunk_times_s) == 3 and record.first_token_s == record.chunk_times_s[0]
    judged = _compare(folder, tmp_path / "verdicts", "--force")
    verdict = json.loads(next((tmp_path / "verdicts").glob("*/verdict.json")).read_text())["judgement"]
    assert verdict["lossless"]["applicable"] and verdict["lossless"]["identical"] == 0, judged.stdout


def _answered_one_by_one(client: httpx.Client, count: int, max_new_tokens: int) -> None:
    """`count` greedy native requests, each sent once the last was answered; every client gets its answer."""
    for i in range(count):
        answer = client.post("/generate", json={"text": f"def task_{i}(x):",
                                                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
        assert answer.status_code == 200


def test_a_stop_lets_the_mirrors_under_way_finish_and_their_folder_is_whole(tmp_path: Path) -> None:
    """Stopped right after its clients' answers, while the slower candidate's mirrors still run (each for most of a
    second, so some are in flight however slow the machine): they finish and are recorded, rather than cut (the
    slowest answers would be those cut, and the rest judged)."""
    with sim_server("zlab", 0.02, 0) as primary, sim_server("inhouse", 1.5, 0) as candidate:
        with gateway_server(_two_arms(tmp_path, primary, candidate), "--record", str(tmp_path / "shadow")) as url, \
                httpx.Client(base_url=url, timeout=60) as client:
            _answered_one_by_one(client, 12, max_new_tokens=32)
            in_flight = client.get("/metrics").text
        # the gateway is stopped here, as it leaves the block
    assert re.search(r'^dfserve_requests_in_flight\{arm="candidate"[^}]*\} [1-9]', in_flight, re.M)
    (folder,) = (tmp_path / "shadow").iterdir()
    records = list(read_records(folder / "requests.jsonl"))
    assert sorted((r.arm, r.error_kind) for r in records) == [("baseline", None)] * 12 + [("candidate", None)] * 12
    assert json.loads((folder / "summary.json").read_text())["interrupted"] is False


def test_mirrors_the_gateways_own_limit_refused_are_no_errors_of_the_candidate(tmp_path: Path) -> None:
    """With one request in flight per arm and a candidate slower than the clients' pace, the mirrors sent while it
    was busy never reach it: the gateway's limit refused them (429, counted `dropped`). They are recorded as not
    the arm's (cancelled) rather than failing the candidate on error_rate (it did: 33% of its records were 429s);
    and the folder is incomplete (the pairs the candidate had room for are its quiet moments): judged only forced."""
    with sim_server("zlab", 0.02, 0) as primary, sim_server("inhouse", 1.5, 0) as candidate:
        config = _two_arms(tmp_path, primary, candidate)
        config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()),
                                          "limits": {"max_concurrent_per_arm": 1}}))
        with gateway_server(config, "--record", str(tmp_path / "shadow")) as url, \
                httpx.Client(base_url=url, timeout=60) as client:
            _answered_one_by_one(client, 8, max_new_tokens=16)
            _wait_for_mirrors(client, 8)
            dropped = _series(client, 'dfserve_shadow_requests_total{arm="candidate",outcome="dropped"}')
    assert dropped >= 1
    (folder,) = (tmp_path / "shadow").iterdir()
    candidate_records = [r for r in read_records(folder / "requests.jsonl") if r.arm == "candidate"]
    refused = [r for r in candidate_records if r.http_status == 429]
    assert len(refused) == dropped and all(r.error_kind == "cancelled" for r in refused)
    assert all(r.ok for r in candidate_records if r.http_status != 429)
    assert json.loads((folder / "summary.json").read_text())["interrupted"] is True
    refused = _compare(folder, tmp_path / "refused")
    assert refused.returncode == 2 and "--force" in refused.stderr, refused.stdout + refused.stderr
    judged = _compare(folder, tmp_path / "verdict", "--force")
    assert "refused by the gateway's own limit" in " ".join(judged.stdout.split()), judged.stdout + judged.stderr
    judgement = json.loads(next((tmp_path / "verdict").glob("*/verdict.json")).read_text())["judgement"]
    assert judgement["pairs"] == 8 - dropped
    error_rate = next(m for m in judgement["metrics"] if m["metric"] == "error_rate")
    assert error_rate["candidate"] == 0, error_rate
