"""One run from the shards of a sharded load test (`dfserve loadtest run --shard I/N`), judged like any other.

The shards must be the whole set of one launch of one configuration: every shard index of one count exactly once,
and the same arms, tasks, load, sampling and limits in each. Anything else is refused with one line naming the
shard. Each arm's server documents are compared on what says which server answered (`server_identity`: target,
drafter, speculative algorithm, simulated marker, /model_info's model path), never on their live figures, which
differ from one read to the next: an arm that reached another server in one shard (a Service mid-rollout, an engine
redeployed at its URL) is refused unless forced (then `interrupted`, as below), since the merged run names shard 0's
server for all of it. Each shard's records are checked against what the shard says it sent, since a lost line would
otherwise drop a request from the verdict unseen: every record's index in the shard's part of the schedule, no (arm,
index) twice, each arm's measured records as many as its summary.json counts, requests.jsonl not cut mid-line, and a
shard that ran to its end (not interrupted, no duration bound, no early stop) holding every index of its part for
every arm. Records missing or cut are refused unless forced (`force`): the merged run then holds what the shards
held and its summary says `interrupted`, so it is judged only as an incomplete run. So is a shard without
summary.json (killed, or still running): forced, its records are merged as far as requests.jsonl holds them whole,
with no count to check them against. So are shards of which one started over a minute after another had started and
ended (two launches of one configuration, or a shard run again): their load together is not the run's. Duplicated or
foreign records are refused even then: no merge can tell which copy is the request that was sent.

Records keep their schedule index and task; their times are moved from their shard's time zero to the earliest
shard's, so the merged run has one clock. The merged config.json names the shards it came from; the shards
themselves are left as they were.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dfserve.errors import FieldError, Untrusted, UserError
from dfserve.loadtest.config import ArmInfo, RunConfig, read_config
from dfserve.loadtest.records import RequestRecord, measured_records, read_records
from dfserve.loadtest.report import Summary
from dfserve.runs import Provenance, read_model, unsealed
from dfserve.sglang import parse_server_info
from dfserve.shard import shard_indices
from dfserve.stamped_socket import ReadLag
from dfserve.verdict.wording import shown

_PER_SHARD = {"run_id", "shard", "t0_unix_s", "provenance", "arms"}
"""Fields of config.json that differ between the shards of one run (the arms are compared without their documents,
whose identity `other_servers` compares)."""


@dataclass(frozen=True)
class ShardRun:
    path: Path
    config: RunConfig
    records: list[RequestRecord]
    interrupted: bool
    read_lag: dict[str, ReadLag]
    counted: dict[str, int]
    """Each arm's measured requests as the shard's summary.json counts them."""
    cut: bool = False
    """requests.jsonl ends mid-line (the torn line is not among `records`)."""
    edited: str | None = None
    """Why requests.jsonl or config.json is not as the shard's writer left it (`runs.unsealed`), if it is not."""
    unfinished: bool = False
    """No summary.json: the shard was killed or is still running, so nothing counts its records (`counted` and
    `read_lag` are empty, and it reads as `interrupted`)."""


@dataclass(frozen=True)
class Merged:
    config: RunConfig
    records: list[RequestRecord]
    interrupted: bool
    read_lag: dict[str, ReadLag]
    incomplete: tuple[str, ...] = ()
    """What forced merging let through: one line per shard whose records are missing or cut, whose arms reached
    other servers, or that did not start with the others."""


def read_shard(path: Path) -> ShardRun:
    """A shard's directory; one without summary.json (killed, or still running) is read as far as its records are
    whole, and marked `unfinished` for `check_shards` to refuse unless forced."""
    config = read_config(path)
    if config.shard is None:
        raise FieldError("shards", f"{path} is not a shard (run without {{other}})", other="shard")
    records = path / "requests.jsonl"
    summary_file = path / "summary.json"
    if not summary_file.exists():
        return ShardRun(path, config, list(read_records(records)), True, {}, {}, _ends_mid_line(records),
                        unfinished=True)
    summary = read_model(summary_file, Summary, f"{summary_file} does not exist")
    read_lag = {a.arm: a.tester_read_lag for a in summary.arms if a.tester_read_lag is not None}
    edited = (unsealed(records, summary.records_sha256) or unsealed(path / "config.json", summary.config_sha256)
              or summary.unsealed(summary_file))
    return ShardRun(path, config, list(read_records(records)), summary.interrupted, read_lag,
                    {a.arm: a.requests for a in summary.arms}, _ends_mid_line(records), edited)


def _ends_mid_line(path: Path) -> bool:
    """Whether the file's last line has no newline: every line the writer appends ends in one."""
    with path.open("rb") as handle:
        if handle.seek(0, 2) == 0:
            return False
        handle.seek(-1, 2)
        return handle.read(1) != b"\n"


def _listed(indexes: Sequence[int]) -> str:
    shown = ", ".join(map(str, indexes[:5]))
    return f"{shown}, ... ({len(indexes)} in all)" if len(indexes) > 5 else shown


def tampered(shard: ShardRun) -> list[str]:
    """Records no merge may keep: of an arm the shard has not, outside its part of the schedule, or twice."""
    config = shard.config
    mine = set(shard_indices(config.warmup + config.num_requests, config.shard))
    arms = {arm.name for arm in config.arms}
    problems = []
    if foreign := sorted({r.arm for r in shard.records} - arms):
        problems.append(f"records of arms {foreign} it does not have")
    if outside := sorted({r.index for r in shard.records if r.index not in mine}):
        problems.append(f"indexes {_listed(outside)} outside shard {config.shard}'s part of the schedule")
    twice = Counter((r.arm, r.index) for r in shard.records)
    for arm in config.arms:
        if repeated := sorted(index for (name, index), n in twice.items() if name == arm.name and n > 1):
            problems.append(f"arm {arm.name}: indexes {_listed(repeated)} recorded twice")
    return problems


def incomplete(shard: ShardRun) -> list[str]:
    """What a shard lost: its summary.json (killed, or not finished), a cut last line, fewer measured records than
    its summary counts, and for a shard that ran to its end, indexes of its part of the schedule without a record."""
    config = shard.config
    problems = ["no summary.json: killed, or not finished"] if shard.unfinished else []
    if shard.cut:
        problems.append("requests.jsonl's last line is cut")
    ran_to_end = not shard.interrupted and config.duration_s is None and config.sequential is None
    schedule = shard_indices(config.warmup + config.num_requests, config.shard)
    for arm in config.arms:
        records = [r for r in shard.records if r.arm == arm.name]
        measured, counted = len(measured_records(records)), shard.counted.get(arm.name)
        if counted is None and not shard.unfinished:
            problems.append(f"arm {arm.name}: not in summary.json")
        elif counted is not None and measured != counted:
            problems.append(f"arm {arm.name}: {measured} measured records in requests.jsonl, summary.json counts "
                            f"{counted}")
        held = {r.index for r in records}
        if ran_to_end and (missing := [i for i in schedule if i not in held]):
            problems.append(f"arm {arm.name}: indexes {_listed(missing)} of its schedule have no record")
    if shard.edited is not None:
        problems.append(shard.edited)
    return problems


SHARDS_START_WITHIN_S = 60.0
"""How far apart the shards of one launch may start whatever their length (hosts and pods start unevenly, and a
shard's probes wait for a busy server)."""


def _ended_unix_s(shard: ShardRun) -> float:
    """When the shard's last answer ended (its start, without records)."""
    return shard.config.t0_unix_s + max((max(r.dispatched_s, r.end_s or 0.0) for r in shard.records), default=0.0)


def apart(shards: Sequence[ShardRun]) -> str | None:
    """Why the shards are not of one launch, if they are not: the last to start started over a minute after the
    first and after it had ended. The load of a run is its shards' load together, so shards of two launches of one
    configuration (or a shard run again later) never make one run."""
    if len(shards) < 2:
        return None
    first = min(shards, key=lambda shard: shard.config.t0_unix_s)
    late = max(shards, key=lambda shard: shard.config.t0_unix_s)
    after_s = late.config.t0_unix_s - first.config.t0_unix_s
    if after_s <= SHARDS_START_WITHIN_S or late.config.t0_unix_s <= _ended_unix_s(first):
        return None
    return (f"shard {late.config.shard} ({late.path}) started {after_s:.1f} s after shard {first.config.shard} "
            f"({first.path}), which had ended by then: the shards of one run run together")


def server_identity(arm: ArmInfo) -> dict[str, dict[str, Any] | None]:
    """What an arm's server documents say it is, by document and field: what `parse_server_info` reads (target,
    drafter, speculative algorithm, simulated marker: settings fixed while a server runs) and /model_info's model
    path. None for a document the arm did not get; live figures (load, counters, internal states) are never read."""
    model_path = arm.model_info.get("model_path") if arm.model_info is not None else None
    return {"server_info": None if arm.server_info is None else asdict(parse_server_info(arm.server_info)),
            "model_info": None if arm.model_info is None else {"model_path": None if model_path is None
                                                               else str(model_path)}}


def _differing(first: ArmInfo, other: ArmInfo) -> list[tuple[str, str, str]]:
    """(field, first's value, other's value) for each field of `server_identity` the two arms differ in."""
    found: list[tuple[str, str, str]] = []
    in_other = server_identity(other)
    for document, fields in server_identity(first).items():
        other_fields = in_other[document]
        if fields is None or other_fields is None:
            if fields is not other_fields:
                found.append((document, "recorded" if fields is not None else "not recorded",
                              "recorded" if other_fields is not None else "not recorded"))
            continue
        found.extend((f"{document}.{field}", shown(fields.get(field)), shown(other_fields.get(field)))
                     for field in dict.fromkeys([*fields, *other_fields])
                     if fields.get(field) != other_fields.get(field))
    return found


def other_servers(shards: Sequence[ShardRun]) -> list[str]:
    """One line per shard some arm of which reported another server than in shard 0 (`server_identity`), naming
    each such arm and field with both values. A document recorded in one shard and not in the other counts too: the
    server it was missing from cannot be shown to be the same."""
    first = shards[0]
    first_arms = {arm.name: arm for arm in first.config.arms}
    lines = []
    for shard in shards[1:]:
        first_index, index = first.config.shard, shard.config.shard
        found = [f"arm {arm.name}'s {field} is {in_first} in shard {first_index}, {in_other} in shard {index}"
                 for arm in shard.config.arms if arm.name in first_arms
                 for field, in_first, in_other in _differing(first_arms[arm.name], arm)]
        if found:
            lines.append(f"{shard.path}: shard {index} reached another server than shard {first_index} "
                         f"({first.path}): " + "; ".join(found))
    return lines


def _identity(config: RunConfig) -> dict[str, Any]:
    """What every shard of one run shares."""
    arms = [(a.name, a.url, a.model, a.simulated, a.arrival_stamps) for a in config.arms]
    assert config.shard is not None
    return {**config.model_dump(exclude=_PER_SHARD), "arms": arms, "shard count": config.shard.count}


def check_shards(shards: Sequence[ShardRun], force: bool = False) -> list[ShardRun]:
    """The shards ordered by index; a `UserError` when they differ in configuration, repeat or leave one out, or
    when one holds records no merge may keep; `Untrusted` (unless `force`) when one has not finished or lost
    records, when an arm reached another server in one than in shard 0, or when they did not start together."""
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
    ordered = [by_index[i] for i in range(count)]
    for shard in ordered:
        if problems := tampered(shard):
            raise UserError(f"{shard.path}: shard {shard.config.shard} holds {'; '.join(problems)}; it is never "
                            "merged")
        if not force and shard.unfinished:
            raise Untrusted(f"{shard.path}: shard {shard.config.shard} has no summary.json: it was killed (run the "
                            f"{count} shards again, together) or has not finished (wait for it)")
        if not force and (problems := incomplete(shard)):
            raise Untrusted(f"{shard.path}: shard {shard.config.shard} lost records ({'; '.join(problems)})")
    if not force and (servers := other_servers(ordered)):
        raise Untrusted(servers[0])
    if not force and (why := apart(ordered)):
        raise Untrusted(why)
    return ordered


def shifted(record: RequestRecord, by: float) -> RequestRecord:
    """`record` with its run-relative times moved by `by` seconds (wall-clock fields stay)."""
    def move(value: float | None) -> float | None:
        return None if value is None else value + by

    return record.model_copy(update={
        "scheduled_s": move(record.scheduled_s), "dispatched_s": record.dispatched_s + by, "sent_s": move(record.sent_s),
        "first_token_s": move(record.first_token_s), "end_s": move(record.end_s),
        "chunk_times_s": [t + by for t in record.chunk_times_s]})


def merge(shards: Sequence[ShardRun], run_id: str, force: bool = False) -> Merged:
    """The shards as one run named `run_id`: records in schedule order (arms in config order within an index).
    Forced, what `check_shards` would refuse short of records no merge may keep is merged too, and the run is
    marked interrupted; its arms' server documents stay shard 0's."""
    ordered = check_shards(shards, force)
    lost = tuple(f"{s.path}: {'; '.join(problems)}" for s in ordered if (problems := incomplete(s)))
    lost += tuple(other_servers(ordered))
    if why := apart(ordered):
        lost += (why,)
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
    return Merged(config, records, bool(lost) or any(s.interrupted for s in ordered), read_lag, lost)
