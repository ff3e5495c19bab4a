"""Shard i of n: the part of a one-process load-test schedule (or of an eval run's task list) that one of n processes (pods) takes.

Shard i takes the schedule's indexes i, i + n, i + 2n, ...: the union of all shards is exactly the one-process
schedule, each index keeps its task and (open loop) its offset from the start, and every arm of a shard gets the
same indexes, so each task is still paired across arms within one process. Interleaving (rather than cutting the
schedule into blocks) spreads every shard over the whole run, so n shards started together offer the load of one
process. The concurrency (closed loop, or the open loop's cap) is divided between the shards, so together they keep
as many requests in flight as one process would.

    shard = parse_shard("1/3")
    shard_indices(10, shard)          # [1, 4, 7]
    shard_concurrency(8, shard)       # 3 (shards get 3, 3, 2)
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dfserve.errors import FieldError


class Shard(BaseModel):
    """Which shard a run is, recorded in its config.json (`dfserve loadtest merge` checks the set is whole)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, description="0-based, as Kubernetes' JOB_COMPLETION_INDEX")
    count: int = Field(ge=1)

    @model_validator(mode="after")
    def _check(self) -> Shard:
        if self.index >= self.count:
            raise ValueError(f"shard index {self.index} is not below the shard count {self.count}")
        return self

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """`--shard I/N`, e.g. `0/3`."""
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit():
        raise FieldError("shard", f"{text!r} is not I/N (0-based index, count), e.g. 0/3")
    if not 0 <= int(index) < int(count):
        raise FieldError("shard", f"{text!r} needs 0 <= I < N")
    return Shard(index=int(index), count=int(count))


def shard_indices(total: int, shard: Shard | None) -> range:
    """The schedule indexes this shard sends (all of them without a shard)."""
    if shard is None:
        return range(total)
    return range(shard.index, total, shard.count)


def shard_concurrency(concurrency: int, shard: Shard | None) -> int:
    """This shard's part of the concurrency; the parts of all shards add up to `concurrency`."""
    if shard is None:
        return concurrency
    if concurrency < shard.count:
        raise FieldError("concurrency", f"{concurrency} cannot be divided between {shard.count} shards; "
                         "give at least one request in flight per shard")
    return concurrency // shard.count + (1 if shard.index < concurrency % shard.count else 0)
