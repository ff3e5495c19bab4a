"""Servers we start: sockets bound before they start (a taken port is one clear line naming the flag, not a
traceback), and waiting until one answers.

    sock = bind("127.0.0.1", 8080, "--port")
    await uvicorn.Server(config).serve(sockets=[sock])
"""

from __future__ import annotations

import contextlib
import errno
import socket
import subprocess
import time

import httpx

from dfserve.errors import UserError


def bind(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A bound, listening TCP socket; `flag` names the option the user would change."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"{flag}: cannot listen on {host}:{port} ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"{flag}: {host}:{port} is already in use; pick another {flag} or stop that server") from None
        raise UserError(f"{flag}: cannot listen on {host}:{port} ({exc.strerror})") from None
    return sock


def ensure_free(host: str, port: int, flag: str = "--port") -> None:
    """Fail before anything is created if the port is taken (for servers that a child process will bind)."""
    bind(host, port, flag).close()


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    """Poll `url` until it answers 200; None when it does, else why not (the process exited, or time ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"exited with status {process.returncode} before {url} answered"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:  # loopback: never via a proxy
                return None
        time.sleep(0.05)
    return f"{url} did not answer within {timeout_s:g} s"
