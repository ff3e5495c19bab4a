"""Servers we start: sockets bound before they start (a taken port is one clear line naming the flag, not a
traceback), the address each one got announced on one line, and waiting until one answers.

Port 0 binds a free port; the server then says which in a line that `wait_listening` reads back from its log, so
tests, the demo and `dfserve deploy --engine sim` never race for a port that another process may take first.

    sock = bind("127.0.0.1", 0)
    announce("dfserve sim", sock)                      # "dfserve sim: listening on http://127.0.0.1:41873"
    await uvicorn.Server(config).serve(sockets=[sock])
"""

from __future__ import annotations

import contextlib
import errno
import re
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from dfserve.errors import FieldError

LISTENING = re.compile(r"listening on http://(\S+:\d+)")
"""What `announce` writes; group 1 is HOST:PORT."""
BACKLOG = 2048
"""Connections the kernel completes before the server accepts them; an event loop that starts serving on a bound
socket must pass it again (`create_server(sock=..., backlog=BACKLOG)`), or it listens anew with its default of 100."""


def bind(host: str, port: int, settings: str = "") -> socket.socket:
    """A bound, listening TCP socket; a failure is a `FieldError` on the setting the user would change: the host
    when no address of this machine answers to it, else the port. `settings`: where both are set (`admin.`)."""
    host_field, port_field = f"{settings}host", f"{settings}port"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise FieldError(host_field, f"cannot listen on {host}:{port} ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise FieldError(port_field, f"{host}:{port} is already in use; pick another {{other}} or stop that "
                             "server", other=port_field) from None
        field = host_field if exc.errno == errno.EADDRNOTAVAIL else port_field
        raise FieldError(field, f"cannot listen on {host}:{port} ({exc.strerror})") from None
    return sock


def raise_open_files_limit(wanted: int) -> int:
    """Raise this process's soft limit on open descriptors towards `wanted` (never above the hard limit, never
    lowering it); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return sys.maxsize
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return max(soft, target)


def url_of(sock: socket.socket) -> str:
    """`http://HOST:PORT` of a bound socket, with the port it really got."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def announce(name: str, sock: socket.socket) -> str:
    """Write `NAME: listening on URL` to stderr (flushed) and return URL."""
    url = url_of(sock)
    print(f"{name}: listening on {url}", file=sys.stderr, flush=True)
    return url


def ensure_free(host: str, port: int) -> None:
    """Fail before anything is created if the port is taken (for servers that a child process will bind)."""
    if port != 0:
        bind(host, port).close()


def wait_listening(log: Path, exited: Callable[[], int | None], timeout_s: float,
                   pattern: re.Pattern[str] = LISTENING) -> str:
    """The `http://HOST:PORT` a starting server wrote to `log` (group 1 of `pattern` is HOST:PORT); `exited` gives
    the process's exit status once it has one. Raises `RuntimeError` saying why not: it exited first, or the line
    did not come within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(FileNotFoundError):
            found = pattern.search(log.read_text(encoding="utf-8", errors="replace"))
            if found:
                return f"http://{found.group(1)}"
        code = exited()
        if code is not None:
            raise RuntimeError(f"exited with status {code} before it said where it listens (log: {log})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"did not say where it listens within {timeout_s:g} s (log: {log})")
        time.sleep(0.02)


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
