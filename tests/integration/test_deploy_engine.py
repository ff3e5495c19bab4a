"""The whole `--engine sglang` path with a stand-in launch command that serves the simulator, and `--engine sim`:
real child processes, health waits, records, status, graceful and forced stops, and one-line failures."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dfserve.deploy import supervise
from dfserve.deploy.drafters import resolve_target, simulated_drafter
from dfserve.deploy.ports import hold_port
from dfserve.deploy.profiles import load_profile
from dfserve.deploy.spec import build_spec
from dfserve.deploy.supervise import DeploymentRecord, _spawn, _terminate, process_start_ticks
from dfserve.errors import FieldError
from dfserve.runs import write_model
from tests.fixtures.deploy.synth import (
    STANDIN,
    TINY_DRAFTER_CONFIG,
    TINY_TARGET,
    tiny_state_dict,
    write_checkpoint,
)
from tests.integration.servers import LOOPBACK, dfserve_argv, sglang_port


def launcher(tmp_path: Path, body: str | None = None) -> str:
    """An executable used as `--sglang-python`: by default runs the stand-in for `-m sglang.launch_server`."""
    path = tmp_path / "sglang-python"
    path.write_text("#!/bin/sh\n" + (body or f'exec "{sys.executable}" "{STANDIN}" "$@"') + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def run(root: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "DFSERVE_DEPLOY_ROOT": str(root), **(env or {})}
    return subprocess.run(dfserve_argv("deploy", *args), capture_output=True, text=True, env=full_env, timeout=timeout, check=False)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dfserve: error: "), done.stderr
    return lines[0]


def record_of(root: Path, name: str) -> dict:  # type: ignore[type-arg]
    (start,) = sorted((root / name).glob("start-*"))
    return json.loads((start / "record.json").read_text())


def alive(pid: int, ticks: int) -> bool:
    return process_start_ticks(pid) == ticks


def test_sglang_engine_with_standin_start_status_stop(tmp_path: Path) -> None:
    root, port, trace = tmp_path / "root", sglang_port(), tmp_path / "trace.json"
    python = launcher(tmp_path)
    args = ("--drafter", "zlab", "--port", str(port), "--sglang-python", python, "--health-timeout", "60")
    done = run(root, *args, env={"DFSERVE_STANDIN_TRACE": str(trace)})
    assert done.returncode == 0, done.stderr
    assert f"pro6000-zlab: healthy at http://127.0.0.1:{port}" in done.stdout and "simulated" in done.stdout
    seen = json.loads(trace.read_text())
    assert seen["env"]["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] == "1"
    assert seen["argv"][seen["argv"].index("--speculative-algorithm") + 1] == "DFLASH"
    record = record_of(root, "pro6000-zlab")
    assert record["simulated"] is True and record["argv"][0] == python
    assert record["server_info"]["speculative_draft_model_path"] == "z-lab/Qwen3.6-27B-DFlash"
    assert record["model_info"]["model_path"] == "Qwen/Qwen3.6-27B"
    assert record["spec"]["served_model_name"] == "qwen3.6-27b-dflash-zlab"
    assert Path(record["log"]).is_file()
    models = httpx.get(f"http://{LOOPBACK}:{port}/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == "qwen3.6-27b-dflash-zlab"
    try:
        status = run(root, "status", "pro6000-zlab")
        assert status.returncode == 0 and status.stdout.startswith("pro6000-zlab: healthy"), status.stderr
        assert "is already in use" in one_line_error(run(root, *args))
        other_port = ("--drafter", "zlab", "--port", str(sglang_port()), "--sglang-python", python)
        assert "deployment pro6000-zlab is running" in one_line_error(run(root, *other_port))
    finally:
        stop = run(root, "stop", "pro6000-zlab", "--grace", "10")
    assert stop.returncode == 0 and "stopped (graceful)" in stop.stdout, stop.stderr
    assert not alive(record["pid"], record["process_start_ticks"])
    assert run(root, "status", "pro6000-zlab").stdout.startswith("pro6000-zlab: stopped")
    assert run(root, "stop", "pro6000-zlab").stdout.startswith("pro6000-zlab: already stopped (graceful)")


PROBE = """
import socket, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
with socket.socket() as sock:
    try:
        sock.bind(("127.0.0.1", port))
        print("free")
    except OSError:
        print("held")
"""


def test_sglang_engine_on_port_0_gets_a_free_port_held_until_it_serves(tmp_path: Path) -> None:
    root, trace, probe = tmp_path / "root", tmp_path / "trace.json", tmp_path / "probe"
    (tmp_path / "probe.py").write_text(PROBE)
    python = launcher(tmp_path, f'"{sys.executable}" "{tmp_path / "probe.py"}" "$@" > "{probe}"; '
                                f'exec "{sys.executable}" "{STANDIN}" "$@"')
    done = run(root, "--drafter", "zlab", "--port", "0", "--sglang-python", python, "--health-timeout", "60",
               env={"DFSERVE_STANDIN_TRACE": str(trace)})
    assert done.returncode == 0, done.stderr
    try:
        record = record_of(root, "pro6000-zlab")
        port = record["spec"]["port"]
        argv = json.loads(trace.read_text())["argv"]
        assert port != 0 and argv[argv.index("--port") + 1] == str(port) and probe.read_text() == "held\n"
        assert f"healthy at http://{LOOPBACK}:{port} " in done.stdout
        assert httpx.get(f"http://{LOOPBACK}:{port}/health", timeout=5).status_code == 200
        status = run(root, "status", "pro6000-zlab")
        assert f"url: http://{LOOPBACK}:{port}  pid: {record['pid']}" in status.stdout
        assert ("no content hash: z-lab's release, which SGLang loads from the Hugging Face hub as "
                "z-lab/Qwen3.6-27B-DFlash") in status.stdout and "None" not in status.stdout
    finally:
        assert "graceful" in run(root, "stop", "pro6000-zlab").stdout


def test_inhouse_checkpoint_is_staged_by_hard_link_once_and_converted_once(tmp_path: Path) -> None:
    root, port = tmp_path / "root", sglang_port()
    checkpoint = write_checkpoint(tmp_path / "train" / "checkpoint.pt", {"model": tiny_state_dict(), "step": 4000})
    args = ("--drafter", str(checkpoint), "--target", str(TINY_TARGET), "--drafter-config", str(TINY_DRAFTER_CONFIG),
            "--name", "inhouse", "--port", str(port), "--sglang-python", launcher(tmp_path), "--health-timeout", "60")
    first = run(root, *args, env={"DFSERVE_STANDIN_PROFILE": "inhouse"})
    assert first.returncode == 0, first.stderr
    staged = root / "inhouse" / "checkpoint.pt"
    assert staged.stat().st_ino == checkpoint.stat().st_ino and checkpoint.stat().st_nlink == 2
    (converted,) = (root / "drafters").glob("inhouse-*")
    weights_mtime = (converted / "model.safetensors").stat().st_mtime_ns
    record = record_of(root, "inhouse")
    assert record["drafter_sha256"] and converted.name == f"inhouse-{record['drafter_sha256'][:16]}"
    assert record["server_info"]["speculative_draft_model_path"] == str(converted)
    assert run(root, "stop", "inhouse").returncode == 0
    second = run(root, *args, env={"DFSERVE_STANDIN_PROFILE": "inhouse"})
    assert second.returncode == 0, second.stderr
    try:
        assert checkpoint.stat().st_nlink == 2  # not re-linked
        assert (converted / "model.safetensors").stat().st_mtime_ns == weights_mtime  # not re-converted
        assert len(list((root / "inhouse").glob("start-*"))) == 2  # each start recorded, none overwritten
    finally:
        assert run(root, "stop", "inhouse").returncode == 0


def test_engine_that_dies_reports_last_log_lines(tmp_path: Path) -> None:
    root = tmp_path / "root"
    done = run(root, "--drafter", "zlab", "--port", str(sglang_port()), "--sglang-python", launcher(tmp_path),
               env={"DFSERVE_STANDIN_FAIL": "1"})
    line = one_line_error(done)
    assert "engine exited with status 3 before" in line and "CUDA out of memory while loading the drafter" in line
    (start,) = (root / "pro6000-zlab").glob("start-*")
    assert (start / "engine.log").is_file() and not (start / "record.json").exists()
    assert "never became healthy" in one_line_error(run(root, "status", "pro6000-zlab"))
    retry = run(root, "--drafter", "zlab", "--port", str(sglang_port()), "--sglang-python", launcher(tmp_path))
    assert retry.returncode == 0, retry.stderr
    assert "graceful" in run(root, "stop", "pro6000-zlab").stdout


def test_engine_never_healthy_is_stopped_after_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    python = launcher(tmp_path, f'echo $$ > "{pid_file}"; echo "capturing cuda graphs"; exec sleep 60')
    started = time.monotonic()
    line = one_line_error(run(tmp_path / "root", "--drafter", "zlab", "--port", str(sglang_port()),
                              "--sglang-python", python, "--health-timeout", "1"))
    assert "not healthy after 1 s" in line and "stopped it" in line and "capturing cuda graphs" in line
    assert time.monotonic() - started < 30
    pid = int(pid_file.read_text())
    assert process_start_ticks(pid) is None


def test_busy_port_fails_first_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", tiny_state_dict())
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_line_error(run(root, "--drafter", str(checkpoint), "--target", str(TINY_TARGET),
                                  "--drafter-config", str(TINY_DRAFTER_CONFIG), "--port", str(port)))
    assert line == f"dfserve: error: --port: 127.0.0.1:{port} is already in use; pick another --port or stop that server"
    assert not root.exists()


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("nan", "fc.weight has 1 NaN and 0 Inf values"),
        ("truncated", "is not a torch checkpoint that loads with weights_only"),
        ("missing-target-config", "has no config.json"),
    ],
)
def test_bad_assets_fail_with_one_line_and_leave_nothing(tmp_path: Path, case: str, expected: str) -> None:
    root = tmp_path / "root"
    state = tiny_state_dict()
    target = TINY_TARGET
    if case == "nan":
        state["fc.weight"][0, 0] = float("nan")
    elif case == "missing-target-config":
        target = tmp_path / "target-without-config"
        target.mkdir()
    checkpoint = write_checkpoint(tmp_path / "checkpoint.pt", {"state_dict": state})
    if case == "truncated":
        checkpoint.write_bytes(checkpoint.read_bytes()[:2000])
    line = one_line_error(run(root, "--drafter", str(checkpoint), "--target", str(target),
                              "--drafter-config", str(TINY_DRAFTER_CONFIG), "--port", str(sglang_port())))
    assert expected in line
    assert not root.exists()


def test_sim_engine_uses_the_same_supervision_and_takes_a_free_port(tmp_path: Path) -> None:
    root = tmp_path / "root"
    done = run(root, "--drafter", "zlab", "--engine", "sim", "--time-scale", "0.02", "--port", "0")
    assert done.returncode == 0, done.stderr
    try:
        record = record_of(root, "pro6000-zlab-sim")
        assert record["argv"][1:4] == ["-m", "dfserve", "sim"] and record["simulated"] is True
        assert record["spec"]["sim"]["profile"] == "zlab"
        port = record["spec"]["port"]
        assert port != 0 and f"healthy at http://{LOOPBACK}:{port} " in done.stdout
        assert httpx.get(f"http://{LOOPBACK}:{port}/health", timeout=5).status_code == 200
        assert "healthy" in run(root, "status", "pro6000-zlab-sim").stdout
    finally:
        assert "graceful" in run(root, "stop", "pro6000-zlab-sim").stdout


def test_a_held_port_takes_an_engine_that_reuses_addresses_and_no_other_binder() -> None:
    with hold_port(LOOPBACK, 0) as port, socket.socket() as other, socket.socket() as engine:
        with pytest.raises(OSError):
            other.bind((LOOPBACK, port))
        engine.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        engine.bind((LOOPBACK, port))
        engine.listen()
        with pytest.raises(FieldError, match=rf"^port: {LOOPBACK}:{port} is already in use"), hold_port(LOOPBACK, port):
            pass


def test_stop_forces_a_process_that_ignores_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "log"
    pid = _spawn(["sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.1; done"], {}, log)
    ticks = process_start_ticks(pid)
    deadline = time.monotonic() + 10
    while "ready" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _terminate(pid, 0.5, ticks) is True
    assert process_start_ticks(pid) is None


@pytest.mark.parametrize("from_the_engine", [False, True], ids=["once-it-runs", "as-it-starts"])
def test_ctrl_c_while_the_engine_starts_stops_it(tmp_path: Path, from_the_engine: bool) -> None:
    """Ctrl-C from the terminal once the engine runs, or at the engine's first instant (it interrupts its parent
    itself): either way the engine is stopped and the exit is dfserve's own."""
    pid_file = tmp_path / "pid"
    interrupt = "kill -INT $PPID; " if from_the_engine else ""
    python = launcher(tmp_path, f'echo $$ > "{pid_file}.tmp"; mv "{pid_file}.tmp" "{pid_file}"; {interrupt}'
                                'exec sleep 60')
    env = {**os.environ, "DFSERVE_DEPLOY_ROOT": str(tmp_path / "root")}
    deploy = subprocess.Popen(dfserve_argv("deploy", "--drafter", "zlab", "--port", "0", "--sglang-python", python),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    pid = ticks = None
    try:
        deadline = time.monotonic() + 30
        while not pid_file.is_file():
            assert deploy.poll() is None and time.monotonic() < deadline, deploy.communicate()
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        ticks = process_start_ticks(pid)
        if not from_the_engine:
            assert ticks is not None
            deploy.send_signal(signal.SIGINT)
        _, stderr = deploy.communicate(timeout=30)
        assert deploy.returncode == 130 and "dfserve: aborted" in stderr
        assert process_start_ticks(pid) is None
    finally:
        if deploy.poll() is None:
            deploy.kill()
            deploy.wait()
        if pid is not None and ticks is not None and alive(pid, ticks):
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_the_instant_the_engine_is_spawned_still_stops_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The worst instant: the interrupt comes as the engine's pid comes back, before anything could stop it by."""
    spawned: list[int] = []

    def spawn_then_interrupt(argv: list[str], env: dict[str, str], log: Path) -> int:
        spawned.append(_spawn(["sleep", "60"], {}, log))
        os.kill(os.getpid(), signal.SIGINT)
        return spawned[-1]

    monkeypatch.setattr(supervise, "_spawn", spawn_then_interrupt)
    profile = load_profile("pro6000")
    spec = build_spec(profile, resolve_target(None, profile, None), simulated_drafter("zlab"), engine="sim", port=0)
    try:
        with pytest.raises(KeyboardInterrupt):
            supervise.start(spec, sys.executable, tmp_path / "web", health_timeout_s=30)
        assert process_start_ticks(spawned[0]) is None
    finally:
        for pid in spawned:
            if (ticks := process_start_ticks(pid)) is not None:
                _terminate(pid, 0, ticks)


def test_a_damaged_record_is_one_line_naming_the_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    start = root / "web" / "start-20250101T000000Z"
    start.mkdir(parents=True)
    record = start / "record.json"
    record.write_text('{"schema_version": 1, "pid": 12')
    for command in ("status", "stop"):
        assert one_line_error(run(root, command, "web")).startswith(f"dfserve: error: {record}: ")
    profile = load_profile("pro6000")
    spec = build_spec(profile, resolve_target(None, profile, None), simulated_drafter("zlab"), engine="sim", port=1)
    record.unlink()
    write_model(record, DeploymentRecord(
        spec=spec, argv=["engine"], env={}, pid=1, process_start_ticks=0, log="engine.log", started_at="t",
        healthy_at="t", startup_s=0.0, drafter_sha256=None, simulated=True, engine_version=None, server_info={},
        model_info={}, dfserve_version="0",
    ))
    stopped = start / "stopped.json"
    stopped.write_text('{"schema_version": 1}')
    assert one_line_error(run(root, "stop", "web")).startswith(f"dfserve: error: {stopped}: ")
