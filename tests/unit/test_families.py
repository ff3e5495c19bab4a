"""dfserve's lock-free families expose exactly what prometheus_client's own would for the same updates."""

from __future__ import annotations

import random

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dfserve import families
from dfserve.metrics import ITL_BUCKETS_S


def exposition(registry: CollectorRegistry) -> list[str]:
    """The text format without `_created` samples (which dfserve's families leave out)."""
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if "_created" not in line]


def test_random_updates_expose_the_same_text_as_prometheus_client() -> None:
    rng = random.Random(3)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counter = (families.Counter("t_requests", "Requests.", ("arm", "status"), ours),
               prometheus_client.Counter("t_requests", "Requests.", ("arm", "status"), registry=theirs))
    gauge = (families.Gauge("t_in_flight", "In flight.", ("arm",), ours),
             prometheus_client.Gauge("t_in_flight", "In flight.", ("arm",), registry=theirs))
    histogram = (families.Histogram("t_gap_seconds", "Gaps.", ("arm",), ITL_BUCKETS_S, ours),
                 prometheus_client.Histogram("t_gap_seconds", "Gaps.", ("arm",), buckets=ITL_BUCKETS_S,
                                             registry=theirs))
    for _ in range(2000):
        arm = rng.choice(["base", "cand", 'we"ird\\arm'])
        status = rng.choice(["2xx", "5xx"])
        value = rng.choice([*ITL_BUCKETS_S, rng.expovariate(20), 0.0, 5.0])  # on, between and beyond the bounds
        for ours_or_theirs in (0, 1):
            counter[ours_or_theirs].labels(arm, status).inc(value)
            gauge[ours_or_theirs].labels(arm).inc(2)
            gauge[ours_or_theirs].labels(arm).dec()
            histogram[ours_or_theirs].labels(arm).observe(value)
    gauge[0].labels("base").set(-3.5)
    gauge[1].labels("base").set(-3.5)
    assert exposition(ours) == exposition(theirs)


def test_nan_and_a_trailing_inf_bound_are_handled_as_prometheus_client_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = families.Histogram("t_odd", "Odd.", (), (0.5, float("inf")), ours)
    reference = prometheus_client.Histogram("t_odd", "Odd.", buckets=(0.5, float("inf")), registry=theirs)
    for value in (0.1, float("nan"), 3.0):
        mine.labels().observe(value)
        reference.observe(value)
    assert exposition(ours) == exposition(theirs)


def test_binned_observations_add_up_like_single_ones() -> None:
    registry = CollectorRegistry()
    histogram = families.Histogram("t_binned", "Binned.", ("how",), (0.1, 1.0), registry)
    for value in (0.05, 0.1, 0.5, 7.0, 7.0):
        histogram.labels("one by one").observe(value)
    histogram.labels("binned").add_binned((2, 1, 2), 14.65)
    one, binned = histogram.labels("one by one"), histogram.labels("binned")
    assert one.counts == binned.counts == [2, 1, 2] and one.total == pytest.approx(binned.total)
    with pytest.raises(ValueError, match="2 bucket counts for 3 buckets"):
        binned.add_binned((1, 1), 1.0)


def test_misuse_is_refused_by_name() -> None:
    registry = CollectorRegistry()
    counter = families.Counter("t_total_things", "Things.", ("arm",), registry)
    with pytest.raises(ValueError, match="t_total_things: 2 label values"):
        counter.labels("a", "b")
    with pytest.raises(ValueError, match="only goes up"):
        counter.labels("a").inc(-1)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        families.Counter("t_total_things", "Again.", ("arm",), registry)
    for bounds in ((1.0, 0.5), (1.0, float("inf"), 2.0)):
        with pytest.raises(ValueError, match="t_h: bucket bounds must increase"):
            families.Histogram("t_h", "H.", (), bounds, registry)
