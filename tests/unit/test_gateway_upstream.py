"""Replica ejection without sockets: requests' failures eject a bounded share of an arm (never its last healthy
replica), health checks eject any; an arm's slots across a routing change, on a loopback server."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from prometheus_client import CollectorRegistry

from dfserve.gateway.config import ArmConfig, HealthConfig, Limits
from dfserve.gateway.upstream import Upstream, may_eject_passively
from dfserve.metrics import DfserveMetrics


@pytest.mark.parametrize(("replicas", "percent", "expected"), [
    ([(True, False)], 100, False),                       # the last healthy one stays
    ([(True, False), (True, False)], 0, True),           # at least one may go
    ([(True, False), (False, True)], 100, False),        # the other is out: this is the last
    ([(True, False)] * 3 + [(False, True)], 50, True),   # 1 of 4 out, 2 allowed
    ([(True, False)] * 2 + [(False, True)] * 2, 50, False),
    ([(True, False)] * 2 + [(False, False)] * 2, 50, True),  # ejected by health checks: not counted
    ([(True, False)] * 9 + [(False, True)], 10, False),  # Envoy's default: one of ten
])
def test_the_share_requests_may_eject(replicas: list[tuple[bool, bool]], percent: float, expected: bool) -> None:
    assert may_eject_passively(replicas, percent) is expected


def test_only_a_health_check_ejects_an_arms_last_replica() -> None:
    urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
    upstream = Upstream(httpx.AsyncClient(), {"a": ArmConfig(weight=1, replicas=urls)}, Limits(),
                        HealthConfig(eject_after_failures=2, max_ejection_percent=50),
                        DfserveMetrics.build(CollectorRegistry()))
    first, second = upstream.arms["a"].replicas
    for _ in range(4):
        upstream._failed(upstream.arms["a"], first, "http_500")
        upstream._failed(upstream.arms["a"], second, "connect")
    assert not first.healthy and first.passively_ejected and second.healthy  # half the arm, never all of it
    assert upstream.down() == frozenset()
    upstream._failed(upstream.arms["a"], second, "health")
    assert not second.healthy and upstream.down() == {"a"}
    upstream._succeeded(upstream.arms["a"], first)
    assert first.healthy and not first.passively_ejected


def test_a_replica_a_routing_change_removed_leaves_no_health_series_behind() -> None:
    """A request or health check that ends on a replica after it was removed would bring its
    `dfserve_replica_healthy` back, down for good (an alert that never clears)."""
    registry = CollectorRegistry()
    kept, dropped = "http://127.0.0.1:1", "http://127.0.0.1:2"
    upstream = Upstream(httpx.AsyncClient(), {"a": ArmConfig(weight=1, replicas=(kept, dropped))}, Limits(),
                        HealthConfig(eject_after_failures=1), DfserveMetrics.build(registry))
    arm = upstream.arms["a"]
    removed = arm.replicas[1]
    upstream.set_arms({"a": ArmConfig(weight=1, replicas=(kept,))})
    upstream._failed(arm, removed, "health")
    upstream._failed(arm, arm.replicas[0], "health")
    healthy = {s.labels["replica"]: s.value for m in registry.collect() if m.name == "dfserve_replica_healthy"
               for s in m.samples}
    assert healthy == {kept: 0.0}


def test_a_routing_change_under_way_leaves_the_arms_slots_to_the_requests_that_hold_them() -> None:
    """Requests in flight across a routing change give their slots back to the arm they hold: the arm was rebuilt
    and kept their count for good, and once `max_concurrent_per_arm` requests had spanned changes it refused all
    traffic with 429."""
    async def go() -> list[int]:
        ended: asyncio.Queue[None] = asyncio.Queue()

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):  # until the gateway closes it
                while await reader.readuntil(b"\r\n\r\n") and await reader.readexactly(2):  # a head, then b"{}"
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n7\r\ndata: \n\r\n")  # and on it goes
            writer.close()
            ended.put_nowait(None)

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        upstream = Upstream(httpx.AsyncClient(), {"a": ArmConfig(weight=1, replicas=(url,))},
                            Limits(max_concurrent_per_arm=2), HealthConfig(), DfserveMetrics.build(CollectorRegistry()))
        counts, opened_in_all = [], 0
        try:
            for _ in range(3):
                opened = [await upstream.open("a", b"POST", "/generate", b"{}", b"") for _ in range(2)]
                opened_in_all += len(opened)
                upstream.set_arms({"a": ArmConfig(weight=2, replicas=(url,)), "b": ArmConfig(weight=1, replicas=(url,))})
                for one in opened:
                    upstream.release(one, clean=False)
                counts.append(upstream.arms["a"].in_flight)
        finally:
            upstream.close()
            await upstream.http.aclose()
            async with asyncio.timeout(5):
                for _ in range(opened_in_all):  # each connection's handler has seen its end
                    await ended.get()
            server.close()
            await server.wait_closed()
        return counts

    assert asyncio.run(go()) == [0, 0, 0]  # and each round's two requests found their slots free
