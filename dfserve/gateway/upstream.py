"""Replicas of each arm: which one gets a request, whether it is healthy, and retries before the first byte.

Requests go out through `dfserve.http1`, one keep-alive pool per replica (TCP_NODELAY, no task or timer per
chunk: the relay's cost per streamed chunk is most of the gateway's, see bench/RESULTS.md); health checks, off the
hot path, use an `httpx.AsyncClient`. A replica is ejected after `eject_after_failures`
consecutive failures, passive (connect errors, disconnects and 5xx seen by requests) or active (`GET /health`), and
re-admitted by the next health check that passes. As Envoy's outlier detection bounds it, passive signals eject at
most `max_ejection_percent` of an arm's replicas (at least one), and never its last healthy one: a request whose
own content makes an engine fail (a 500 on a bad input) cannot take an arm out of service, however often a client
sends it; only an active health check that fails ejects the last replica. A request whose replica fails before any response byte is retried
on another replica of the same arm, never of another arm.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx

from dfserve.gateway.config import ArmConfig, HealthConfig, Limits
from dfserve.gateway.routing import pick_replica
from dfserve.http1 import (
    BadResponse,
    BodyTooLarge,
    Call,
    ConnectFailed,
    Disconnected,
    Pool,
    ReaderStalled,
    ReadTimeout,
    Response,
)
from dfserve.metrics import GATEWAY_OVERLOADED, DfserveMetrics
from dfserve.relay_core import EventTooLarge


@dataclass(eq=False)
class Replica:
    """One replica's live state; kept across routing reloads while its URL stays in the arm."""

    url: str
    pool: Pool
    healthy: bool = True
    failures: int = 0
    in_flight: int = 0
    passively_ejected: bool = False
    """Ejected on requests' failures, not by a health check (counted against `max_ejection_percent`)."""


@dataclass(eq=False)
class Arm:
    name: str
    replicas: list[Replica]
    in_flight: int = 0
    turn: int = 0

    @property
    def up(self) -> bool:
        return any(replica.healthy for replica in self.replicas)


def may_eject_passively(replicas: list[tuple[bool, bool]], max_ejection_percent: float) -> bool:
    """Whether requests' failures may eject one more of an arm's replicas, given each one's (healthy, ejected
    passively): never the last healthy one, and past the first, no more than `max_ejection_percent` of them."""
    healthy = sum(1 for up, _ in replicas if up)
    ejected = sum(1 for up, passive in replicas if not up and passive)
    allowed = max(1, int(len(replicas) * max_ejection_percent / 100))
    return healthy > 1 and ejected < allowed


class UpstreamFailure(Exception):
    """No response could be had from the arm; `status` and `kind` become the client's error and a metric label."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


MID_STREAM = (Disconnected, BadResponse, ReadTimeout, ReaderStalled, EventTooLarge)
"""What a response can fail with once its head has arrived."""

REPLICA_FAULTS = frozenset({"stream_cut", "timeout", "event_too_large", "body_too_large"})
"""Failure kinds after the head that count against the replica (`Upstream.release`); the others are the client's."""


def mid_stream_error(exc: Exception) -> str:
    """The failure kind of a response cut after its head: the replica's (`timeout`, `event_too_large`: an event
    longer than `limits.max_event_bytes`, `body_too_large`: a whole body longer than `limits.max_response_bytes`,
    `stream_cut`) unless the gateway's own client stopped reading (`client_stalled`)."""
    if isinstance(exc, ReaderStalled):
        return "client_stalled"
    if isinstance(exc, BodyTooLarge):
        return "body_too_large"
    if isinstance(exc, EventTooLarge):
        return "event_too_large"
    return "timeout" if isinstance(exc, ReadTimeout) else "stream_cut"


@dataclass(eq=False)
class Opened:
    """An upstream response whose headers have arrived; `release` must be called once it is finished with."""

    call: Call
    response: Response
    arm: Arm
    replica: Replica
    retries: int
    _released: bool = field(default=False, repr=False)


class Upstream:
    """The arms' replicas, each with its own connection pool; `http` serves health checks."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        arms: Mapping[str, ArmConfig],
        limits: Limits,
        health: HealthConfig,
        metrics: DfserveMetrics,
    ) -> None:
        self.http = http
        self.limits = limits
        self.health = health
        self.metrics = metrics
        self.checked = False
        """True once every replica has had one active health check (`GET /ready`)."""
        self.arms: dict[str, Arm] = {}
        self.set_arms(arms)

    def set_arms(self, arms: Mapping[str, ArmConfig]) -> None:
        """Adopt a new set of arms in one assignment; an arm that stays is the same `Arm` (the requests under way
        hold it, and give their slots back to it), and replicas whose URL is unchanged keep their state."""
        known = {(arm.name, r.url): r for arm in self.arms.values() for r in arm.replicas}
        new = {}
        for name, config in arms.items():
            replicas = [known.get((name, url)) or self._replica(url) for url in config.replicas]
            arm = self.arms.get(name)
            if arm is None:
                arm = Arm(name, replicas)
            else:
                arm.replicas = replicas
            new[name] = arm
        for (name, url) in known.keys() - {(n, r.url) for n, arm in new.items() for r in arm.replicas}:
            self.metrics.replica_healthy.remove(name, url)
            known[(name, url)].pool.close()
        self.arms = new
        for arm in new.values():
            for replica in arm.replicas:
                self._show_health(arm, replica)

    def _replica(self, url: str) -> Replica:
        return Replica(url, Pool(url, time.perf_counter, connect_timeout_s=self.limits.connect_timeout_s,
                                 read_timeout_s=self.limits.read_timeout_s, kernel_stamps=True))

    def close(self) -> None:
        for arm in self.arms.values():
            for replica in arm.replicas:
                replica.pool.close()

    def down(self) -> frozenset[str]:
        """Arms with no healthy replica right now."""
        return frozenset(name for name, arm in self.arms.items() if not arm.up)

    def _failed(self, arm: Arm, replica: Replica, kind: str) -> None:
        """One failure of `replica`: active when `kind` is `health`, else passive (a request's)."""
        self.metrics.upstream_errors.labels(arm.name, replica.url, kind).inc()
        replica.failures += 1
        if not replica.healthy or replica.failures < self.health.eject_after_failures:
            return
        passive = kind != "health"
        if passive and not may_eject_passively([(r.healthy, r.passively_ejected) for r in arm.replicas],
                                               self.health.max_ejection_percent):
            return
        replica.healthy = False
        replica.passively_ejected = passive
        self.metrics.ejections.labels(arm.name, replica.url).inc()
        self._show_health(arm, replica)

    def _succeeded(self, arm: Arm, replica: Replica) -> None:
        replica.failures = 0
        if not replica.healthy:
            replica.healthy = True
            replica.passively_ejected = False
            self._show_health(arm, replica)

    def _show_health(self, arm: Arm, replica: Replica) -> None:
        """`dfserve_replica_healthy` of a replica still routed to: a request or check that ends after a routing
        change removed it would bring its series back, down for good."""
        if self.arms.get(arm.name) is arm and any(r is replica for r in arm.replicas):
            self.metrics.replica_healthy.labels(arm.name, replica.url).set(1 if replica.healthy else 0)

    async def open(
        self, arm_name: str, method: bytes, path: str, body: bytes, headers: bytes,
        sending: Callable[[str], object] = lambda url: None,
    ) -> Opened:
        """Send the request to a healthy replica of `arm_name`, retrying on another one until a response starts;
        `sending` is told each replica's URL as the request goes to it (a client that leaves while it waits for the
        response's head left that replica).

        The last replica's 5xx is returned as it is when no other replica is left to try.
        """
        arm = self.arms.get(arm_name)
        if arm is None:
            raise UpstreamFailure(503, "no_arm", f"arm {arm_name!r} is not configured")
        if arm.in_flight >= self.limits.max_concurrent_per_arm:
            raise UpstreamFailure(429, GATEWAY_OVERLOADED, f"arm {arm_name!r} has {arm.in_flight} requests in flight")
        tried: set[int] = set()
        replicas = arm.replicas  # as they were when it came: a routing change meanwhile is the next request's
        failure = UpstreamFailure(503, "no_replica", f"arm {arm_name!r} has no healthy replica")
        while len(tried) <= self.limits.max_retries:
            index = pick_replica([r.in_flight for r in replicas], [r.healthy for r in replicas],
                                 frozenset(tried), arm.turn)
            if index is None:
                break
            arm.turn = index + 1
            replica = replicas[index]
            if tried:
                self.metrics.retries.labels(arm.name, replica.url).inc()
            tried.add(index)
            replica.in_flight += 1
            arm.in_flight += 1
            sending(replica.url)
            response = Response(max_body_bytes=self.limits.max_response_bytes)
            try:
                call = await replica.pool.open(method, path, body, headers, response)
            except ReadTimeout:
                self._finish(arm, replica)
                self._failed(arm, replica, "timeout")
                raise UpstreamFailure(504, "timeout", f"arm {arm_name!r}: no response headers in time") from None
            except (ConnectFailed, Disconnected, BadResponse) as exc:
                self._finish(arm, replica)
                kind = ("bad_response" if isinstance(exc, BadResponse) else "connect" if isinstance(exc, ConnectFailed)
                        else "disconnect")  # it had the request, and closed before answering
                self._failed(arm, replica, kind)
                failure = UpstreamFailure(502, kind, f"arm {arm_name!r}: {type(exc).__name__} from a replica")
                continue
            except BaseException:
                self._finish(arm, replica)
                raise
            if response.status >= 500:
                self._failed(arm, replica, f"http_{response.status}")
                more = any(r.healthy and i not in tried for i, r in enumerate(replicas))
                if more and len(tried) <= self.limits.max_retries:
                    call.connection.abort()
                    self._finish(arm, replica)
                    continue
            return Opened(call, response, arm, replica, len(tried) - 1)
        raise failure

    def _finish(self, arm: Arm, replica: Replica) -> None:
        replica.in_flight -= 1
        arm.in_flight -= 1

    def release(self, opened: Opened, clean: bool, failure: str | None = None) -> None:
        """Return the replica's slot. Unclean ends close the connection, which makes SGLang abort the request;
        `failure` is the request's failure kind, counted against the replica when it is its fault
        (`REPLICA_FAULTS`: a stream cut short, say)."""
        if opened._released:
            return
        opened._released = True
        if clean:
            opened.call.close()
        else:
            opened.call.connection.abort()
        self._finish(opened.arm, opened.replica)
        if failure in REPLICA_FAULTS:
            self._failed(opened.arm, opened.replica, failure)
        elif opened.response.status < 500:
            self._succeeded(opened.arm, opened.replica)

    async def check(self, arm: Arm, replica: Replica) -> None:
        """One active health check."""
        try:
            response = await self.http.get(replica.url + self.health.path, timeout=self.health.timeout_s)
            healthy = response.status_code == 200
        except httpx.HTTPError:
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
            self.checked = True
            await asyncio.sleep(self.health.interval_s)
