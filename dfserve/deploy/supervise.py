"""Starting, watching and stopping the engine of a spec, whatever its kind (`deploy.engines`).

The engine runs in its own session with its log in the deployment folder; the start holds its port until it
answers `ready_path`, then writes a `DeploymentRecord` (spec with the port served on, resolved `/server_info`,
`/model_info`, drafter hash, times). `status` and `stop` work from that record alone, in a later process::

    record = start(spec, "python3", deployment_dir, health_timeout_s=1800)
    stop(deployment_dir)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict

from dfserve import __version__
from dfserve.deploy.deployment import DeploymentSpec
from dfserve.deploy.engines import engine_kind
from dfserve.deploy.ports import hold_port
from dfserve.errors import FieldError, UserError
from dfserve.runs import create_run_dir, read_model, utc_now_iso, write_model
from dfserve.sglang import parse_server_info, printable_json

LOG_NAME = "engine.log"
RECORD_NAME = "record.json"
STOPPED_NAME = "stopped.json"
LOG_LINES_SHOWN = 5


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
        raise FieldError("sglang_python", f"engine command {argv[0]!r} not found")
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    return os.posix_spawn(executable, argv, {**os.environ, **env}, file_actions=actions, setsid=True)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C (SIGINT) within the block is raised as it ends, not where it came. A Python handler, not a blocked
    signal: a mask is the calling thread's, and a process-directed SIGINT goes to any thread that does not block it
    (numpy's BLAS workers), whose C handler then had the interrupt raised in the main thread all the same."""
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if held:
        raise KeyboardInterrupt


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
    data = printable_json(response.json())  # kept in the deployment's record
    if not isinstance(data, dict):
        raise UserError(f"{url}: expected a JSON object")
    return data


def _terminate(pid: int, grace_s: float, ticks: int | None) -> bool:
    """SIGTERM the process group, SIGKILL it after `grace_s`; returns whether it had to be forced."""
    def gone() -> bool:
        ended = process_start_ticks(pid) != ticks
        _exited(pid)  # after: one that ended in between is reaped now, not left a zombie once this process exits
        return ended

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
    spec: DeploymentSpec, python: str, deployment_dir: Path, *, health_timeout_s: float, grace_s: float = 10.0
) -> DeploymentRecord:
    """Start the spec's engine on its port (a free one for port 0, held until the engine answers), wait until its
    `ready_path` answers 200, record what it reports; stop it on any failure or interruption before it is recorded
    (Ctrl-C included: in its own session it never sees the terminal's SIGINT, and `stop` knows it only from the
    record). `python` is SGLang's interpreter."""
    kind = engine_kind(spec.engine)
    start_dir = create_run_dir(deployment_dir, prefix="start")
    log = start_dir / LOG_NAME
    # The client first: its imports and certificates take a while, and a Ctrl-C among them, once the engine runs,
    # ended this process by SIGINT rather than through its own exit.
    with hold_port(spec.host, spec.port) as port, httpx.Client() as client:
        spec = spec.model_copy(update={"port": port})
        argv, env = kind.argv(spec, python), kind.env(spec)
        write_model(start_dir / "launch.json", LaunchRecord(spec=spec, argv=argv, env=env))
        started = time.monotonic()
        started_at = utc_now_iso()
        pid, ticks = None, 0
        try:
            # Ctrl-C waits until the engine's pid is kept: between its start and this `try`, it left the engine
            # running with no record to stop it by.
            with _interrupts_held():
                pid = _spawn(argv, env, log)
                ticks = process_start_ticks(pid) or 0
            url = f"{spec.base_url}{kind.ready_path}"
            while True:
                code = _exited(pid)
                if code is not None:
                    raise UserError(f"engine exited with status {code} before {url} answered; last log lines: {tail(log)} (log: {log})")
                if time.monotonic() - started > health_timeout_s:
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
            except (httpx.HTTPError, ValueError, RecursionError) as exc:
                raise UserError(f"engine at {spec.base_url} is healthy but /server_info or /model_info failed ({exc}); stopped it") from None
            info = parse_server_info(server_info)
            record = DeploymentRecord(
                spec=spec, argv=argv, env=env, pid=pid, process_start_ticks=ticks, log=str(log), started_at=started_at,
                healthy_at=healthy_at, startup_s=round(startup_s, 3), drafter_sha256=spec.drafter.sha256,
                simulated=info.simulated, engine_version=info.version, server_info=server_info, model_info=model_info,
                dfserve_version=__version__,
            )
            write_model(start_dir / RECORD_NAME, record)
        except BaseException:
            if pid is not None:
                _terminate(pid, grace_s, ticks)
            raise
    return record


def latest_start(deployment_dir: Path) -> Path:
    if not deployment_dir.is_dir():
        raise UserError(f"deployment {deployment_dir.name}: no such deployment under {deployment_dir.parent}")
    starts = sorted(p for p in deployment_dir.iterdir() if p.is_dir() and p.name.startswith("start-"))
    if not starts:
        raise UserError(f"deployment {deployment_dir.name}: never started")
    return starts[-1]


def read_record(start_dir: Path) -> DeploymentRecord:
    missing = f"deployment {start_dir.parent.name}: its last start ({start_dir.name}) never became healthy; see {start_dir / LOG_NAME}"
    return read_model(start_dir / RECORD_NAME, DeploymentRecord, missing)


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
        alive = f"{record.spec.base_url}{engine_kind(record.spec.engine).alive_path}"
        healthy = httpx.get(alive, timeout=5.0).status_code == 200
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
        return read_model(stopped, StopRecord, f"{stopped} vanished"), False
    running = is_alive(record)
    forced = _terminate(record.pid, grace_s, record.process_start_ticks) if running else False
    result = StopRecord(stopped_at=utc_now_iso(), forced=forced, was_running=running)
    write_model(stopped, result)
    return result, True
