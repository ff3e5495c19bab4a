"""Replicas of each arm: which one gets a request, whether it is healthy, and retries before the first byte.

One aiohttp session serves every replica (aiohttp pools connections per host and sets TCP_NODELAY; it costs a
tenth of httpx's CPU per streamed chunk, see PEERS.md). A replica is ejected after `eject_after_failures`
consecutive failures, passive (connect errors, disconnects and 5xx seen by requests) or active (`GET /health`), and
re-admitted by the next health check that passes. A request whose replica fails before any response byte is retried
on another replica of the same arm, never of another arm.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from dfserve.metrics import DfserveMetrics
from gateway.config import ArmConfig, HealthConfig, Limits
from gateway.routing import pick_replica


@dataclass(eq=False)
class Replica:
    """One replica's live state; kept across routing reloads while its URL stays in the arm."""

    url: str
    healthy: bool = True
    failures: int = 0
    in_flight: int = 0


@dataclass(eq=False)
class Arm:
    name: str
    replicas: list[Replica]
    in_flight: int = 0
    turn: int = 0

    @property
    def up(self) -> bool:
        return any(replica.healthy for replica in self.replicas)


class UpstreamFailure(Exception):
    """No response could be had from the arm; `status` and `kind` become the client's error and a metric label."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass(eq=False)
class Opened:
    """An upstream response whose headers have arrived; `release` must be called once it is finished with."""

    response: aiohttp.ClientResponse
    arm: Arm
    replica: Replica
    retries: int
    _released: bool = field(default=False, repr=False)


_BEFORE_HEADERS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


class Upstream:
    """The arms' replicas behind one aiohttp session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        arms: Mapping[str, ArmConfig],
        limits: Limits,
        health: HealthConfig,
        metrics: DfserveMetrics,
    ) -> None:
        self.session = session
        self.limits = limits
        self.health = health
        self.metrics = metrics
        self.arms: dict[str, Arm] = {}
        self.set_arms(arms)

    def set_arms(self, arms: Mapping[str, ArmConfig]) -> None:
        """Adopt a new set of arms in one assignment; replicas whose URL is unchanged keep their state."""
        known = {(arm.name, r.url): r for arm in self.arms.values() for r in arm.replicas}
        new = {}
        for name, config in arms.items():
            replicas = [known.get((name, url)) or Replica(url) for url in config.replicas]
            old = self.arms.get(name)
            new[name] = Arm(name, replicas, in_flight=old.in_flight if old else 0)
            for replica in replicas:
                self.metrics.replica_healthy.labels(name, replica.url).set(1 if replica.healthy else 0)
        for (name, url) in known.keys() - {(n, r.url) for n, arm in new.items() for r in arm.replicas}:
            self.metrics.replica_healthy.remove(name, url)
        self.arms = new

    def down(self) -> frozenset[str]:
        """Arms with no healthy replica right now."""
        return frozenset(name for name, arm in self.arms.items() if not arm.up)

    def _failed(self, arm: Arm, replica: Replica, kind: str) -> None:
        self.metrics.upstream_errors.labels(arm.name, replica.url, kind).inc()
        replica.failures += 1
        if replica.healthy and replica.failures >= self.health.eject_after_failures:
            replica.healthy = False
            self.metrics.ejections.labels(arm.name, replica.url).inc()
            self.metrics.replica_healthy.labels(arm.name, replica.url).set(0)

    def _succeeded(self, arm: Arm, replica: Replica) -> None:
        replica.failures = 0
        if not replica.healthy:
            replica.healthy = True
            self.metrics.replica_healthy.labels(arm.name, replica.url).set(1)

    async def open(
        self, arm_name: str, method: str, path: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Opened:
        """Send the request to a healthy replica of `arm_name`, retrying on another one until a response starts.

        The last replica's 5xx is returned as it is when no other replica is left to try.
        """
        arm = self.arms.get(arm_name)
        if arm is None:
            raise UpstreamFailure(503, "no_arm", f"arm {arm_name!r} is not configured")
        if arm.in_flight >= self.limits.max_concurrent_per_arm:
            raise UpstreamFailure(429, "overloaded", f"arm {arm_name!r} has {arm.in_flight} requests in flight")
        tried: set[int] = set()
        failure = UpstreamFailure(503, "no_replica", f"arm {arm_name!r} has no healthy replica")
        while len(tried) <= self.limits.max_retries:
            index = pick_replica([r.in_flight for r in arm.replicas], [r.healthy for r in arm.replicas],
                                 frozenset(tried), arm.turn)
            if index is None:
                break
            arm.turn = index + 1
            replica = arm.replicas[index]
            if tried:
                self.metrics.retries.labels(arm.name, replica.url).inc()
            tried.add(index)
            replica.in_flight += 1
            arm.in_flight += 1
            try:
                response = await self.session.request(method, replica.url + path, data=body, headers=headers)
            except (TimeoutError, *_BEFORE_HEADERS) as exc:
                self._finish(arm, replica)
                if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
                    self._failed(arm, replica, "timeout")
                    raise UpstreamFailure(504, "timeout", f"arm {arm_name!r}: no response headers in time") from None
                self._failed(arm, replica, "connect")
                failure = UpstreamFailure(502, "connect", f"arm {arm_name!r}: {type(exc).__name__} from a replica")
                continue
            except BaseException:
                self._finish(arm, replica)
                raise
            if response.status >= 500:
                self._failed(arm, replica, f"http_{response.status}")
                more = any(r.healthy and i not in tried for i, r in enumerate(arm.replicas))
                if more and len(tried) <= self.limits.max_retries:
                    response.release()
                    self._finish(arm, replica)
                    continue
            return Opened(response, arm, replica, len(tried) - 1)
        raise failure

    def _finish(self, arm: Arm, replica: Replica) -> None:
        replica.in_flight -= 1
        arm.in_flight -= 1

    def release(self, opened: Opened, clean: bool, failure: str | None = None) -> None:
        """Return the replica's slot. Unclean ends close the connection, which makes SGLang abort the request;
        `failure` names an upstream fault (a stream cut short), counted against the replica."""
        if opened._released:
            return
        opened._released = True
        if clean:
            opened.response.release()
        else:
            opened.response.close()
        self._finish(opened.arm, opened.replica)
        if failure is not None:
            self._failed(opened.arm, opened.replica, failure)
        elif opened.response.status < 500:
            self._succeeded(opened.arm, opened.replica)

    async def check(self, arm: Arm, replica: Replica) -> None:
        """One active health check."""
        timeout = aiohttp.ClientTimeout(total=self.health.timeout_s)
        try:
            async with self.session.get(replica.url + self.health.path, timeout=timeout) as response:
                await response.read()
                healthy = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            healthy = False
        if healthy:
            self._succeeded(arm, replica)
        else:
            self._failed(arm, replica, "health")

    async def health_loop(self) -> None:
        """Check every replica every `interval_s`, forever (cancel to stop)."""
        while True:
            checks = [self.check(arm, r) for arm in self.arms.values() for r in arm.replicas]
            await asyncio.gather(*checks)
            await asyncio.sleep(self.health.interval_s)
