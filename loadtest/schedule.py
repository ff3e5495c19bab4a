"""Arrival processes: when each request of a run is due. Pure and seeded, so every arm gets the identical schedule.

Closed loop keeps `concurrency` requests in flight and has no offsets (the next request leaves when one finishes);
open loop (Poisson or constant) fixes every request's offset from the start of the run in advance, optionally with a
concurrency cap whose waiting time the runner records.

    load = LoadShape(kind="poisson", rate=20.0, seed=1)
    offsets = load.offsets(200)   # the same list for every arm
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ArrivalKind = Literal["closed", "poisson", "constant"]


class LoadShape(BaseModel):
    """Everything that shapes the load; recorded in config.json and compared by the judge."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: ArrivalKind = Field(description="closed loop, or open loop with Poisson or evenly spaced arrivals")
    concurrency: int | None = Field(None, description="closed loop: requests in flight; open loop: optional cap")
    rate: float | None = Field(None, description="open loop: requests per second")
    seed: int = Field(0, description="seeds the Poisson gaps and the task order")

    @model_validator(mode="after")
    def _check(self) -> LoadShape:
        if self.kind == "closed":
            if self.concurrency is None or self.concurrency < 1:
                raise ValueError("closed loop needs --concurrency >= 1")
            if self.rate is not None:
                raise ValueError("closed loop takes no --rate")
        else:
            if self.rate is None or self.rate <= 0:
                raise ValueError(f"{self.kind} arrivals need --rate > 0")
            if self.concurrency is not None and self.concurrency < 1:
                raise ValueError("--concurrency cap must be >= 1")
        return self

    def offsets(self, count: int) -> list[float] | None:
        """Seconds from the start of the run at which request i is due; None for closed loop."""
        if self.kind == "closed":
            return None
        assert self.rate is not None
        if self.kind == "constant":
            return [i / self.rate for i in range(count)]
        return poisson_offsets(self.rate, count, random.Random(self.seed))


def poisson_offsets(rate: float, count: int, rng: random.Random) -> list[float]:
    """Exponential gaps from one generator: the first request leaves at 0, the rest after cumulative gaps."""
    offsets = [0.0]
    for _ in range(count - 1):
        offsets.append(offsets[-1] + rng.expovariate(rate))
    return offsets[:count]
