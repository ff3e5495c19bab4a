"""`dfserve gateway`: serve the A/B gateway (and its admin listener) until SIGINT/SIGTERM, then give the answers
under way up to 10 s to finish.

Both listeners (`gateway.server`) share one uvloop event loop; uvloop sets TCP_NODELAY on every accepted socket (and
asyncio on the upstream connections of `dfserve.http1`), so no chunk waits for a delayed ACK.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from dfserve.errors import UserError
from dfserve.gateway.config import GatewayConfig, load_config, parse_arm_flag
from dfserve.listen import announce, bind, raise_open_files_limit

log = logging.getLogger("dfserve.gateway")


async def serve(config: GatewayConfig, reload: Callable[[], GatewayConfig] | None = None,
                watched: Path | None = None) -> None:
    """Run the gateway listener and, when configured, the admin listener, until SIGINT/SIGTERM.

    SIGHUP calls `reload` and applies the routing it returns, atomically; a bad file is logged and changes nothing.
    With `config.watch_interval_s`, the file `watched` is also polled for new routing (`gateway.watch`).
    """
    from dfserve.gateway.admin import MAX_ADMIN_BODY_BYTES, MAX_ADMIN_CONNECTIONS, AdminApp
    from dfserve.gateway.app import Gateway, GatewayApp
    from dfserve.gateway.server import Server, ServerLimits
    from dfserve.gateway.watch import ConfigWatcher
    from dfserve.metrics import REFUSAL_REASONS

    token = config.admin_token()
    gateway = Gateway(config)
    watch = config.watch_interval_s is not None and watched is not None and reload is not None
    limits = config.limits
    client_limits = ServerLimits(max_body_bytes=limits.max_body_bytes, max_connections=limits.max_connections,
                                 head_timeout_s=limits.head_timeout_s, body_timeout_s=limits.body_timeout_s,
                                 idle_timeout_s=limits.idle_timeout_s)
    _raise_descriptor_limit(limits.max_connections)
    metrics = gateway.metrics
    refusals = {reason: metrics.child(metrics.client_connections_refused, reason) for reason in REFUSAL_REASONS}
    listeners = [(Server(GatewayApp(gateway), client_limits, lambda reason: refusals[reason].inc()),
                  bind(config.host, config.port, "--port"))]
    if config.admin.port is not None and token is not None:
        admin_limits = replace(client_limits, max_body_bytes=MAX_ADMIN_BODY_BYTES,
                               max_connections=MAX_ADMIN_CONNECTIONS)
        listeners.append((Server(AdminApp(gateway, token, watched if watch else None), admin_limits),
                          bind(config.admin.host, config.admin.port, "--admin-port")))
    for (_, sock), name in zip(listeners, ("dfserve gateway", "dfserve gateway admin"), strict=False):
        announce(name, sock)
    stopping = asyncio.Event()

    def hangup(reload: Callable[[], GatewayConfig]) -> None:
        try:
            gateway.apply(reload().routing)
        except UserError as exc:
            log.error("reload refused, routing unchanged: %s", exc)
        else:
            log.warning("reloaded routing: %s", ", ".join(f"{n}={a.weight:g}" for n, a in gateway.routing.arms.items()))

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, hangup, reload)
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


@click.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Gateway YAML (arms, mode, limits, health, scrape, admin); flags override it.")
@click.option("--host", help="Listen address [127.0.0.1].")
@click.option("--port", type=int, help="Listen port [8080]; 0 takes a free one (the log line says which).")
@click.option("--arm", "arms", multiple=True, metavar="NAME=WEIGHT@URL[,URL...]",
              help="An arm and its replicas; repeat per arm. Replaces the config file's arms.")
@click.option("--mode", type=click.Choice(["split", "sticky", "shadow"]), help="Routing mode [split].")
@click.option("--primary", help="shadow mode: the arm whose answers clients get.")
@click.option("--shed/--no-shed", default=None, help="Send a down arm's share to the others instead of 503.")
@click.option("--admin-host", help="Admin listener address [127.0.0.1].")
@click.option("--admin-port", type=int, help="Admin listener port (0: a free one); the token comes from $DFSERVE_ADMIN_TOKEN.")
@click.option("--seed", type=int, help="Seed of the weighted split.")
@click.option("--health-interval", type=float, help="Seconds between active health checks [2].")
@click.option("--scrape-interval", type=float, help="Seconds between replica /metrics scrapes [15].")
@click.option("--watch-interval", type=float,
              help="Check --config this often and apply its routing when it changes; the admin API turns read-only.")
def gateway(config_path: Path | None, arms: tuple[str, ...], **flags: Any) -> None:
    """Split, stick or mirror OpenAI/SGLang traffic between drafter arms and measure each arm."""
    keys = {"host": "host", "port": "port", "mode": "routing.mode", "primary": "routing.primary",
            "shed": "routing.shed", "admin_host": "admin.host", "admin_port": "admin.port", "seed": "seed",
            "health_interval": "health.interval_s", "scrape_interval": "scrape.interval_s",
            "watch_interval": "watch_interval_s"}
    overrides = {keys[name]: value for name, value in flags.items() if value is not None}
    if arms:
        parsed = [parse_arm_flag(text) for text in arms]
        names = [name for name, _ in parsed]
        if len(set(names)) != len(names):
            raise UserError(f"--arm: each arm needs its own name (given: {', '.join(names)})")
        overrides["routing.arms"] = dict(parsed)
    config = load_config(config_path, overrides)
    config.admin_token()
    if config.watch_interval_s is not None and config_path is None:
        raise UserError("--watch-interval: there is no file to watch; give --config")
    import uvloop

    logging.basicConfig(format="dfserve gateway: %(levelname)s %(message)s")
    uvloop.run(serve(config, (lambda: load_config(config_path, overrides)) if config_path else None, config_path))
