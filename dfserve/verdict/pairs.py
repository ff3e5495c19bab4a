"""Paired units and the metrics read from them: what every source hands the verdict core.

A unit is one observation of one side on one task: a request of a load test, a task's totals in an offline
evaluation, a mirrored request of a shadow run. Units of the two sides are paired by their place in the schedule
(the same task at the same place for both), and tasks are the independent clusters: a task's difficulty is shared
by both sides of each of its pairs, so it cancels out of every difference.

    pairs = Pairs.match(("zlab", "inhouse"), base_units, cand_units, deterministic=True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from dfserve.errors import UserError


class Unit(Protocol):
    @property
    def ok(self) -> bool:
        """Whether the observation finished: only finished pairs carry values, failures feed error rates."""
        ...


U = TypeVar("U", bound=Unit)


@dataclass(frozen=True)
class MetricSpec(Generic[U]):
    """How one metric is read from units; `kind` names an entry of `kinds.KINDS`: `ratio` (Σ numerator /
    Σ denominator over finished units), `quantile` of one value per unit (`value`) or of many (`samples`),
    `error_rate` (units not ok), `identical` (the share of finished pairs, their outputs known, whose `output`
    agrees; gated by `at_least`, every other kind by `max_worse`).
    `fixed_by_task`: when the units are deterministic, a repeated task repeats this metric's value, so only
    distinct tasks add evidence."""

    label: str
    kind: str
    higher_is_better: bool = False
    q: float = 0.5
    unit: Literal["", "s"] = ""
    value: Callable[[U], float | None] | None = None
    samples: Callable[[U], list[float]] | None = None
    numerator: Callable[[U], float | None] | None = None
    denominator: Callable[[U], float | None] | None = None
    output: Callable[[U], str | None] | None = None
    fixed_by_task: bool = False


def check_same_task(index: int, base_task: str, cand_task: str) -> None:
    """Two units at one place of the schedule must be of one task, or the sides did not replay the same schedule."""
    if base_task != cand_task:
        raise UserError(f"pair {index}: the baseline ran task {base_task!r}, the candidate {cand_task!r}; the two "
                        "sides did not replay the same schedule")


def known_outputs(spec: MetricSpec[U], base: U, cand: U) -> tuple[str, str] | None:
    """A finished pair's two outputs, or None where either side failed or its output is not known: two unknown
    outputs are never counted as identical."""
    assert spec.output is not None
    if not (base.ok and cand.ok):
        return None
    outputs = spec.output(base), spec.output(cand)
    return None if outputs[0] is None or outputs[1] is None else (outputs[0], outputs[1])


@dataclass(frozen=True)
class Pairs(Generic[U]):
    """Paired units in schedule order. `deterministic`: repeating a task repeats its outcome (greedy decoding),
    so identical-output fractions apply and some metrics gain only from distinct tasks. `greedy`, where the pairs
    mix greedy and sampled requests (live traffic): per pair, whether its outputs must agree; the identical-output
    fraction is then judged on those pairs alone."""

    names: tuple[str, str]
    index: tuple[int, ...]
    task_ids: tuple[str, ...]
    base: tuple[U, ...]
    cand: tuple[U, ...]
    deterministic: bool
    greedy: tuple[bool, ...] | None = None
    cluster: NDArray[np.int64] = field(init=False, repr=False, compare=False)
    tasks: int = field(init=False)

    def __post_init__(self) -> None:
        position = {t: i for i, t in enumerate(sorted(set(self.task_ids)))}
        object.__setattr__(self, "cluster", np.array([position[t] for t in self.task_ids], dtype=np.int64))
        object.__setattr__(self, "tasks", len(position))

    def __len__(self) -> int:
        return len(self.index)

    @property
    def must_agree(self) -> tuple[bool, ...]:
        """Per pair, whether its outputs must agree: every pair of a deterministic run, or the greedy ones."""
        return self.greedy if self.greedy is not None else (self.deterministic,) * len(self)

    @classmethod
    def match(cls, names: tuple[str, str], base: Iterable[tuple[int, str, U]], cand: Iterable[tuple[int, str, U]],
              deterministic: bool, greedy: Callable[[U, U], bool] | None = None) -> Pairs[U]:
        """Pair `(index, task_id, unit)` of both sides by index; an index one side lacks pairs nothing. `greedy`:
        whether one pair's outputs must agree, where that is decided pair by pair."""
        by_index = {index: (task, unit) for index, task, unit in base}
        rows = []
        for index, task, unit in cand:
            if index in by_index:
                base_task, base_unit = by_index[index]
                check_same_task(index, base_task, task)
                rows.append((index, task, base_unit, unit))
        rows.sort(key=lambda row: row[0])
        return cls(names, tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows),
                   tuple(r[3] for r in rows), deterministic,
                   tuple(greedy(r[2], r[3]) for r in rows) if greedy is not None else None)
