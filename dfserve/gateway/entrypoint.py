"""The gateway assembled and served: the library's entry point behind `dfserve gateway` (`gateway.cli` parses flags,
builds a `GatewayConfig` and calls `serve`), and what a test or another front end calls to run one in-process.

Both listeners (`gateway.server`) share one event loop; uvloop sets TCP_NODELAY on every accepted socket (and
asyncio on the upstream connections of `dfserve.http1`), so no chunk waits for a delayed ACK. SIGINT/SIGTERM stop
it, giving the answers under way up to 10 s to finish; SIGHUP re-reads the config (`gateway.watch.reload_routing`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from dfserve.capture.gateway import CaptureObserver
from dfserve.gateway.admin import MAX_ADMIN_BODY_BYTES, MAX_ADMIN_CONNECTIONS, AdminApp
from dfserve.gateway.app import Gateway, GatewayApp
from dfserve.gateway.config import GatewayConfig
from dfserve.gateway.observers import Observer, build
from dfserve.gateway.server import Server, ServerLimits
from dfserve.gateway.watch import ConfigWatcher, reload_routing
from dfserve.listen import announce, bind, raise_open_files_limit
from dfserve.metrics import REFUSAL_REASONS, ShadowDecisionMetrics
from dfserve.shadow.monitor import DecidingRecorder, LiveDecision
from dfserve.shadow.recorder import ShadowRecorder
from dfserve.shadow.verdict import live_design

log = logging.getLogger("dfserve.gateway")


def assemble(config: GatewayConfig, observers: Mapping[str, Observer] | None = None) -> Gateway:
    """The gateway's live state with its observers: metrics, the capture and the shadow records where configured,
    each of `config.observers` (named by kind), then `observers` (named by key); a kind that is not registered is
    refused naming its field."""
    gateway = Gateway(config)
    if config.capture is not None:
        gateway.observers.add("capture", CaptureObserver.of_policy(config.capture),
                              queue_size=config.capture.queue_size)
    if config.shadow is not None:
        gateway.observers.add("shadow", _shadow_observer(gateway, config), queue_size=config.shadow.queue_size)
    for index, entry in enumerate(config.observers):
        observer = build(entry.kind, entry.options, f"observers.{index}.kind")
        gateway.observers.add(entry.kind, observer, queue_size=entry.queue_size)
    for name, observer in (observers or {}).items():
        gateway.observers.add(name, observer)
    return gateway


def _shadow_observer(gateway: Gateway, config: GatewayConfig) -> Observer:
    """The shadow recorder; with `until_decided`, deciding as it records (`shadow.monitor`)."""
    policy, routing = config.shadow, config.routing
    assert policy is not None
    primary = routing.primary or ""
    deciding = live_design(policy, routing.arms, primary)
    recorder = ShadowRecorder(policy, primary, {name: arm.replicas[0] for name, arm in routing.arms.items()
                                                if arm.replicas}, deciding)
    if deciding is None:
        return recorder
    # the recorder writes a request whose exchange was lost max_pending requests later: the decision waits longer
    decision = LiveDecision(deciding[0], deciding[1], 2 * policy.max_pending)
    return DecidingRecorder(recorder, decision, ShadowDecisionMetrics.build(gateway.registry), gateway.stop_mirroring)


async def serve(config: GatewayConfig, reload: Callable[[], GatewayConfig] | None = None,
                watched: Path | None = None, observers: Mapping[str, Observer] | None = None) -> None:
    """Run the gateway listener and, when configured, the admin listener, until SIGINT/SIGTERM.

    SIGHUP calls `reload` and applies the routing it returns, atomically; a bad file is refused in one log line,
    counted, and changes nothing. With `config.watch_interval_s`, the file `watched` is also polled for new routing
    (`gateway.watch`). `observers` are added to the configured ones (`assemble`).
    """
    token = config.admin_token()
    gateway = assemble(config, observers)
    watch = config.watch_interval_s is not None and watched is not None and reload is not None
    limits = config.limits
    client_limits = ServerLimits(max_body_bytes=limits.max_body_bytes, max_connections=limits.max_connections,
                                 head_timeout_s=limits.head_timeout_s, body_timeout_s=limits.body_timeout_s,
                                 idle_timeout_s=limits.idle_timeout_s)
    _raise_descriptor_limit(limits.max_connections)
    metrics = gateway.metrics
    refusals = {reason: metrics.child(metrics.client_connections_refused, reason) for reason in REFUSAL_REASONS}
    listeners = [(Server(GatewayApp(gateway), client_limits, lambda reason: refusals[reason].inc(),
                         lambda status: metrics.child(metrics.answered_by_gateway, str(status)).inc()),
                  bind(config.host, config.port))]
    if config.admin.port is not None and token is not None:
        admin_limits = replace(client_limits, max_body_bytes=MAX_ADMIN_BODY_BYTES,
                               max_connections=MAX_ADMIN_CONNECTIONS)
        listeners.append((Server(AdminApp(gateway, token, watched if watch else None), admin_limits),
                          bind(config.admin.host, config.admin.port, "admin.")))
    for (_, sock), name in zip(listeners, ("dfserve gateway", "dfserve gateway admin"), strict=False):
        announce(name, sock)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_routing, gateway, reload, str(watched))
    await gateway.start()
    if watch:
        assert watched is not None and reload is not None and config.watch_interval_s is not None
        gateway.spawn(ConfigWatcher(watched, reload, gateway, config.watch_interval_s).run())
    gc.collect()
    gc.freeze()  # start-up objects (imports, config, metrics) never need scanning again: short full collections
    try:
        for server, sock in listeners:
            await server.start(sock)
        await stopping.wait()
    finally:
        await asyncio.gather(*(server.stop() for server, _ in listeners))
        await gateway.stop()


_OTHER_DESCRIPTORS = 128
"""Descriptors besides client connections and their upstream ones: listeners, admin connections, health checks,
scrapes, logs."""


def _raise_descriptor_limit(max_connections: int) -> None:
    """Each client connection may hold an upstream one, and as many refused ones may linger (`gateway.server`). Past
    the process's descriptor limit the event loop accepts and drops connections, so the soft limit is raised as far
    as the hard one allows, and a limit still too low for `max_connections` is said at start."""
    wanted = 3 * max_connections + _OTHER_DESCRIPTORS
    allowed = raise_open_files_limit(wanted)
    if allowed < wanted:
        log.warning("limits.max_connections: %d client connections may need %d open descriptors, but this process may "
                    "open %d (ulimit -n); lower limits.max_connections to %d or raise the limit",
                    max_connections, wanted, allowed, max(1, (allowed - _OTHER_DESCRIPTORS) // 3))
