"""What a design decides: each metric with its paired interval, each rule's status, and the verdict of them all."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["PASS", "FAIL", "INCONCLUSIVE"]
RuleStatus = Literal["PASS", "FAIL", "INCONCLUSIVE", "NOT_APPLICABLE"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Figure(_Model):
    """A point estimate with its 95% interval and the number of samples behind it."""

    estimate: float
    low: float
    high: float
    n: int


class MetricResult(_Model):
    metric: str
    label: str
    baseline: float | None
    candidate: float | None
    change: float | None = Field(description="candidate vs baseline: relative (c/b - 1), absolute for error_rate")
    change_low: float | None
    change_high: float | None
    relative: bool
    n_baseline: int
    n_candidate: int
    higher_is_better: bool
    unit: Literal["", "s"] = Field("", description="of baseline and candidate: s for latencies, '' for none")
    interval_of_counts: bool = Field(False, description="the interval's worse end is the counts' (error_rate: "
                                     "Newcombe's over requests), beyond the bootstrap's over tasks: more requests "
                                     "bring it in, repeats of a task included")


class RuleResult(_Model):
    metric: str
    limit: float
    status: RuleStatus
    detail: str
    tasks_needed: int | None = None
    low: float | None = Field(None, description="the interval the rule was decided on: how much worse the candidate "
                              "is (relative or absolute), or the identical fraction for lossless_fraction; "
                              "set by sequential judgements")
    high: float | None = None
    requests_needed: int | None = Field(None, description="paired requests that would decide the rule if the data "
                                        "went on as so far (sequential judgements)")
    task_set_limited: bool = Field(False, description="undecided, and more requests cannot decide it: every task was "
                                   "seen, or more distinct tasks than the set holds are needed, and repeating one "
                                   "adds nothing (temperature 0: same output, same verify rounds)")


NOT_JUDGED = ("not judged: outputs sampled above temperature 0 may differ by design, and outputs that were not "
              "recorded cannot be compared")
"""Why losslessness does not apply (the run's notes say which, where it is not the temperature)."""


class Lossless(_Model):
    applicable: bool
    pairs: int
    identical: int
    fraction: float | None
    low: float | None
    high: float | None
    differing_tasks: list[str]
    greedy_of: int | None = Field(None, description="where only some pairs were greedy (live traffic): how many "
                                  "pairs there were in all; `pairs` counts the greedy ones compared")
    tasks: int | None = Field(None, description="distinct tasks among the pairs compared: at temperature 0 a repeat "
                              "of a task repeats its output, and adds no evidence")


class Judgement(_Model):
    baseline: str = Field(description="the baseline side: an arm of a load test, a drafter of an evaluation")
    candidate: str
    verdict: Status
    pairs: int = Field(description="paired units judged: requests of a load test, tasks of an offline evaluation")
    tasks: int
    metrics: tuple[MetricResult, ...]
    rules: tuple[RuleResult, ...]
    lossless: Lossless | None = Field(None, description="identical outputs, where the source records outputs")
    tasks_needed: int | None


def fold(statuses: Iterable[RuleStatus]) -> Status:
    """Any FAIL fails, else any INCONCLUSIVE leaves it open, else PASS if some rule passed. A rule that does not
    apply neither passes nor fails, so a gate none of whose rules applies has judged nothing and is not a PASS."""
    seen = set(statuses)
    if "FAIL" in seen:
        return "FAIL"
    return "PASS" if "PASS" in seen and "INCONCLUSIVE" not in seen else "INCONCLUSIVE"


def overall(rules: Sequence[RuleResult]) -> tuple[Status, int | None]:
    """The verdict of a set of rule results (any FAIL fails; any INCONCLUSIVE leaves it open) and, where it is open,
    the distinct tasks the undecided rules would need (a FAIL is decided, whatever its other rules need)."""
    verdict = fold(r.status for r in rules)
    needed = [r.tasks_needed for r in rules if r.status == "INCONCLUSIVE" and r.tasks_needed is not None]
    return verdict, max(needed) if needed and verdict == "INCONCLUSIVE" else None


def tasks_needed(n: int, half_width: float, margin: float) -> int | None:
    """Distinct tasks for an interval of this spread to clear the limit: its width shrinks as 1/sqrt(tasks). Not
    requests: at temperature 0 a repeated task repeats its output and its rounds, so repeats add no evidence."""
    if n == 0 or margin <= 0 or not math.isfinite(half_width):
        return None
    return max(n + 1, math.ceil(n * (half_width / margin) ** 2))
