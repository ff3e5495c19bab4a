"""Histogram observations counted as a Prometheus histogram counts them (bins.c)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from dfserve._relay_py.module import seconds


class Bins:
    """Observations counted as a Prometheus histogram counts them (a value goes to the first bucket whose upper
    bound is not below it; the last bucket is +Inf)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        try:
            items = list(bounds)
        except TypeError:
            raise TypeError("gap_bounds must be a sequence of floats") from None
        values = [seconds(bound) for bound in items]
        for i, value in enumerate(values):
            if value != value or (i > 0 and not value > values[i - 1]):
                raise ValueError("gap_bounds must increase")
        self.bounds = values
        self.counts = [0] * (len(values) + 1)
        self.sum = 0.0

    def add(self, value: float, weight: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += weight
        self.sum += value * float(weight)

    def result(self) -> tuple[tuple[int, ...], float]:
        return tuple(self.counts), self.sum


NO_BINS = Bins(())
