"""Start real servers on loopback for integration tests: free port, subprocess, wait for health, always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from dfserve.listen import wait_healthy

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve(argv: Sequence[str], health_url: str, log: Path | None = None, timeout_s: float = 30.0,
          env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run `argv` in a process group of its own until the block ends; SIGTERM to the group, SIGKILL after 5 s."""
    out = log.open("wb") if log else subprocess.DEVNULL
    process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, **env} if env else None)
    try:
        failure = wait_healthy(health_url, process, timeout_s)
        if failure is not None:
            raise RuntimeError(f"{argv[0]} {failure}")
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):  # the leader may be gone while its workers are not
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if log:
            out.close()  # type: ignore[union-attr]


def dfserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "dfserve", *args]


@contextlib.contextmanager
def sim_server(profile: str = "zlab", time_scale: float = 0.02, seed: int = 0, *extra: str) -> Iterator[str]:
    """A simulated SGLang engine on a free loopback port; yields its base URL."""
    port = free_port()
    argv = dfserve_argv(
        "sim", "--host", LOOPBACK, "--port", str(port), "--profile", profile,
        "--time-scale", str(time_scale), "--seed", str(seed), *extra,
    )
    base = f"http://{LOOPBACK}:{port}"
    with serve(argv, f"{base}/health"):
        yield base


@contextlib.contextmanager
def gateway_server(config: Path, *extra: str, log: Path | None = None) -> Iterator[str]:
    """`dfserve gateway --config CONFIG` on a free loopback port; yields its base URL."""
    port = free_port()
    argv = dfserve_argv("gateway", "--config", str(config), "--host", LOOPBACK, "--port", str(port), *extra)
    base = f"http://{LOOPBACK}:{port}"
    with serve(argv, f"{base}/health", log=log):
        yield base


@contextlib.contextmanager
def prometheus_server(config: Path, data: Path, log: Path | None = None) -> Iterator[str]:
    """Debian's `prometheus` with `config`, storing into `data`, on a free loopback port; yields its base URL."""
    port = free_port()
    argv = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}",
            f"--web.listen-address={LOOPBACK}:{port}", "--log.level=warn"]
    base = f"http://{LOOPBACK}:{port}"
    with serve(argv, f"{base}/-/ready", log=log):
        yield base


@contextlib.contextmanager
def pushgateway_server(log: Path | None = None) -> Iterator[str]:
    """Debian's `prometheus-pushgateway` on a free loopback port; yields its base URL."""
    port = free_port()
    base = f"http://{LOOPBACK}:{port}"
    with serve(["prometheus-pushgateway", f"--web.listen-address={LOOPBACK}:{port}"], f"{base}/-/ready", log=log):
        yield base
