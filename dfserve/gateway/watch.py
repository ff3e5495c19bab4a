"""One routing truth for many gateway replicas: each one watches the same config file and applies its routing.

On Kubernetes the file is a ConfigMap key mounted as a volume. The kubelet never edits it in place: it writes a new
timestamped folder and swaps the `..data` symlink the key's path goes through, so every read sees one whole version.
Inotify on the key's path misses that swap (the watched inode never changes), so the watcher polls: it reads the file
through its path every `watch_interval_s`, and acts only when the bytes differ from the last ones it read. A file
written elsewhere must be replaced the same way (write a temporary file, rename it over the old one).

A changed file is loaded and validated in full (the flags given at start still override it); valid routing is
applied atomically (`Gateway.apply`), an invalid file is refused with one log line and
`dfserve_gateway_routing_reloads_total{outcome="refused"}`, and the last good routing stays. Every replica exposes
the hash of the routing it runs (`config.routing_version`, in `GET /admin/arms` and `dfserve_gateway_routing_version`), so
a rollout is complete when `count(count by (version) (dfserve_gateway_routing_version)) == 1`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dfserve.errors import UserError
from dfserve.gateway.config import GatewayConfig, routing_version

if TYPE_CHECKING:
    from dfserve.gateway.app import Gateway

log = logging.getLogger("dfserve.gateway")

Outcome = Literal["applied", "unchanged", "refused"]


def restart_fields(running: GatewayConfig, loaded: GatewayConfig) -> list[str]:
    """Fields outside `routing` that differ: they only take effect when the process starts again."""
    return [name for name in GatewayConfig.model_fields
            if name != "routing" and getattr(running, name) != getattr(loaded, name)]


def reload_routing(gateway: Gateway, load: Callable[[], GatewayConfig], source: Path | str) -> Outcome:
    """Load the config once and apply its routing, for SIGHUP and for each new version of a watched file alike.

    Every failure is refused: counted (`dfserve_gateway_routing_reloads_total{outcome="refused"}`), said in one log
    line, and the last good routing stays; nothing it raises can end the watch or reach the event loop as a
    traceback. A failure that is not a `UserError` (a bug the file's content found) is named by its type."""
    metrics = gateway.routing_metrics
    try:
        loaded = load()
        version = routing_version(loaded.routing)
        if version == gateway.version:
            if later := restart_fields(gateway.config, loaded):
                log.warning("config %s: routing unchanged; %s changed, which take effect at the next start", source,
                            ", ".join(later))
            return "unchanged"
        gateway.apply(loaded.routing)
    except Exception as exc:
        metrics.reloads.labels("refused").inc()
        reason = str(exc) if isinstance(exc, (UserError, ValueError)) else f"{type(exc).__name__}: {exc}"
        log.error("config %s refused, routing %s stays: %s", source, gateway.version, reason)
        return "refused"
    metrics.reloads.labels("applied").inc()
    weights = ", ".join(f"{name}={arm.weight:g}" for name, arm in loaded.routing.arms.items())
    log.warning("config %s: routing %s applied (%s mode: %s)", source, version, loaded.routing.mode, weights)
    later = restart_fields(gateway.config, loaded)
    if later:
        log.warning("config %s: %s changed too; they take effect at the next start", source, ", ".join(later))
    return "applied"


class ConfigWatcher:
    """Polls one config file and applies the routing of each new version of it to `gateway`."""

    def __init__(self, path: Path, load: Callable[[], GatewayConfig], gateway: Gateway, interval_s: float) -> None:
        self.path = path
        self.load = load
        self.gateway = gateway
        self.interval_s = interval_s
        self._seen: bytes | None = None

    def _digest(self) -> bytes:
        """What identifies the file's current state: its bytes' hash, or the error reading it."""
        try:
            return hashlib.sha256(self.path.read_bytes()).digest()
        except OSError as exc:
            return hashlib.sha256(repr(exc).encode()).digest()

    def poll(self) -> Outcome | None:
        """Read the file once; None when it is as last read, else what became of the new version."""
        digest = self._digest()
        if digest == self._seen:
            return None
        self._seen = digest
        return reload_routing(self.gateway, self.load, self.path)

    async def run(self) -> None:
        """Poll forever (cancel to stop)."""
        while True:
            self.poll()
            await asyncio.sleep(self.interval_s)
