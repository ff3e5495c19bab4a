"""Holding an engine's port from the moment dfserve picks it until the engine listens on it.

An engine binds its port itself (SGLang takes `--port N`; it cannot be handed a socket), often minutes after it is
started (SGLang loads the weights first). `hold_port` binds the port, or a free one for port 0, with SO_REUSEADDR and
without listening, and keeps it bound while the engine starts: Linux then lets a socket that also sets SO_REUSEADDR
(SGLang's HTTP server and its own port check, the simulator) bind and listen on it, while the kernel's choice of a
free port, outgoing connections and any binder without SO_REUSEADDR pass it by. Closed once the engine answers::

    with hold_port("127.0.0.1", 0) as port:
        start_engine(port)        # binds and listens on `port`
        wait_until_healthy(port)
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from dfserve.errors import FieldError


@contextmanager
def hold_port(host: str, port: int) -> Iterator[int]:
    """Bind `host:port` (a free port for 0) without listening for as long as the block runs; yields the port."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise FieldError("host", f"cannot listen on {host} ({exc.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise FieldError("port", f"{host}:{port} is already in use; pick another {{other}} or stop that server",
                                 other="port") from None
            raise FieldError("port", f"cannot listen on {host}:{port} ({exc.strerror})") from None
        yield int(sock.getsockname()[1])
