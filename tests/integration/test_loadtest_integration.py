"""The load tester against simulated engines on loopback: real HTTP, real subprocesses, real run directories."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import httpx
import pytest

from dfserve.deploy.sim.acceptance import RoundModel, prompt_difficulty
from dfserve.deploy.sim.profiles import load_profile
from dfserve.loadtest.records import RequestRecord, read_records
from dfserve.tasks import load_tasks
from tests import ROOT
from tests.integration.servers import (
    Started,
    dfserve_argv,
    gateway_server,
    refusing_port,
    serve,
    sim_argv,
    sim_server,
    url_of,
)

pytestmark = pytest.mark.slow
SHORT = ("--num-requests", "120", "--warmup", "4", "--concurrency", "16", "--max-new-tokens", "128", "--quiet")


def loadtest(out: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(dfserve_argv("loadtest", "run", "--out", str(out), *args), capture_output=True,
                            text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def compare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dfserve_argv("compare", *args), capture_output=True, text=True, timeout=120)


def records(run: Path) -> list[RequestRecord]:
    return list(read_records(run / "requests.jsonl"))


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("runs")
    with sim_server("zlab", 0.02, 0) as zlab, sim_server("inhouse", 0.02, 0) as inhouse:
        loadtest(out, "--arm", f"zlab={zlab}", "--arm", f"inhouse={inhouse}", "--name", "ab", *SHORT)
    yield out / "ab"


@cache
def _expected_rounds(profile: str, difficulty: float, remaining: int) -> float:
    """E[verify rounds] to produce `remaining` tokens after the prefill token: R(n) = 1 + Σ_t p_t R(n - t)."""
    model = RoundModel.build(load_profile(profile), difficulty)  # type: ignore[arg-type]
    p = model.token_distribution()
    rounds = [0.0] * (remaining + 1)
    for n in range(1, remaining + 1):
        rounds[n] = 1.0 + sum(p[t - 1] * rounds[n - t] for t in range(1, min(n, len(p)) + 1))
    return rounds[remaining]


def test_measured_acceptance_of_each_arm_agrees_with_the_profile(ab_run: Path) -> None:
    summary = json.loads((ab_run / "summary.json").read_text())
    prompts = {t.id: t.as_text() for t in load_tasks("humaneval").tasks}
    for arm in summary["arms"]:
        measured = [r for r in records(ab_run) if r.arm == arm["arm"] and not r.warmup]
        assert len(measured) == 120 and all(r.ok and r.acceptance == "exact" and r.simulated for r in measured)
        tokens = sum(r.completion_tokens or 0 for r in measured)
        expected = tokens / sum(_expected_rounds(arm["arm"], prompt_difficulty(prompts[r.task_id]),
                                                 (r.completion_tokens or 1) - 1) for r in measured)
        figure = arm["accept_length"]
        assert figure["low"] <= expected <= figure["high"], (arm["arm"], expected, figure)
        assert sum(sum(r.chunk_tokens or []) == r.completion_tokens for r in measured) == 120
    assert (ab_run / "report.html").read_text().count("<svg") == 5


def test_each_arm_says_its_reads_were_dated_by_the_kernel_and_how_long_they_waited(ab_run: Path) -> None:
    config = json.loads((ab_run / "config.json").read_text())
    assert [arm["arrival_stamps"] for arm in config["arms"]] == ["kernel", "kernel"]
    summary = json.loads((ab_run / "summary.json").read_text())
    for arm in summary["arms"]:
        responses = sum(r.arm == arm["arm"] for r in records(ab_run))
        lag = arm["tester_read_lag"]
        assert responses < lag["reads"] and 0 <= lag["late_reads"] <= lag["reads"] and 0 <= lag["max_lag_s"] < 1


def test_inhouse_against_zlab_fails_on_acceptance(ab_run: Path) -> None:
    result = compare(str(ab_run))
    assert result.returncode == 1, result.stdout + result.stderr
    verdict_file = next(ab_run.parent.glob("verdict-*/verdict.json"))
    verdict = json.loads(verdict_file.read_text())
    rules = {r["metric"]: r["status"] for r in verdict["judgement"]["rules"]}
    assert rules["accept_length"] == "FAIL" and rules["lossless_fraction"] == "PASS"
    assert verdict["baseline"]["simulated"] is True
    report = verdict_file.parent / "report.html"
    assert f"report:  {report}" in result.stdout  # beside verdict.json, and the CLI says where
    page = report.read_text()
    assert "<p class='verdict' style='color:#b3261e'>FAIL</p>" in page and "SIMULATED" in page
    assert verdict["baseline"]["run_id"] in page and "accept_length" in page


def test_a_second_run_never_touches_the_first(ab_run: Path) -> None:
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in ab_run.iterdir()}
    with sim_server("zlab", 0.02, 1) as zlab:
        again = loadtest(ab_run.parent, "--arm", f"zlab={zlab}", "--name", "ab", *SHORT, check=False)
        assert again.returncode == 2 and "already exists" in again.stderr
        loadtest(ab_run.parent, "--arm", f"zlab={zlab}", "--num-requests", "10", "--concurrency", "4", "--quiet")
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in ab_run.iterdir()} == before
    assert len(list(ab_run.parent.glob("run-*"))) == 1


def test_aa_is_not_fail_and_a_lossy_candidate_is_caught(tmp_path: Path) -> None:
    with sim_server("zlab", 0.02, 0) as a, sim_server("zlab", 0.02, 1) as b, \
            sim_server("zlab", 0.02, 2, "--lossy-fraction", "0.2", "--draft-model-path", "/models/lossy") as lossy:
        loadtest(tmp_path, "--arm", f"a={a}", "--arm", f"b={b}", "--arm", f"lossy={lossy}", "--name", "r", *SHORT)
    # Three simulators and the tester share two cores, so their latencies differ by how the OS schedules them; the
    # A/A check is about the acceptance, error and losslessness rules, which no scheduler can move.
    gate = tmp_path / "gate.yaml"
    gate.write_text("rules:\n  - {metric: accept_length, max_worse: 0.02}\n  - {metric: error_rate, max_worse: 0.01}\n"
                    "  - {metric: lossless_fraction, at_least: 0.99}\n")
    aa = compare(str(tmp_path / "r"), "--baseline", "a", "--candidate", "b", "--gate", str(gate),
                 "--out", str(tmp_path / "aa"))
    assert aa.returncode == 2 and "both sides serve drafter" in aa.stderr  # a drafter is not judged against itself
    aa = compare(str(tmp_path / "r"), "--baseline", "a", "--candidate", "b", "--gate", str(gate), "--force",
                 "--out", str(tmp_path / "aa"))
    assert aa.returncode in (0, 3), aa.stdout + aa.stderr
    caught = compare(str(tmp_path / "r"), "--baseline", "a", "--candidate", "lossy", "--out", str(tmp_path / "l"))
    assert caught.returncode == 1, caught.stdout
    verdict = json.loads(next((tmp_path / "l").glob("verdict-*/verdict.json")).read_text())
    lossless = verdict["judgement"]["lossless"]
    assert 0.6 < lossless["fraction"] < 0.95 and len(lossless["differing_tasks"]) >= 5
    assert {r["metric"]: r["status"] for r in verdict["judgement"]["rules"]}["lossless_fraction"] == "FAIL"


def _wait_for_lines(path: Path, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= count:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{path}: fewer than {count} records after {timeout_s} s")


def test_killing_one_arm_mid_run_keeps_complete_records_and_classifies_the_rest(tmp_path: Path) -> None:
    with sim_server("zlab", 0.2, 0) as zlab, serve(sim_argv("inhouse", 0.2, 0)) as doomed:
        run = subprocess.Popen(dfserve_argv("loadtest", "run", "--out", str(tmp_path), "--name", "k", "--arm",
                                            f"zlab={zlab}", "--arm", f"inhouse={doomed.url}",
                                            "--num-requests", "60", "--warmup", "0", "--concurrency", "6",
                                            "--max-new-tokens", "256", "--quiet"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for_lines(tmp_path / "k" / "requests.jsonl", 10)
        os.killpg(doomed.process.pid, signal.SIGKILL)
        _, stderr = run.communicate(timeout=120)
    # most of inhouse's requests failed: the run is kept, and says so in one line and its exit status
    assert run.returncode == 4, stderr
    # (on a loaded machine the tester's read-lag warning may come too: not what this test is about)
    (line,) = [line for line in stderr.splitlines() if not line.startswith("warning: arm ")]
    assert line.startswith("errors over --max-error-rate 0.05: inhouse failed ") and "zlab" not in line
    assert "disconnect=" in line and line.endswith(f"; run kept: {tmp_path / 'k'}")
    kept = records(tmp_path / "k")
    by_arm = {arm: [r for r in kept if r.arm == arm] for arm in ("zlab", "inhouse")}
    assert len(by_arm["zlab"]) == 60 and all(r.ok for r in by_arm["zlab"])
    assert len(by_arm["inhouse"]) == 60  # every scheduled request has a record
    failed = [r for r in by_arm["inhouse"] if not r.ok]
    assert failed and {r.error_kind for r in failed} <= {"disconnect", "connect"}
    assert "disconnect" in {r.error_kind for r in failed}  # the ones in flight when it died
    assert any(r.ok for r in by_arm["inhouse"])
    summary = json.loads((tmp_path / "k" / "summary.json").read_text())
    inhouse = next(a for a in summary["arms"] if a["arm"] == "inhouse")
    assert inhouse["errors"] and inhouse["error_rate"] > 0


def test_ctrl_c_stops_cleanly_and_keeps_what_was_recorded(tmp_path: Path) -> None:
    with sim_server("zlab", 0.2, 0) as zlab:
        run = subprocess.Popen(dfserve_argv("loadtest", "run", "--out", str(tmp_path), "--name", "c", "--arm",
                                            f"zlab={zlab}", "--num-requests", "200", "--concurrency", "4", "--quiet"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for_lines(tmp_path / "c" / "requests.jsonl", 5)
        run.send_signal(signal.SIGINT)
        _, stderr = run.communicate(timeout=60)
    assert run.returncode == 130, stderr
    kept = records(tmp_path / "c")
    assert 5 <= len(kept) < 208
    assert {r.error_kind for r in kept} <= {None, "cancelled"}
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    (arm,) = summary["arms"]
    assert summary["interrupted"] is True and arm["errors"] == {} and arm["error_rate"] == 0  # cancelled, not failed
    assert arm["cancelled"] == sum(r.cancelled for r in kept if not r.warmup)


def sync_server(ttft_ms: float, gap_ms: float, chunks: int) -> contextlib.AbstractContextManager[Started]:
    """bench/sync_server.py: streams of one length and known timing, with counts of what it has sent."""
    return serve([sys.executable, str(ROOT / "bench" / "sync_server.py"), "--port", "0", "--ttft-ms", str(ttft_ms),
                  "--gap-ms", str(gap_ms), "--chunks", str(chunks)])


def marked_tasks(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{n}", "prompt": f"req-{n}: add two numbers"}) + "\n"
                            for n in range(count)))
    return path


def running(pid: int) -> bool:
    """Whether `pid` still runs (an orphan that ended may stay a zombie where nothing reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def test_a_killed_tester_leaves_the_record_of_every_request_that_had_finished(tmp_path: Path) -> None:
    """SIGKILL mid-run: every request whose stream the server had ended half a second before has its line, whole."""
    with sync_server(5, 5, 16) as server:
        run = subprocess.Popen(dfserve_argv("loadtest", "run", "--out", str(tmp_path), "--name", "k", "--api", "chat",
                                            "--arm", f"sync={server.url}", "--tasks",
                                            str(marked_tasks(tmp_path / "tasks.jsonl", 2000)), "--num-requests",
                                            "2000", "--warmup", "0", "--concurrency", "8", "--quiet"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while (ended := httpx.get(server.url + "/progress").json()["ended"]) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        writers = Path(f"/proc/{run.pid}/task/{run.pid}/children").read_text().split()
        run.kill()
        run.wait(10)
    assert len(writers) == 1
    while running(int(writers[0])) and time.monotonic() < deadline:
        time.sleep(0.05)  # the writer reads to the end of its pipe, then exits
    kept = records(tmp_path / "k")
    assert len(kept) >= ended >= 40
    assert all(r.ok and len(r.chunk_times_s) == 16 for r in kept)
    assert len({r.task_id for r in kept}) == len(kept)


def test_open_loop_chat_run_records_waits_and_exact_acceptance_from_spec_details(tmp_path: Path) -> None:
    with sim_server("zlab", 0.05, 0, "--record-chunk-times") as zlab:
        loadtest(tmp_path, "--arm", f"zlab={zlab}", "--api", "chat", "--rate", "200", "--arrival", "constant",
                 "--concurrency", "4", "--num-requests", "40", "--warmup", "0", "--max-new-tokens", "64", "--name",
                 "o", "--quiet")
        loadtest(tmp_path, "--arm", f"zlab={zlab}", "--rate", "50", "--num-requests", "30", "--warmup", "0",
                 "--max-new-tokens", "64", "--name", "n", "--quiet")
    chat = records(tmp_path / "o")
    # streamed chat asks for return_spec_tokens_details: SGLang 0.5.23's verify rounds, exact as native's
    assert len(chat) == 40 and all(r.ok and r.acceptance == "exact" and r.spec_verify_ct for r in chat)
    assert [r.scheduled_s for r in sorted(chat, key=lambda r: r.index)] == pytest.approx([i / 200 for i in range(40)])
    assert max(r.dispatched_s - (r.scheduled_s or 0) for r in chat) > 0.02  # the cap of 4 made requests wait
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())["arms"][0]
    assert summary["acceptance"] == "exact" and summary["wait_s"]["n"] == 40
    config = json.loads((tmp_path / "n" / "config.json").read_text())
    native = records(tmp_path / "n")
    for r in native:  # the simulator's own send times: every chunk arrives after it was sent, and soon after
        assert r.sim_chunk_sent_unix_s is not None and len(r.sim_chunk_sent_unix_s) == len(r.chunk_times_s)
        lateness = [config["t0_unix_s"] + got - sent for got, sent in zip(r.chunk_times_s, r.sim_chunk_sent_unix_s,
                                                                           strict=True)]
        assert min(lateness) > -0.002 and max(lateness) < 0.5


def test_duration_bounds_the_run_and_arms_get_the_same_schedule(tmp_path: Path) -> None:
    with sim_server("zlab", 0.2, 0) as a, sim_server("inhouse", 0.2, 0) as b:
        started = time.monotonic()
        loadtest(tmp_path, "--arm", f"a={a}", "--arm", f"b={b}", "--rate", "40", "--num-requests", "1000",
                 "--duration", "1.0", "--warmup", "0", "--max-new-tokens", "32", "--name", "d", "--quiet")
        assert time.monotonic() - started < 20
    kept = records(tmp_path / "d")
    by_arm = {arm: sorted((r for r in kept if r.arm == arm), key=lambda r: r.index) for arm in ("a", "b")}
    assert 20 <= len(by_arm["a"]) <= 60 and len(by_arm["a"]) == len(by_arm["b"])
    assert max(r.scheduled_s or 0 for r in kept) <= 1.0
    assert [(r.task_id, r.scheduled_s) for r in by_arm["a"]] == [(r.task_id, r.scheduled_s) for r in by_arm["b"]]
    assert all(abs((x.sent_s or 0) - (y.sent_s or 0)) < 0.05 for x, y in zip(by_arm["a"], by_arm["b"], strict=True))


def test_an_api_key_and_headers_reach_an_engine_that_checks_the_key(tmp_path: Path) -> None:
    with sim_server("zlab", 0.02, 0, "--api-key", "s3cret") as engine:
        assert httpx.get(f"{engine}/health").status_code == 200  # open, as SGLang keeps probes and scrapes
        refused = httpx.get(f"{engine}/server_info")
        assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
        loadtest(tmp_path, "--arm", f"a={engine}", "--api", "chat", "--api-key", "s3cret", "--header",
                 "X-Team: drafters", "--num-requests", "12", "--warmup", "0", "--concurrency", "4",
                 "--max-new-tokens", "32", "--name", "key", "--quiet")
        without = loadtest(tmp_path, "--arm", f"a={engine}", "--num-requests", "6", "--warmup", "0",
                           "--concurrency", "2", "--max-new-tokens", "32", "--name", "nokey", "--quiet", check=False)
        bad = loadtest(tmp_path, "--arm", f"a={engine}", "--header", "X-Bad", "--concurrency", "1", "--quiet",
                       check=False)
    keyed = records(tmp_path / "key")
    assert len(keyed) == 12 and all(r.ok and r.acceptance == "exact" for r in keyed)
    config = json.loads((tmp_path / "key" / "config.json").read_text())
    assert config["header_names"] == ["X-Team", "Authorization"] and "s3cret" not in json.dumps(config)
    assert config["arms"][0]["server_info"] is not None  # the probe carried the key too
    assert without.returncode == 4 and {r.http_status for r in records(tmp_path / "nokey")} == {401}
    assert bad.returncode == 2 and "--header: 'X-Bad' is not NAME: VALUE" in bad.stderr


def test_failures_are_classified(tmp_path: Path) -> None:
    with sim_server("zlab", 0.05, 0, "--error-rate", "0.3", "--disconnect-fraction", "0.3") as faulty, \
            sim_server("zlab", 1.0, 0, "--stall-fraction", "1.0", "--stall-s", "30") as stalled:
        loadtest(tmp_path, "--arm", f"faulty={faulty}", "--num-requests", "60", "--warmup", "0", "--concurrency", "8",
                 "--max-new-tokens", "64", "--name", "f", "--quiet", "--max-error-rate", "1")
        loadtest(tmp_path, "--arm", f"stalled={stalled}", "--num-requests", "4", "--warmup", "0", "--concurrency",
                 "4", "--max-new-tokens", "64", "--request-timeout", "1", "--name", "s", "--quiet",
                 "--max-error-rate", "1")
        with refusing_port() as gone:
            started = time.monotonic()
            refused = loadtest(tmp_path, "--arm", f"gone={url_of(gone)}", "--concurrency", "1", "--quiet", check=False)
            refused_s = time.monotonic() - started  # a start and a failure at once: what a loaded machine adds
            gone.listen()  # accepts, never answers: the probe waits as long as a request may, not a fixed 10 s
            started = time.monotonic()
            mute = loadtest(tmp_path, "--arm", f"mute={url_of(gone)}", "--concurrency", "1", "--quiet",
                            "--request-timeout", "1", check=False)
            mute_s = time.monotonic() - started
        with refusing_port() as silent:
            silent.listen()
            waiting = subprocess.Popen(dfserve_argv("loadtest", "run", "--out", str(tmp_path), "--arm",
                                                    f"mute={url_of(silent)}", "--concurrency", "1", "--quiet"),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            silent.settimeout(60)
            probe, _ = silent.accept()  # asking for /server_info, as long as a request may take (600 s): Ctrl-C
            with probe:  # sent as the connection is made, which asyncio.wait_for used to swallow
                waiting.send_signal(signal.SIGINT)
                _, interrupted = waiting.communicate(timeout=20)
    kinds = [r.error_kind for r in records(tmp_path / "f")]
    assert 5 <= kinds.count("http_status") <= 35 and 5 <= kinds.count("disconnect") <= 35 and None in kinds
    assert all(r.http_status == 500 for r in records(tmp_path / "f") if r.error_kind == "http_status")
    assert {r.error_kind for r in records(tmp_path / "s")} == {"timeout"}
    assert refused.returncode == 2 and "does not answer" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert mute.returncode == 2 and "mute=" in mute.stderr and "does not answer" in mute.stderr
    assert mute_s - refused_s < 6, (mute_s, refused_s)
    assert waiting.returncode == 2 and interrupted == ("dfserve: error: stopped while asking the arms' servers for "
                                                       "their documents; nothing was sent\n")


@pytest.mark.parametrize("api", ["native", "chat", "completions"])
def test_errors_in_band_through_the_gateway_are_errors_in_records_metrics_and_verdict(tmp_path: Path, api: str) -> None:
    """A candidate engine aborts a third of its streams after they started (HTTP 200, then the error in band, as
    SGLang 0.5.23 does for a request retracted without a KV backup). Through the gateway, every one of them must be
    a failure in requests.jsonl, in the gateway's /metrics, and in the judge's error rate."""
    with sim_server("zlab", 0.02, 0) as baseline, \
            sim_server("zlab", 0.02, 0, "--abort-fraction", "0.3", "--draft-model-path", "/models/ours") as candidate:
        config = tmp_path / "gateway.yaml"
        config.write_text(json.dumps({"arms": {"baseline": {"weight": 1, "replicas": [baseline]},
                                               "candidate": {"weight": 0, "replicas": [candidate]}},
                                      "scrape": {"enabled": False}}))
        with gateway_server(config) as gw:
            result = loadtest(tmp_path, "--arm", f"baseline={gw}", "--arm", f"candidate={gw}", "--pin-arms",
                              "--api", api, "--num-requests", "60", "--warmup", "0", "--concurrency", "8",
                              "--max-new-tokens", "64", "--name", "r", "--quiet", check=False)
            metrics = httpx.get(gw + "/metrics").text
    failed = [r for r in records(tmp_path / "r") if not r.ok]
    assert result.returncode == 4, result.stderr  # the error rate is over --max-error-rate's default
    assert f"candidate failed {len(failed)} of 60" in result.stderr and "stream_error=" in result.stderr
    assert failed and {r.arm for r in failed} == {"candidate"}
    assert all((r.error_kind, r.http_status, r.error_code) == ("stream_error", 200, 503) for r in failed)
    labels = f'arm="candidate",error="stream_error",replica="{candidate}",route="{api}",status="5xx"'
    assert f"dfserve_requests_total{{{labels}}} {float(len(failed))}" in metrics
    compare(str(tmp_path / "r"), "--out", str(tmp_path / "v"))
    verdict = json.loads(next((tmp_path / "v").glob("verdict-*/verdict.json")).read_text())
    [error_rate] = [m for m in verdict["judgement"]["metrics"] if m["metric"] == "error_rate"]
    assert error_rate["baseline"] == 0 and error_rate["candidate"] == pytest.approx(len(failed) / 60)
