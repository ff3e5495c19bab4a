"""The per-arm families: the `dfserve_requests_total` label convention shared by the gateway and the load tester, and
each labelled series looked up once."""

from __future__ import annotations

import itertools
import typing

import pytest
from prometheus_client import CollectorRegistry

from dfserve import metrics as m
from dfserve.gateway.app import PROXIED, Gateway
from dfserve.gateway.config import load_config
from dfserve.sglang.client.requests import Api


@pytest.mark.parametrize(("http_status", "error", "labels"), [
    (200, None, ("2xx", "")),
    (500, None, ("5xx", "http_status")),
    (500, "http_status", ("5xx", "http_status")),
    (503, "no_replica", ("5xx", "no_replica")),
    (429, "overloaded", ("4xx", "overloaded")),
    (200, "stream_cut", ("error", "stream_cut")),
    (200, "protocol", ("error", "protocol")),
    (None, "connect", ("error", "connect")),
    (0, None, ("error", "no_status")),
    (200, "client_disconnect", ("499", "client_disconnect")),
    (None, "cancelled", ("499", "cancelled")),
])
def test_request_labels(http_status: int | None, error: str | None, labels: tuple[str, str]) -> None:
    assert m.request_labels(http_status, error) == labels
    assert (labels[0] == m.STATUS_OK) == (labels[1] == ""), "an empty error label means success and only that"


def test_series_and_finished_record_under_the_right_labels_and_are_looked_up_once() -> None:
    registry = CollectorRegistry()
    metrics = m.DfserveMetrics.build(registry)
    ttft = metrics.ttft.labels("cand", "native")
    assert metrics.ttft.labels("cand", "native") is ttft
    assert metrics.ttft.labels("base", "native") is not ttft
    ttft.observe(0.25)
    metrics.accept_length.labels("cand", "native", "exact").observe(6.0)
    metrics.accept_length.labels("cand", "native", "estimated").observe(5.0)
    metrics.finished("cand", "native", "http://r1", 200, None).inc()
    metrics.finished("cand", "native", "http://r1", 503, "connect").inc()
    assert metrics.finished("cand", "native", "http://r1", 200, None) is metrics.finished(
        "cand", "native", "http://r1", 204, None)
    errors = metrics.child(metrics.upstream_errors, "cand", "http://r1", "connect")
    assert metrics.child(metrics.upstream_errors, "cand", "http://r1", "connect") is errors
    assert metrics.child(metrics.retries, "cand", "http://r1") is not metrics.child(
        metrics.ejections, "cand", "http://r1")  # same labels, another family
    errors.inc()

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value(m.TTFT + "_count", arm="cand", route="native") == 1
    assert value(m.E2E + "_count", arm="cand", route="native") is None  # a series appears when first recorded
    assert value(m.UPSTREAM_ERRORS + "_total", arm="cand", replica="http://r1", kind="connect") == 1
    assert value(m.ACCEPT_LENGTH + "_sum", arm="cand", route="native", measure="exact") == 6.0
    assert value(m.ACCEPT_LENGTH + "_sum", arm="cand", route="native", measure="estimated") == 5.0
    assert value(m.REQUESTS + "_total", arm="cand", route="native", replica="http://r1", status="2xx", error="") == 1
    assert value(m.REQUESTS + "_total", arm="cand", route="native", replica="http://r1", status="5xx",
                 error="connect") == 1


def test_every_failure_counts_toward_the_failed_series_whatever_its_kind() -> None:
    """Error ratios read `dfserve_requests_failed_total`, started at 0: each failure, of any status and kind (a
    client's give-up included), counts there once, and a success does not."""
    registry = CollectorRegistry()
    metrics = m.DfserveMetrics.build(registry)
    metrics.start("a", ("native",), ("r",))
    for status, error in ((200, None), (502, "connect"), (200, "stream_cut"), (None, "client_disconnect"),
                          (200, m.STREAM_ERROR), (200, None)):
        m.observe(metrics, m.Outcome(arm="a", route="native", replica="r", status=status, error=error))
    labels = {"arm": "a", "route": "native", "replica": "r"}
    assert registry.get_sample_value(f"{m.REQUESTS_FAILED}_total", labels) == 4
    assert registry.get_sample_value(f"{m.REQUESTS}_total", {**labels, "status": "2xx", "error": ""}) == 2


@pytest.mark.parametrize(("bounds", "up_to_s"), [(m.TTFT_BUCKETS_S, 2), (m.ITL_BUCKETS_S, 0.2), (m.E2E_BUCKETS_S, 120)],
                         ids=["ttft", "itl", "e2e"])
def test_latency_buckets_are_fine_enough_for_a_tail_quantile(bounds: tuple[float, ...], up_to_s: float) -> None:
    """A dashboard's p99 is interpolated within a bucket: bounds that double put it up to twice the truth (a TTFT
    p99 of 27 ms read as 39 ms between 20 and 40 ms). Over the latencies a stream has, no bucket is over 1.5 times the
    last."""
    below = [b for b in bounds if b <= up_to_s]
    assert all(high / low <= 1.5 for low, high in itertools.pairwise(below))


def test_an_arms_success_series_start_at_zero_before_its_first_request() -> None:
    """Prometheus takes a series' first sample for its start: requests counted before it was first scraped would be
    in no rate(). A gateway's arms, per replica and generation route, are exported at 0 from its start, and a new
    arm from the routing change that adds it."""
    arms = {"a": {"weight": 1, "replicas": ["http://x", "http://y"]}, "b": {"weight": 1, "replicas": ["http://z"]}}
    config = load_config(None, {"routing.arms": arms})
    gateway = Gateway(config)
    sample = gateway.registry.get_sample_value
    for arm, replica in (("a", "http://x"), ("a", "http://y"), ("b", "http://z")):
        for route in m.GENERATION_ROUTES:
            assert sample(f"{m.REQUESTS}_total", {"arm": arm, "route": route, "replica": replica, "status": "2xx",
                                                   "error": ""}) == 0
            assert sample(f"{m.REQUESTS_FAILED}_total", {"arm": arm, "route": route, "replica": replica}) == 0
            assert sample(f"{m.TTFT}_count", {"arm": arm, "route": route}) == 0
            assert sample(f"{m.SPEC_VERIFY_ROUNDS}_total", {"arm": arm, "route": route}) == 0
            assert sample(f"{m.ACCEPT_LENGTH}_count", {"arm": arm, "route": route, "measure": "exact"}) == 0
    gateway.apply(config.routing.model_copy(update={"arms": {**config.routing.arms, "c": config.routing.arms["b"]}}))
    assert sample(f"{m.E2E}_count", {"arm": "c", "route": "chat"}) == 0


def test_the_generation_routes_are_those_the_gateway_relays_and_the_tester_sends() -> None:
    assert set(m.GENERATION_ROUTES) == set(PROXIED.values()) == set(typing.get_args(Api))
