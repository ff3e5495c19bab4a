"""Per-rule tracks of the sequential design: each metric kind's running sums, and its always-valid interval read
off them at a look (`confseq`). Which interval each kind gets, and what it assumes, is told in `sequential.py`;
which track a kind gets, in `kinds.py`."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from dfserve.verdict import confseq, stats
from dfserve.verdict.pairs import MetricSpec, U, known_outputs

SCALE_FLOOR = 0.01
U_contra = TypeVar("U_contra", contravariant=True)


@dataclass(frozen=True)
class Reading:
    """A metric's change (candidate vs baseline) with its always-valid interval, and the interval at `growth`
    times the data if the data went on as so far."""

    change: float
    low: float
    high: float
    interval_at: Callable[[float], tuple[float, float]]


class Track(Protocol[U_contra]):
    @property
    def tasks(self) -> int: ...

    def add(self, task: int, base: U_contra, cand: U_contra) -> None: ...

    def read(self, alpha: float) -> Reading | None: ...


class _SeenTasks:
    """The distinct tasks a track has taken a pair of."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    @property
    def tasks(self) -> int:
        return len(self.seen)


class RatioTrack(_SeenTasks, Generic[U]):
    """Σ numerator / Σ denominator per arm, summed per task as pairs arrive; the change is read on the log scale,
    where the normal mixture applies, with the rule's limit (at least `SCALE_FLOOR`) as the mixture's scale."""

    def __init__(self, spec: MetricSpec[U], limit: float, task_count: int) -> None:
        assert spec.numerator is not None and spec.denominator is not None
        self.numerator, self.denominator = spec.numerator, spec.denominator
        self.scale = max(limit, SCALE_FLOOR)
        # Per task: baseline num, den; candidate num, den. Grown as tasks come: live traffic has no finite task set.
        self.sums = np.zeros((4, max(1, min(task_count, 1024))))
        super().__init__()

    def add(self, task: int, base: U, cand: U) -> None:
        if not (base.ok and cand.ok):
            return
        nb, db, nc, dc = self.numerator(base), self.denominator(base), self.numerator(cand), self.denominator(cand)
        if nb is None or nc is None or not db or not dc:
            return
        if task >= self.sums.shape[1]:
            self.sums = np.concatenate([self.sums, np.zeros_like(self.sums)], axis=1)
        self.sums[:, task] += (nb, db, nc, dc)
        self.seen.add(task)

    def read(self, alpha: float) -> Reading | None:
        estimate = confseq.paired_log_ratio(self.sums)
        if estimate is None:
            return None
        log_change, se = estimate

        def interval_at(growth: float) -> tuple[float, float]:
            radius = confseq.mixture_radius(se / math.sqrt(growth), self.scale, alpha)
            return math.expm1(log_change - radius), math.expm1(log_change + radius)

        low, high = interval_at(1.0)
        return Reading(math.expm1(log_change), low, high, interval_at)


class QuantileTrack(_SeenTasks, Generic[U]):
    """The q-quantile of one value per request in each arm, from lists kept sorted as pairs arrive; the relative
    change is bounded by both arms' sequences."""

    def __init__(self, spec: MetricSpec[U]) -> None:
        assert spec.value is not None
        self.value, self.q = spec.value, spec.q
        self.base: list[float] = []
        self.cand: list[float] = []
        super().__init__()

    def add(self, task: int, base: U, cand: U) -> None:
        if not (base.ok and cand.ok):
            return
        vb, vc = self.value(base), self.value(cand)
        if vb is not None:
            bisect.insort(self.base, vb)
        if vc is not None:
            bisect.insort(self.cand, vc)
        if vb is not None or vc is not None:
            self.seen.add(task)

    def read(self, alpha: float) -> Reading | None:
        ordered_b, ordered_c, q = self.base, self.cand, self.q
        if not ordered_b or not ordered_c:
            return None
        value_b = ordered_b[stats.quantile_rank(len(ordered_b), q)]
        value_c = ordered_c[stats.quantile_rank(len(ordered_c), q)]
        if value_b <= 0:
            return None

        def bounds(ordered: list[float], growth: float) -> tuple[float, float]:
            """The arm's bounds had it `growth` times the draws, read off the draws so far at the same ranks."""
            n = len(ordered)
            scaled = max(1, round(n * growth))
            low_count, high_count = confseq.rank_band(scaled, q, alpha / 2)
            low = ordered[math.ceil(low_count / growth) - 1] if low_count >= 1 else 0.0
            high_rank = math.floor(high_count / growth)
            return max(0.0, low), ordered[high_rank] if high_count < scaled and high_rank < n else math.inf

        def interval_at(growth: float) -> tuple[float, float]:
            low_b, high_b = bounds(ordered_b, growth)
            low_c, high_c = bounds(ordered_c, growth)
            return low_c / high_b - 1, (high_c / low_b - 1) if low_b > 0 else math.inf

        low, high = interval_at(1.0)
        return Reading(value_c / value_b - 1, low, high, interval_at)


class ErrorTrack(_SeenTasks, Generic[U]):
    """Failed requests per arm; the change in rate (absolute) bounded by both arms' beta-binomial sequences over
    requests and, as the fixed-n design has it, by a normal mixture over tasks, whichever is wider: errors that come
    by task (one prompt the candidate always fails) are fewer independent events than their count says."""

    def __init__(self, limit: float, task_count: int) -> None:
        self.pairs = self.errors_b = self.errors_c = 0
        self.scale = max(limit, SCALE_FLOOR)
        # Per task: pairs, and the candidate's errors less the baseline's. Grown as tasks come, as RatioTrack's.
        self.per_task = np.zeros((2, max(1, min(task_count, 1024))))
        super().__init__()

    def add(self, task: int, base: U, cand: U) -> None:
        self.pairs += 1
        self.errors_b += not base.ok
        self.errors_c += not cand.ok
        while task >= self.per_task.shape[1]:
            self.per_task = np.concatenate([self.per_task, np.zeros_like(self.per_task)], axis=1)
        self.per_task[:, task] += (1, int(not cand.ok) - int(not base.ok))
        self.seen.add(task)

    def read(self, alpha: float) -> Reading | None:
        if not self.pairs:
            return None
        n, errors_b, errors_c = self.pairs, self.errors_b, self.errors_c
        change = (errors_c - errors_b) / n
        influence = (self.per_task[1] - change * self.per_task[0]) / n  # a task not seen adds nothing
        se = math.sqrt(float(influence @ influence))

        def interval_at(growth: float) -> tuple[float, float]:
            scaled = max(1, round(n * growth))
            low_b, high_b = confseq.proportion_sequence(round(errors_b * scaled / n), scaled, alpha / 2)
            low_c, high_c = confseq.proportion_sequence(round(errors_c * scaled / n), scaled, alpha / 2)
            radius = confseq.mixture_radius(se / math.sqrt(growth), self.scale, alpha)
            return min(low_c - high_b, change - radius), max(high_c - low_b, change + radius)

        low, high = interval_at(1.0)
        return Reading(change, low, high, interval_at)


class LosslessTrack(Generic[U]):
    """Distinct tasks whose outputs were identical in every finished pair; the fraction, not a change."""

    def __init__(self, spec: MetricSpec[U]) -> None:
        self.spec = spec
        self.identical: dict[int, bool] = {}
        self.same = 0

    @property
    def tasks(self) -> int:
        return len(self.identical)

    def add(self, task: int, base: U, cand: U) -> None:
        outputs = known_outputs(self.spec, base, cand)
        if outputs is None:
            return
        before = self.identical.get(task, True)
        now = before and outputs[0] == outputs[1]
        self.same += int(now) - int(before and task in self.identical)
        self.identical[task] = now

    def read(self, alpha: float) -> Reading | None:
        n, same = len(self.identical), self.same
        if not n:
            return None

        def interval_at(growth: float) -> tuple[float, float]:
            scaled = max(1, round(n * growth))
            return confseq.proportion_sequence(round(same * scaled / n), scaled, alpha)

        low, high = interval_at(1.0)
        return Reading(same / n, low, high, interval_at)
