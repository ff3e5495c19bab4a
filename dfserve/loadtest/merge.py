"""One run from the shards of a sharded load test (`dfserve loadtest run --shard I/N`), judged like any other.

The shards must be the whole set of one configuration: every shard index of one count exactly once, and the same
arms, tasks, load, sampling and limits in each (server documents aside: they hold live figures that differ from
one read to the next). Anything else is refused with one line naming the shard. Records keep their schedule index
and task; their times are moved from their shard's time zero to the earliest shard's, so the merged run has one
clock. The merged config.json names the shards it came from; the shards themselves are left as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dfserve.errors import UserError
from dfserve.loadtest.config import RunConfig, read_config
from dfserve.loadtest.records import RequestRecord, read_records
from dfserve.loadtest.report import Summary
from dfserve.runs import Provenance, read_model
from dfserve.stamped_socket import ReadLag

_PER_SHARD = {"run_id", "shard", "t0_unix_s", "provenance", "arms"}
"""Fields of config.json that differ between the shards of one run (the arms are compared without their documents)."""


@dataclass(frozen=True)
class ShardRun:
    path: Path
    config: RunConfig
    records: list[RequestRecord]
    interrupted: bool
    read_lag: dict[str, ReadLag]


@dataclass(frozen=True)
class Merged:
    config: RunConfig
    records: list[RequestRecord]
    interrupted: bool
    read_lag: dict[str, ReadLag]


def read_shard(path: Path) -> ShardRun:
    """A finished shard's directory; one without summary.json is still running or was killed."""
    config = read_config(path)
    if config.shard is None:
        raise UserError(f"{path}: not a shard (run without --shard)")
    summary = read_model(path / "summary.json", Summary,
                         f"{path}: no summary.json; shard {config.shard} has not finished")
    read_lag = {a.arm: a.tester_read_lag for a in summary.arms if a.tester_read_lag is not None}
    return ShardRun(path, config, list(read_records(path / "requests.jsonl")), summary.interrupted, read_lag)


def _identity(config: RunConfig) -> dict[str, Any]:
    """What every shard of one run shares."""
    arms = [(a.name, a.url, a.model, a.simulated, a.arrival_stamps) for a in config.arms]
    assert config.shard is not None
    return {**config.model_dump(exclude=_PER_SHARD), "arms": arms, "shard count": config.shard.count}


def check_shards(shards: Sequence[ShardRun]) -> list[ShardRun]:
    """The shards ordered by index; a `UserError` when they differ in configuration, repeat or leave one out."""
    if not shards:
        raise UserError("merge: give the shard directories")
    first = shards[0]
    expected = _identity(first.config)
    by_index: dict[int, ShardRun] = {}
    for shard in shards:
        identity = _identity(shard.config)
        differing = [key for key in expected if identity[key] != expected[key]]
        if differing:
            raise UserError(f"{shard.path}: not a shard of the same run as {first.path} "
                            f"(differs in {', '.join(differing)})")
        assert shard.config.shard is not None
        index = shard.config.shard.index
        if index in by_index:
            raise UserError(f"{shard.path}: shard {shard.config.shard} given twice (also {by_index[index].path})")
        by_index[index] = shard
    count = expected["shard count"]
    missing = [f"{i}/{count}" for i in range(count) if i not in by_index]
    if missing:
        raise UserError(f"merge: shard {', '.join(missing)} missing (given: "
                        f"{', '.join(f'{i}/{count}' for i in sorted(by_index))})")
    return [by_index[i] for i in range(count)]


def shifted(record: RequestRecord, by: float) -> RequestRecord:
    """`record` with its run-relative times moved by `by` seconds (wall-clock fields stay)."""
    def move(value: float | None) -> float | None:
        return None if value is None else value + by

    return record.model_copy(update={
        "scheduled_s": move(record.scheduled_s), "dispatched_s": record.dispatched_s + by, "sent_s": move(record.sent_s),
        "first_token_s": move(record.first_token_s), "end_s": move(record.end_s),
        "chunk_times_s": [t + by for t in record.chunk_times_s]})


def merge(shards: Sequence[ShardRun], run_id: str) -> Merged:
    """The shards as one run named `run_id`: records in schedule order (arms in config order within an index)."""
    ordered = check_shards(shards)
    t0 = min(s.config.t0_unix_s for s in ordered)
    arm_order = {arm.name: i for i, arm in enumerate(ordered[0].config.arms)}
    records = [shifted(r, s.config.t0_unix_s - t0) for s in ordered for r in s.records]
    records.sort(key=lambda r: (r.index, arm_order.get(r.arm, len(arm_order))))
    config = ordered[0].config.model_copy(update={
        "run_id": run_id, "shard": None, "merged_from": tuple(s.config.run_id for s in ordered), "t0_unix_s": t0,
        "provenance": Provenance.here()})
    read_lag: dict[str, ReadLag] = {}
    for shard in ordered:
        for arm, lag in shard.read_lag.items():
            read_lag.setdefault(arm, ReadLag()).add(lag.reads, lag.late_reads, lag.max_lag_s)
    return Merged(config, records, any(s.interrupted for s in ordered), read_lag)
