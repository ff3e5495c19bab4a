"""Running an engine for a spec: SGLang's argv, its validation by SGLang's own parser, and process supervision.

One supervisor serves both engines: SGLang (`python -m sglang.launch_server ...`) and the simulator. It starts the
engine in its own session with its log in the deployment folder, waits for `/health_generate`, and writes a
`DeploymentRecord` (spec, resolved `/server_info`, `/model_info`, drafter hash, times). `status` and `stop` work from
that record alone, in a later process::

    record = start(spec, launch_argv(spec, "python3"), deployment_dir, health_timeout_s=1800)
    stop(deployment_dir)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict

from dfserve import __version__
from dfserve.deploy.spec import DeploymentSpec, server_args, sim_argv
from dfserve.errors import UserError
from dfserve.listen import wait_listening
from dfserve.runs import create_run_dir, utc_now_iso, write_model
from dfserve.sglang import parse_server_info

CHECK_SCRIPT = Path(__file__).with_name("sglang_check.py")
LOG_NAME = "engine.log"
RECORD_NAME = "record.json"
STOPPED_NAME = "stopped.json"
LOG_LINES_SHOWN = 5


def launch_argv(spec: DeploymentSpec, python: str) -> list[str]:
    """The command for the spec's engine; `python` is SGLang's interpreter (or a stand-in with the same CLI)."""
    if spec.engine == "sim":
        return sim_argv(spec)
    return [python, "-m", "sglang.launch_server", *server_args(spec)]


def launch_env(spec: DeploymentSpec) -> dict[str, str]:
    """Variables added to the engine's environment (SGLang's; the simulator ignores them)."""
    return dict(spec.env)


# ---------------------------------------------------------------------------------------------------------------
# --check


class CheckResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ok: bool
    version: str
    problems: list[str]
    resolved: dict[str, Any]


def check_with_sglang(spec: DeploymentSpec, python: str, timeout_s: float = 120.0) -> CheckResult:
    """Run `dfserve/deploy/sglang_check.py` under SGLang's interpreter on the spec's server arguments."""
    if shutil.which(python) is None:
        raise UserError(f"--sglang-python: {python} not found; --check needs the interpreter SGLang is installed in")
    request = json.dumps({"argv": server_args(spec)})
    try:
        done = subprocess.run(
            [python, str(CHECK_SCRIPT)], input=request, capture_output=True, text=True, timeout=timeout_s, check=False,
            env={**os.environ, **launch_env(spec)},  # the profile's variables decide SGLang's platform (cpu.yaml)
        )
    except subprocess.TimeoutExpired:
        raise UserError(f"--check: SGLang's parser did not answer within {timeout_s:.0f} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("DFSERVE-SGLANG-CHECK ")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"--check: SGLang's parser could not run under {python} (exit {done.returncode}): {last}")
    return CheckResult.model_validate_json(lines[-1].removeprefix("DFSERVE-SGLANG-CHECK "))


# ---------------------------------------------------------------------------------------------------------------
# Supervision


class LaunchRecord(BaseModel):
    """Written before the engine starts, so a start that never became healthy still says what was run."""

    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = 1
    spec: DeploymentSpec
    argv: list[str]
    env: dict[str, str]


class DeploymentRecord(LaunchRecord):
    """What was started and what the engine reported once healthy; written once per start."""

    pid: int
    process_start_ticks: int
    log: str
    started_at: str
    healthy_at: str
    startup_s: float
    drafter_sha256: str | None
    simulated: bool
    engine_version: str | None
    server_info: dict[str, Any]
    model_info: dict[str, Any]
    dfserve_version: str


class StopRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = 1
    stopped_at: str
    forced: bool
    was_running: bool


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def is_alive(record: DeploymentRecord) -> bool:
    return process_start_ticks(record.pid) == record.process_start_ticks


def tail(path: Path, lines: int = LOG_LINES_SHOWN) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept) or "(empty log)"


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> int:
    """Start `argv` in a new session, stdin from /dev/null, stdout and stderr to `log`; returns its pid.

    posix_spawn rather than Popen: the engine outlives this process, and a Popen object would warn at exit.
    """
    executable = shutil.which(argv[0])
    if executable is None:
        raise UserError(f"engine command {argv[0]!r} not found")
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    return os.posix_spawn(executable, argv, {**os.environ, **env}, file_actions=actions, setsid=True)


def _exited(pid: int) -> int | None:
    """The exit status of our child if it has ended (reaping it), else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return -1
    return os.waitstatus_to_exitcode(status) if done else None


def _get_json(client: httpx.Client, url: str) -> dict[str, Any]:
    response = client.get(url, timeout=10.0)
    response.raise_for_status()
    data = response.json()
    if not isinstance(data, dict):
        raise UserError(f"{url}: expected a JSON object")
    return data


def _terminate(pid: int, grace_s: float, ticks: int | None) -> bool:
    """SIGTERM the process group, SIGKILL it after `grace_s`; returns whether it had to be forced."""
    def gone() -> bool:
        _exited(pid)
        return process_start_ticks(pid) != ticks

    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if gone():
            return False
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    while not gone():
        time.sleep(0.05)
    return True


def start(
    spec: DeploymentSpec, argv: list[str], deployment_dir: Path, *, health_timeout_s: float, grace_s: float = 10.0
) -> DeploymentRecord:
    """Start the engine, wait until `/health_generate` answers 200, record what it reports; stop it on failure."""
    start_dir = create_run_dir(deployment_dir, prefix="start")
    log = start_dir / LOG_NAME
    env = launch_env(spec)
    write_model(start_dir / "launch.json", LaunchRecord(spec=spec, argv=argv, env=env))
    started = time.monotonic()
    started_at = utc_now_iso()
    pid = _spawn(argv, env, log)
    ticks = process_start_ticks(pid) or 0
    if spec.port == 0:
        spec = spec.model_copy(update={"port": _announced_port(pid, log, health_timeout_s, grace_s, ticks)})
    url = f"{spec.base_url}/health_generate"
    with httpx.Client() as client:
        while True:
            code = _exited(pid)
            if code is not None:
                raise UserError(f"engine exited with status {code} before {url} answered; last log lines: {tail(log)} (log: {log})")
            if time.monotonic() - started > health_timeout_s:
                _terminate(pid, grace_s, ticks)
                raise UserError(f"engine not healthy after {health_timeout_s:.0f} s at {url}; stopped it; last log lines: {tail(log)} (log: {log})")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url, timeout=5.0).status_code == 200:
                    break
            time.sleep(0.1)
        healthy_at = utc_now_iso()
        startup_s = time.monotonic() - started
        try:
            server_info = _get_json(client, f"{spec.base_url}/server_info")
            model_info = _get_json(client, f"{spec.base_url}/model_info")
        except (httpx.HTTPError, ValueError) as exc:
            _terminate(pid, grace_s, ticks)
            raise UserError(f"engine at {spec.base_url} is healthy but /server_info or /model_info failed ({exc}); stopped it") from None
    info = parse_server_info(server_info)
    record = DeploymentRecord(
        spec=spec, argv=argv, env=env, pid=pid, process_start_ticks=ticks, log=str(log), started_at=started_at,
        healthy_at=healthy_at, startup_s=round(startup_s, 3), drafter_sha256=spec.drafter.sha256,
        simulated=info.simulated, engine_version=info.version, server_info=server_info, model_info=model_info,
        dfserve_version=__version__,
    )
    write_model(start_dir / RECORD_NAME, record)
    return record


def _announced_port(pid: int, log: Path, timeout_s: float, grace_s: float, ticks: int) -> int:
    """The port a simulated engine started with `--port 0` says it got (`dfserve.listen.announce`)."""
    try:
        url = wait_listening(log, lambda: _exited(pid), timeout_s)
    except RuntimeError as exc:
        _terminate(pid, grace_s, ticks)
        raise UserError(f"engine {exc}; last log lines: {tail(log)}") from None
    return int(url.rsplit(":", 1)[1])


def latest_start(deployment_dir: Path) -> Path:
    if not deployment_dir.is_dir():
        raise UserError(f"deployment {deployment_dir.name}: no such deployment under {deployment_dir.parent}")
    starts = sorted(p for p in deployment_dir.iterdir() if p.is_dir() and p.name.startswith("start-"))
    if not starts:
        raise UserError(f"deployment {deployment_dir.name}: never started")
    return starts[-1]


def read_record(start_dir: Path) -> DeploymentRecord:
    path = start_dir / RECORD_NAME
    if not path.is_file():
        raise UserError(f"deployment {start_dir.parent.name}: its last start ({start_dir.name}) never became healthy; see {start_dir / LOG_NAME}")
    return DeploymentRecord.model_validate_json(path.read_text(encoding="utf-8"))


State = Literal["healthy", "unhealthy", "stopped", "exited"]


def status(deployment_dir: Path) -> tuple[DeploymentRecord, State]:
    """The last start's record and what the engine is doing now."""
    start_dir = latest_start(deployment_dir)
    record = read_record(start_dir)
    if (start_dir / STOPPED_NAME).is_file():
        return record, "stopped"
    if not is_alive(record):
        return record, "exited"
    try:
        healthy = httpx.get(f"{record.spec.base_url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        healthy = False
    return record, "healthy" if healthy else "unhealthy"


def running(deployment_dir: Path) -> DeploymentRecord | None:
    """The record of the deployment's last start if its engine is still alive."""
    starts = sorted(deployment_dir.glob("start-*")) if deployment_dir.is_dir() else []
    if not starts or not (starts[-1] / RECORD_NAME).is_file() or (starts[-1] / STOPPED_NAME).is_file():
        return None
    record = read_record(starts[-1])
    return record if is_alive(record) else None


def stop(deployment_dir: Path, grace_s: float = 30.0) -> tuple[StopRecord, bool]:
    """Stop the last start: SIGTERM to its process group, SIGKILL after `grace_s`. Idempotent: a second call
    returns the first call's record and False (nothing was done now)."""
    start_dir = latest_start(deployment_dir)
    record = read_record(start_dir)
    stopped = start_dir / STOPPED_NAME
    if stopped.is_file():
        return StopRecord.model_validate_json(stopped.read_text(encoding="utf-8")), False
    running = is_alive(record)
    forced = _terminate(record.pid, grace_s, record.process_start_ticks) if running else False
    result = StopRecord(stopped_at=utc_now_iso(), forced=forced, was_running=running)
    write_model(stopped, result)
    return result, True
