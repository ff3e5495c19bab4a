"""`dfserve demo` end to end: real processes on loopback, a verdict, a run folder, and nothing left running."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEMO_ARGS = ("--num-requests", "24", "--concurrency", "8", "--max-new-tokens", "64", "--time-scale", "0.2")


def port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, int(port))) == 0


def engine_pids(out: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in (out / "demo" / "deployments").glob("*/start-*/record.json")]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_demo_judges_the_candidate_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    result = subprocess.run([sys.executable, "-m", "dfserve", "demo", "--out", str(out), *DEMO_ARGS],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "SIMULATED" in result.stdout
    assert "verdict: FAIL" in result.stdout
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
    records = [json.loads(line) for line in (runs[0] / "requests.jsonl").read_text().splitlines()]
    assert {r["arm"] for r in records} == {"baseline", "candidate"}
    verdict = json.loads((verdicts[0] / "verdict.json").read_text())
    assert verdict["verdict"] == "FAIL"
    failed = {rule["metric"] for rule in verdict["judgement"]["rules"] if rule["status"] == "FAIL"}
    assert "accept_length" in failed
    gateway = re.search(r"gateway: (http://127\.0\.0\.1:\d+)", result.stdout)
    assert gateway and not port_open(gateway.group(1))
    pids = engine_pids(out)
    assert len(pids) == 2 and not any(pid_alive(pid) for pid in pids)


def test_demo_keep_running_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    argv = [sys.executable, "-m", "dfserve", "demo", "--out", str(out), "--keep-running", *DEMO_ARGS]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        gateway, pids = _interrupt_when_up(process, out)
    assert not port_open(gateway)
    assert not any(pid_alive(pid) for pid in pids)


def _interrupt_when_up(process: subprocess.Popen[str], out: Path) -> tuple[str, list[int]]:
    """Wait for the demo's "press Ctrl-C", check the stack is up, press Ctrl-C, check the exit status."""
    assert process.stdout is not None
    lines = []
    deadline = time.monotonic() + 150
    try:
        for line in process.stdout:
            lines.append(line)
            if "press Ctrl-C" in line or time.monotonic() > deadline:
                break
        text = "".join(lines)
        assert "scrape_configs:" in text
        gateway = re.search(r"gateway: (http://127\.0\.0\.1:\d+)", text)
        assert gateway and port_open(gateway.group(1))
        pids = engine_pids(out)
        assert len(pids) == 2 and all(pid_alive(pid) for pid in pids)
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return gateway.group(1), pids


@pytest.mark.parametrize("flag", ["--num-requests", "--concurrency"])
def test_demo_refuses_nonsense_counts(flag: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "dfserve", "demo", "--out", str(tmp_path), flag, "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "must be at least 1" in result.stderr
