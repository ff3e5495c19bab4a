"""trend.json: a training run's checkpoints scored one after another against one baseline, and where the run is
heading (`projection.project` per method).

Every point names the eval run holding its records (immutable, as any eval run), so the trend can be rebuilt from
the runs alone; the judgement of each point pairs it with the baseline's run by task, the baseline scored once::

    trend = build_trend(methods, baseline, points, skipped, corrupt)
    trend.projections["vanilla"].outcome   # 'will_reach', 'plateau_below', ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dfserve.eval.projection import Projection, project
from dfserve.eval.records import DrafterSummary, Figure, Judgement
from dfserve.runs import utc_now_iso

Z95 = 1.959964


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Scored(_Model):
    """τ of one drafter in one eval run, per method, and its per-position accuracy."""

    run_id: str
    run_dir: str
    tau: dict[str, Figure] = Field(description="per method: Σ tokens / Σ rounds with its 95% interval over tasks")
    accuracy: list[float | None] = Field(description="accuracy of each block position's draft, position 1 first")


class TrendBaseline(Scored):
    drafter: str = Field(description="the baseline as given: zlab, baseline, a folder or a checkpoint")
    identity: str


class TrendPoint(Scored):
    step: int
    checkpoint: str = Field(description="path relative to the watched checkpoint folder")
    judgement: Judgement = Field(description="this checkpoint against the baseline, paired by task")


class Passed(_Model):
    """A checkpoint the trend holds no point for, and why."""

    checkpoint: str
    step: int | None
    detail: str


class Trend(_Model):
    schema_version: Literal[1] = 1
    kind: Literal["eval-trend"] = "eval-trend"
    methods: tuple[str, ...]
    baseline: TrendBaseline
    points: tuple[TrendPoint, ...] = Field(description="by step")
    skipped: tuple[Passed, ...] = Field(description="complete, never judged: newer ones arrived first, or it holds the "
                                     "baseline's own weights")
    corrupt: tuple[Passed, ...] = Field(description="stable on disk but would not load or convert")
    projections: dict[str, Projection] = Field(description="per method, against the baseline's τ")
    updated_at: str


def scored(run_id: str, run_dir: str, drafter: DrafterSummary) -> dict[str, Any]:
    """The `Scored` fields of a drafter's summary."""
    return {"run_id": run_id, "run_dir": run_dir, "tau": {m.method: m.tau for m in drafter.methods},
            "accuracy": drafter.positions.accuracy}


def build_trend(methods: Sequence[str], baseline: TrendBaseline, points: Sequence[TrendPoint],
                skipped: Sequence[Passed], corrupt: Sequence[Passed]) -> Trend:
    ordered = sorted(points, key=lambda p: p.step)
    projections = {
        method: project([p.step for p in ordered], [p.tau[method].estimate for p in ordered],
                        baseline.tau[method].estimate,
                        tau_se=[(p.tau[method].high - p.tau[method].low) / (2 * Z95) for p in ordered])
        for method in methods
    }
    return Trend(methods=tuple(methods), baseline=baseline, points=tuple(ordered), skipped=tuple(skipped),
                 corrupt=tuple(corrupt), projections=projections, updated_at=utc_now_iso())
