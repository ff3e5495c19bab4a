"""Start real servers on loopback for integration tests: each binds port 0 and says which port it got (read back
from its log), runs in a process group of its own, and is always stopped.

    with sim_server("zlab", 0.02, 0) as url: ...
    with serve(dfserve_argv("gateway", "--config", path, "--port", "0")) as started: started.url, started.process
    with refusing_port() as sock: url_of(sock)   # an address that refuses connections and stays ours
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from dfserve.listen import LISTENING, url_of, wait_healthy, wait_listening

LOOPBACK = "127.0.0.1"
GO_LISTENING = re.compile(r'msg="Listening on" address=(\S+:\d+)')
"""How Prometheus and the Pushgateway (Go's exporter-toolkit) say where they listen."""


@dataclass(frozen=True)
class Started:
    url: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def serve(argv: Sequence[str], log: Path | None = None, health_path: str = "/health",
          pattern: re.Pattern[str] = LISTENING, timeout_s: float = 30.0,
          env: dict[str, str] | None = None, url: str | None = None) -> Iterator[Started]:
    """Run `argv` (a server told to listen on port 0) until the block ends: wait for the line saying where it
    listens (unless `url` says where: a peer's server that only takes a fixed port, in a benchmark), then for
    `health_path` to answer 200. SIGTERM to its process group after, SIGKILL after 5 s."""
    with contextlib.ExitStack() as stack:
        if log is None:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dfserve-server-"))) / "server.log"
        out = stack.enter_context(log.open("wb"))
        process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **env} if env else None)
        stack.callback(_stop, process)
        try:
            url = url or wait_listening(log, process.poll, timeout_s, pattern)
        except RuntimeError as exc:
            raise RuntimeError(f"{argv[0]} {exc}: {log.read_text(errors='replace')[-2000:]}") from None
        failure = wait_healthy(url + health_path, process, timeout_s)
        if failure is not None:
            raise RuntimeError(f"{argv[0]} {failure}")
        yield Started(url, process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the leader may be gone while its workers are not
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def refusing_port() -> Iterator[socket.socket]:
    """A loopback socket bound to a free port but not listening: connections to it are refused, and no other
    process can take the port while the block runs (a dead replica's address). `listen()` on it, or a server that
    adopts it, brings the address to life."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        yield sock


def sglang_port() -> int:
    """A port for `dfserve deploy --engine sglang` (stand-in engines): SGLang needs a port it is told, so these tests
    choose one; every other server here takes port 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def dfserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "dfserve", *args]


def sim_argv(profile: str = "zlab", time_scale: float = 0.02, seed: int = 0, *extra: str) -> list[str]:
    return dfserve_argv("sim", "--host", LOOPBACK, "--port", "0", "--profile", profile,
                        "--time-scale", str(time_scale), "--seed", str(seed), *extra)


@contextlib.contextmanager
def sim_server(profile: str = "zlab", time_scale: float = 0.02, seed: int = 0, *extra: str) -> Iterator[str]:
    """A simulated SGLang engine on loopback; yields its base URL."""
    with serve(sim_argv(profile, time_scale, seed, *extra)) as started:
        yield started.url


def gateway_argv(config: Path, *extra: str) -> list[str]:
    return dfserve_argv("gateway", "--config", str(config), "--host", LOOPBACK, "--port", "0", *extra)


@contextlib.contextmanager
def gateway_server(config: Path, *extra: str, log: Path | None = None) -> Iterator[str]:
    """`dfserve gateway --config CONFIG` on loopback; yields its base URL."""
    with serve(gateway_argv(config, *extra), log=log) as started:
        yield started.url


@contextlib.contextmanager
def prometheus_server(config: Path, data: Path, log: Path | None = None) -> Iterator[str]:
    """Debian's `prometheus` with `config`, storing into `data`, on loopback; yields its base URL."""
    argv = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}",
            f"--web.listen-address={LOOPBACK}:0", "--log.level=info"]
    with serve(argv, log, "/-/ready", GO_LISTENING) as started:
        yield started.url


@contextlib.contextmanager
def pushgateway_server(log: Path | None = None) -> Iterator[str]:
    """Debian's `prometheus-pushgateway` on loopback; yields its base URL."""
    argv = ["prometheus-pushgateway", f"--web.listen-address={LOOPBACK}:0",
            "--persistence.file="]  # Debian's default file would carry pushes over from earlier tests
    with serve(argv, log, "/-/ready", GO_LISTENING) as started:
        yield started.url


__all__ = ["LOOPBACK", "Started", "dfserve_argv", "gateway_argv", "gateway_server", "prometheus_server",
           "pushgateway_server", "refusing_port", "serve", "sglang_port", "sim_argv", "sim_server", "url_of"]
