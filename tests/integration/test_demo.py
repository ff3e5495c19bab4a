"""`dfserve demo` end to end: real processes on loopback, a verdict, a run folder, and nothing left running."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from dfserve.eval.tiny import DemoModels

DEMO_ARGS = ("--num-requests", "24", "--concurrency", "8", "--max-new-tokens", "64", "--time-scale", "0.2")


def port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, int(port))) == 0


def engine_pids(out: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in (out / "demo" / "deployments").glob("*/start-*/record.json")]


def stack_pids(out: Path) -> list[int]:
    gateway = out / "demo" / "gateway.pid"
    return engine_pids(out) + ([int(gateway.read_text())] if gateway.is_file() else [])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    """The demo's --out; whatever a failed test left running (engines, gateway) is killed afterwards."""
    runs = tmp_path / "runs"
    yield runs
    for pid in stack_pids(runs):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def demo(out: Path, *args: str) -> subprocess.Popen[str]:
    """The demo as a terminal starts it: with Ctrl-C's default action, even where the suite itself runs in a
    background job, which starts with SIGINT ignored (and a Python started so never raises KeyboardInterrupt)."""
    argv = [sys.executable, "-m", "dfserve", "demo", "--out", str(out), *args, *DEMO_ARGS]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def interrupt(process: subprocess.Popen[str]) -> None:
    """Ctrl-C, as a person would; SIGKILL only if the demo does not stop within 30 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_demo_judges_the_candidate_and_cleans_up(out: Path) -> None:
    with demo(out) as process:
        try:
            output, _ = process.communicate(timeout=180)
        finally:
            interrupt(process)
    assert process.returncode == 0, output[-2000:]
    assert "SIMULATED" in output
    assert "verdict: FAIL" in output
    runs = [p for p in out.iterdir() if p.name.startswith("run-")]
    verdicts = [p for p in out.iterdir() if p.name.startswith("verdict-")]
    assert len(runs) == 1 and len(verdicts) == 1
    for name in ("config.json", "requests.jsonl", "summary.json", "report.html"):
        assert (runs[0] / name).is_file(), name
    config = json.loads((runs[0] / "config.json").read_text())
    assert [arm["name"] for arm in config["arms"]] == ["baseline", "candidate"]
    assert config["pin_arms"] is True
    assert all(arm["simulated"] for arm in config["arms"])  # /server_info reached each engine through the gateway
    profiles = {arm["name"]: arm["server_info"]["dfserve_sim"]["profile"] for arm in config["arms"]}
    assert profiles == {"baseline": "zlab", "candidate": "inhouse"}
    drafters = {arm["name"]: arm["server_info"]["speculative_draft_model_path"] for arm in config["arms"]}
    assert drafters == {"baseline": "z-lab/Qwen3.6-27B-DFlash", "candidate": "dfserve-sim/inhouse"}
    records = [json.loads(line) for line in (runs[0] / "requests.jsonl").read_text().splitlines()]
    assert {r["arm"] for r in records} == {"baseline", "candidate"}
    verdict = json.loads((verdicts[0] / "verdict.json").read_text())
    assert verdict["verdict"] == "FAIL"
    failed = {rule["metric"] for rule in verdict["judgement"]["rules"] if rule["status"] == "FAIL"}
    assert "accept_length" in failed
    gateway = re.search(r"gateway: (http://127\.0\.0\.1:\d+)", output)
    assert gateway and not port_open(gateway.group(1))
    pids = stack_pids(out)
    assert len(pids) == 3 and not any(pid_alive(pid) for pid in pids)


def test_demo_keep_running_stops_everything_on_ctrl_c(out: Path) -> None:
    with demo(out, "--keep-running") as process:
        try:
            text = _read_until(process, "press Ctrl-C", timeout_s=150)
            assert "scrape_configs:" in text
            gateway = re.search(r"gateway: (http://127\.0\.0\.1:\d+)", text)
            assert gateway and port_open(gateway.group(1))
            pids = stack_pids(out)
            assert len(pids) == 3 and all(pid_alive(pid) for pid in pids)
        finally:
            interrupt(process)
    assert process.returncode == 130
    assert not port_open(gateway.group(1))
    assert not any(pid_alive(pid) for pid in pids)


def _read_until(process: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """The demo's output up to the line holding `marker`; fails (never hangs) when it does not come in time."""
    assert process.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    stdout = process.stdout
    threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
    text = ""
    deadline = time.monotonic() + timeout_s
    while marker not in text:
        try:
            text += lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {marker!r} within {timeout_s} s:\n{text[-2000:]}") from None
    return text


@pytest.mark.parametrize("flag", ["--num-requests", "--concurrency"])
def test_demo_refuses_nonsense_counts(flag: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "dfserve", "demo", "--out", str(tmp_path), flag, "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "must be at least 1" in result.stderr


@pytest.mark.heavy
def test_offline_demo_evaluates_tiny_models_from_its_cache(tmp_path: Path, demo_models: DemoModels) -> None:
    from dfserve.eval.tiny import build_demo

    models, out = demo_models, tmp_path / "runs"
    cache = models.folder.parent
    assert models.built and build_demo(cache) == dataclasses.replace(models, built=False)
    result = subprocess.run([sys.executable, "-m", "dfserve", "demo", "--offline", "--cache", str(cache),
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"reused: {models.folder}" in result.stdout
    assert "undertrained vs distilled: FAIL" in result.stdout
    run = Path(re.search(r"run folder:\s+(\S+)", result.stdout).group(1))  # type: ignore[union-attr]
    assert run.parent == out.resolve() and run.name.startswith("eval-")
    assert sorted(p.name for p in run.iterdir()) == ["anchors.jsonl", "config.json", "report.html", "summary.json"]
    config = json.loads((run / "config.json").read_text())
    assert [d["label"] for d in config["drafters"]] == ["distilled", "undertrained"]
    assert Path(config["features"]["path"]).is_relative_to(models.folder)
    summary = json.loads((run / "summary.json").read_text())
    tau = {d["drafter"]: d["methods"][0]["tau"]["estimate"] for d in summary["drafters"]}
    assert tau["distilled"] > 1.3 and tau["undertrained"] < 1.1
    (judgement,) = summary["judgements"]
    assert (judgement["baseline"], judgement["candidate"], judgement["verdict"]) == ("distilled", "undertrained", "FAIL")


def test_offline_demo_without_the_eval_extra_says_how_to_install_it(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from dfserve.cli import main

    monkeypatch.setitem(sys.modules, "dflash", None)  # find_spec answers None: not installed
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--offline", "--cache", str(tmp_path), "--out", str(tmp_path / "runs")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("dfserve: error: dfserve demo --offline needs dflash: "
                                       "pip install 'dfserve[eval]'\n")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("args", "message"), [
    (["--offline", "--num-requests", "8"], "--num-requests: not an option of --offline"),
    (["--offline", "--keep-running"], "--keep-running: not an option of --offline"),
    (["--cache", "somewhere"], "--cache: only --offline keeps models"),
])
def test_demo_refuses_options_of_the_other_mode(args: list[str], message: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "dfserve", "demo", "--out", str(tmp_path / "runs"), *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert not (tmp_path / "runs").exists()


def test_an_interrupted_model_build_leaves_no_folder_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dfserve.eval import tiny

    def interrupted(folder: Path, seed: int = 0) -> Path:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "qwen3_target", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny.build_demo(tmp_path)
    assert list(tmp_path.iterdir()) == []
