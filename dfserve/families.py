"""Counters, gauges and histograms for what is updated on every request: plain numbers, no locks.

prometheus_client takes a lock and checks that the metric is observable on every update, and finds a histogram's
bucket with a Python loop. A gateway request updates about fifteen series; after a long stream the CPU's caches no
longer hold that code, and in a profile of the gateway relaying 1024-token streams those updates were about a fifth
of its Python per request.

These families are updated from one thread (the event loop's); a scrape from another thread reads each number as
it stands, which is all prometheus_client's per-series locks promise too. They are exposed through
prometheus_client's own metric families, so the text format is prometheus_client's (without `_created` samples).
"""

from __future__ import annotations

from abc import abstractmethod
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class CounterSeries:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount


class GaugeSeries:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class HistogramSeries:
    """Counts per bucket (`bounds`, then +Inf), not cumulative, and the sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        if value == value:  # NaN goes in no bucket, as in prometheus_client
            self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value

    def add_binned(self, counts: Sequence[int], total: float) -> None:
        """Observations already counted into these buckets elsewhere (`dfserve._relay.EventRelay`)."""
        if len(counts) != len(self.counts):
            raise ValueError(f"{len(counts)} bucket counts for {len(self.counts)} buckets")
        for index, count in enumerate(counts):
            if count:
                self.counts[index] += count
        self.total += total


Series = TypeVar("Series", CounterSeries, GaugeSeries, HistogramSeries)


class _Family(Collector, Generic[Series]):
    """A named family of series, one per combination of label values, registered in `registry`."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], Series] = {}
        registry.register(self)

    def labels(self, *values: str) -> Series:
        found = self._series.get(values)
        if found is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(values)} label values for labels {self.labelnames}")
            key = tuple(str(value) for value in values)
            found = self._series.get(key)
            if found is None:
                found = self._series[key] = self._new()
        return found

    def describe(self) -> Iterable[Metric]:
        return self.collect()  # so that the registry refuses a second family of the same name

    @abstractmethod
    def _new(self) -> Series: ...


def _numbers(metric: CounterMetricFamily | GaugeMetricFamily,
             series: Mapping[tuple[str, ...], CounterSeries | GaugeSeries]) -> list[Metric]:
    for values, one in list(series.items()):
        metric.add_metric(list(values), one.value)
    return [metric]


class Counter(_Family[CounterSeries]):
    def _new(self) -> CounterSeries:
        return CounterSeries()

    def collect(self) -> list[Metric]:
        return _numbers(CounterMetricFamily(self.name, self.documentation, labels=self.labelnames), self._series)


class Gauge(_Family[GaugeSeries]):
    def _new(self) -> GaugeSeries:
        return GaugeSeries()

    def collect(self) -> list[Metric]:
        return _numbers(GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames), self._series)


class Histogram(_Family[HistogramSeries]):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        bounds = [float(bound) for bound in buckets]
        if bounds and bounds[-1] == float("inf"):
            bounds.pop()  # +Inf is always the last bucket
        self.bounds = tuple(bounds)
        if bounds != sorted(set(bounds)):
            raise ValueError(f"{name}: bucket bounds must increase")
        self._edges = [floatToGoString(bound) for bound in self.bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> HistogramSeries:
        return HistogramSeries(self.bounds)

    def collect(self) -> list[Metric]:
        metric = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self._series.items()):
            cumulative, buckets = 0, []
            for edge, count in zip(self._edges, list(series.counts), strict=True):
                cumulative += count
                buckets.append((edge, float(cumulative)))
            metric.add_metric(list(values), buckets, series.total)
        return [metric]
