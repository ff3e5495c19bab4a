"""The one contract of a design (pairs, their metrics and a gate in; a judgement out) and what designs record.

`fixed.FixedN` judges a fixed number of pairs on a paired task bootstrap; `sequential.Sequential` replays the looks
of a run that stopped as soon as its gate was decided, on always-valid intervals. A source picks one and calls it;
neither knows where the pairs came from. `SequentialDesign` is written into a run's config.json before it starts,
`SequentialReport` into its verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from dfserve.verdict.gate import Gate
from dfserve.verdict.pairs import MetricSpec, Pairs
from dfserve.verdict.results import Judgement, Status
from dfserve.verdict.stats import MIN_CLUSTERS

METHOD = ("always-valid confidence sequences: normal mixture (mSPRT) on the log change of ratio metrics, scale = "
          "the rule's max_worse (at least 0.01), delta-method standard error over tasks; beta-binomial mixture "
          "(Jeffreys) for error rates, identical-output fractions and quantile ranks")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SequentialDesign(_Model):
    """How an `--until-decided` run looks at its data and when it stops (see `sequential.py`)."""

    method: Literal["confidence-sequences"] = "confidence-sequences"
    alpha: float = Field(0.05, gt=0, lt=1, description="each rule's interval holds at every look at once with "
                         "probability 1 - alpha (two-sided; the fixed-n judge's intervals are 95% too)")
    look_every: int = Field(16, ge=1, description="paired requests of the schedule between looks")
    min_tasks: int = Field(16, ge=MIN_CLUSTERS, description="distinct tasks before any rule is decided: the normal "
                           "approximation of a ratio's change needs a few, and a bootstrap over fewer than "
                           f"{MIN_CLUSTERS} decides nothing")
    gate: Gate = Field(description="the rules the run stops on")


def another_gate(design: SequentialDesign, gate: Gate) -> str | None:
    """Why `gate` cannot judge records that stopped on `design` unless forced: where they stopped was the design
    gate's decision, so another gate's verdict would rest on a sample sized for a different question. None when
    `gate` is the design's."""
    if gate == design.gate:
        return None
    return ("the records stopped on their sequential design's gate (rules on "
            f"{', '.join(rule.metric for rule in design.gate.rules)}); another gate's verdict would rest on a sample "
            "that gate did not decide")


class SequentialReport(_Model):
    """How a sequential run was decided; restated in its verdict."""

    method: str = METHOD
    design: SequentialDesign
    looks: int = Field(description="looks up to and including the one the run stopped on (or its last)")
    stopped: Literal["decided", "task_set", "end"] = Field(
        description="decided: the verdict was decided; task_set: every undecided rule was limited by the task set; "
                    "end: the run ended first (its maximum, --duration or an interrupt)")
    stopped_after_pairs: int = Field(description="paired requests at that look")
    verdict_when_stopped: Status
    pairs: int = Field(description="paired requests judged: requests in flight at the stop finished and count too")
    live: bool = Field(False, description="decided on live traffic as the gateway mirrored it (pairs in the order "
                       "of their request ids), not on a load test's schedule")


@dataclass(frozen=True)
class Outcome:
    judgement: Judgement
    sequential: SequentialReport | None = None


class Design(Protocol):
    def judge(self, pairs: Pairs[Any], metrics: Mapping[str, MetricSpec[Any]], gate: Gate) -> Outcome: ...
