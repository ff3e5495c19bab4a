"""Listening sockets bound before a server starts: a taken port is one clear line naming the flag, not a traceback.

    sock = bind("127.0.0.1", 8080, "--port")
    await uvicorn.Server(config).serve(sockets=[sock])
"""

from __future__ import annotations

import errno
import socket

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
