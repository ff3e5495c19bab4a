"""Run one simulated engine: uvicorn with uvloop and httptools, one process, TCP_NODELAY on every connection.

    run(SimConfig(port=30000, profile="zlab"))
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dfserve.deploy.sim.app import build_app
from dfserve.deploy.sim.config import SimConfig
from dfserve.deploy.sim.faults import SimulatedDisconnect
from dfserve.deploy.sim.profiles import load_profile
from dfserve.deploy.sim.text import Vocabulary
from dfserve.listen import announce, bind


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    """Sets TCP_NODELAY explicitly, so a small SSE chunk never waits for the peer's delayed ACK (~40 ms)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


class _QuietDisconnects(logging.Filter):
    """A simulated disconnect is a feature, not a server error: keep it out of the error log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], SimulatedDisconnect))


def uvicorn_config(config: SimConfig) -> uvicorn.Config:
    """Build everything up front (profile, tokenizer, app), so bad input fails before the port opens."""
    profile = load_profile(config.profile)
    if profile is not None and config.block_size is not None:
        profile = profile.with_block_size(config.block_size)
    app = build_app(config, profile, Vocabulary.load())
    return uvicorn.Config(
        app, host=config.host, port=config.port, loop="uvloop", http=NoDelayHttpToolsProtocol,
        lifespan="on", access_log=False, log_level="warning", timeout_graceful_shutdown=1,
    )


def run(config: SimConfig) -> None:
    server_config = uvicorn_config(config)
    sock = bind(config.host, config.port)
    announce(f"dfserve sim (profile {config.profile}, time scale {config.time_scale:g}, seed {config.seed})", sock)
    serve(server_config, sock)


def serve(server_config: uvicorn.Config, sock: socket.socket) -> None:
    """Serve a built configuration on a bound socket until SIGINT/SIGTERM."""
    server = uvicorn.Server(server_config)
    logging.getLogger("uvicorn.error").addFilter(_QuietDisconnects())
    gc.collect()
    gc.freeze()  # start-up objects never need scanning again; keeps full collections short on the hot path
    server.run(sockets=[sock])
