"""Replica ejection without sockets: requests' failures eject a bounded share of an arm (never its last healthy
replica), health checks eject any."""

from __future__ import annotations

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
