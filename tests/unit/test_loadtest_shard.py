"""Sharded load tests: the split of the schedule and of the concurrency, and merging shards into one run."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import TypeAdapter, ValidationError

from dfserve.errors import FieldError, Untrusted, UserError
from dfserve.loadtest.cli import compare, merge_command
from dfserve.loadtest.merge import SHARDS_START_WITHIN_S, ShardRun, apart, check_shards, merge, read_shard
from dfserve.loadtest.schedule import LoadShape
from dfserve.sglang import SIM_MARKER_KEY
from dfserve.shard import Shard, parse_shard, shard_concurrency, shard_indices
from dfserve.stamped_socket import ReadLag
from tests.synthetic import run_config, synthetic, write_run


def test_parse_shard() -> None:
    assert parse_shard("2/3") == Shard(index=2, count=3)
    assert str(parse_shard("0/1")) == "0/1"
    for bad in ("3/3", "1", "a/3", "-1/3", "1/0", "1/3/4"):
        with pytest.raises(FieldError, match=r"^shard: "):
            parse_shard(bad)


@pytest.mark.parametrize(("total", "count"), [(10, 3), (3, 3), (2, 5), (408, 4), (1, 1)])
def test_shards_cover_the_schedule_exactly_once(total: int, count: int) -> None:
    parts = [list(shard_indices(total, Shard(index=i, count=count))) for i in range(count)]
    assert sorted(i for part in parts for i in part) == list(range(total))
    assert all(max(len(p) for p in parts) - len(part) <= 1 for part in parts)  # spread evenly
    assert list(shard_indices(total, None)) == list(range(total))


@pytest.mark.parametrize(("concurrency", "count"), [(8, 3), (3, 3), (16, 4), (7, 1)])
def test_concurrency_is_divided_between_shards(concurrency: int, count: int) -> None:
    parts = [shard_concurrency(concurrency, Shard(index=i, count=count)) for i in range(count)]
    assert sum(parts) == concurrency and min(parts) >= 1 and max(parts) - min(parts) <= 1
    with pytest.raises(FieldError, match=r"^concurrency: 2 cannot be divided between 3 shards") as refused:
        shard_concurrency(2, Shard(index=0, count=3))
    assert refused.value.render({"concurrency": "--concurrency"}).startswith("--concurrency: 2 cannot be divided")


def shard_runs(count: int, total: int = 12) -> list[ShardRun]:
    """The shards of one synthetic run: shard i holds the records of its indexes, its clock starting i s late."""
    whole = synthetic("zlab", total, 3.0, seed=1) + synthetic("inhouse", total, 4.0, seed=2)
    runs = []
    for i in range(count):
        shard = Shard(index=i, count=count)
        config = run_config(f"shard-{i}", num_requests=total).model_copy(update={"shard": shard, "t0_unix_s": 100.0 + i})
        mine = set(shard_indices(total, shard))
        lag = {"zlab": ReadLag(reads=100 * (i + 1), late_reads=i, max_lag_s=0.001 * (3 - i))}
        runs.append(ShardRun(Path(f"runs/shard-{i}"), config, [r for r in whole if r.index in mine], False, lag,
                             {"zlab": len(mine), "inhouse": len(mine)}))
    return runs


def test_merge_orders_records_and_moves_them_to_one_clock() -> None:
    shards = shard_runs(3)
    merged = merge(list(reversed(shards)), "merged")
    assert [(r.index, r.arm) for r in merged.records] == [(i, a) for i in range(12) for a in ("zlab", "inhouse")]
    assert merged.config.run_id == "merged" and merged.config.shard is None
    assert merged.config.merged_from == ("shard-0", "shard-1", "shard-2") and merged.config.t0_unix_s == 100.0
    original = {(r.index, r.arm): r for s in shards for r in s.records}
    for record in merged.records:
        before = original[(record.index, record.arm)]
        late = record.index % 3
        assert record.first_token_s == pytest.approx((before.first_token_s or 0) + late)
        assert record.chunk_times_s == pytest.approx([t + late for t in before.chunk_times_s])
        assert record.model_dump(exclude={"dispatched_s", "sent_s", "first_token_s", "end_s", "chunk_times_s"}) == \
            before.model_dump(exclude={"dispatched_s", "sent_s", "first_token_s", "end_s", "chunk_times_s"})
    assert not merged.interrupted
    assert merged.read_lag == {"zlab": ReadLag(reads=600, late_reads=3, max_lag_s=0.003)}  # inhouse: none given
    shards[1] = replace(shards[1], interrupted=True, read_lag={})
    assert merge(shards, "m").interrupted


def test_merge_refuses_a_set_that_is_not_whole() -> None:
    shards = shard_runs(3)
    with pytest.raises(UserError, match=r"^merge: shard 1/3 missing \(given: 0/3, 2/3\)$"):
        check_shards([shards[0], shards[2]])
    with pytest.raises(UserError, match=r"^runs/shard-0: shard 0/3 given twice \(also runs/shard-0\)$"):
        check_shards([shards[0], shards[0], shards[1], shards[2]])
    other = shards[1].config.model_copy(update={"load": LoadShape(kind="closed", concurrency=4)})
    with pytest.raises(UserError, match=r"^runs/shard-1: not a shard of the same run as runs/shard-0 \(differs in load\)$"):
        check_shards([shards[0], replace(shards[1], config=other), shards[2]])
    fewer = shard_runs(2)
    with pytest.raises(UserError, match=r"\(differs in shard count\)$"):
        check_shards([shards[0], fewer[1]])
    with pytest.raises(UserError, match=r"^merge: give the shard directories$"):
        check_shards([])


def with_documents(shard: ShardRun, arm: str, server_info: dict[str, Any] | None = None,
                   model_info: dict[str, Any] | None = None) -> ShardRun:
    """`shard` whose arm `arm` recorded these server documents (None: the shard's own, unchanged)."""
    arms = tuple(a.model_copy(update={"server_info": a.server_info if server_info is None else server_info,
                                      "model_info": a.model_info if model_info is None else model_info})
                 if a.name == arm else a for a in shard.config.arms)
    return replace(shard, config=shard.config.model_copy(update={"arms": arms}))


def test_merge_ignores_the_live_figures_in_server_documents() -> None:
    """Load, throughput and internal states change while a server runs: each shard reads them at its own start."""
    shards = shard_runs(2)
    live = {"last_gen_throughput": 12.5, "internal_states": [{"avg_spec_accept_length": 3.1, "memory_usage": 0.7}],
            "load": 17}
    for arm in ("zlab", "inhouse"):
        served = shards[1].config.arm(arm).server_info
        assert served is not None
        shards[1] = with_documents(shards[1], arm, {**served, **live})
    shards[1] = replace(shards[1], read_lag={})
    merged = merge(shards, "m")
    assert len(merged.records) == 24 and not merged.interrupted and merged.incomplete == ()


def test_an_arm_that_reached_another_server_in_a_shard_is_refused_unless_forced() -> None:
    """Shard 1's inhouse arm answered from another target, drafter, algorithm or simulator than shard 0's (a
    Service over replicas mid-rollout, an engine redeployed at one URL): merged, its records would be judged as
    shard 0's server's."""
    shards = shard_runs(2)
    served = shards[0].config.arm("inhouse").server_info
    assert served is not None
    model_info = {"model_path": "Qwen/Qwen3.6-27B", "weight_version": "default"}
    shards = [with_documents(shard, "inhouse", model_info=model_info) for shard in shards]
    cases = [
        ({**served, "speculative_draft_model_path": "ours/drafter-v2"}, None,
         "server_info.draft_model_path is /models/dflash-inhouse in shard 0/2, ours/drafter-v2 in shard 1/2"),
        ({**served, "model_path": "Qwen/Qwen3.6-35B"}, None,
         "server_info.model_path is Qwen/Qwen3.6-27B in shard 0/2, Qwen/Qwen3.6-35B in shard 1/2"),
        ({**served, "speculative_algorithm": "EAGLE3"}, None,
         "server_info.speculative_algorithm is not set in shard 0/2, EAGLE3 in shard 1/2"),
        ({**served, SIM_MARKER_KEY: True}, None, "server_info.simulated is False in shard 0/2, True in shard 1/2"),
        (None, {**model_info, "model_path": "Qwen/Qwen3.6-35B"},
         "model_info.model_path is Qwen/Qwen3.6-27B in shard 0/2, Qwen/Qwen3.6-35B in shard 1/2"),
    ]
    for server_info, other_model_info, difference in cases:
        other = with_documents(shards[1], "inhouse", server_info, other_model_info)
        line = (f"runs/shard-1: shard 1/2 reached another server than shard 0/2 (runs/shard-0): arm inhouse's "
                f"{difference}")
        with pytest.raises(Untrusted, match=f"^{re.escape(line)}$"):
            merge([shards[0], other], "m")
        forced = merge([other, shards[0]], "m", force=True)
        assert forced.interrupted and forced.incomplete == (line,) and len(forced.records) == 24
        assert forced.config.arms == shards[0].config.arms  # the documents kept are shard 0's, so it says so
    missing = replace(shards[1], config=shards[1].config.model_copy(update={"arms": tuple(
        a.model_copy(update={"server_info": None}) for a in shards[1].config.arms)}))
    with pytest.raises(Untrusted) as refused:
        merge([shards[0], missing], "m")
    assert str(refused.value).endswith("arm zlab's server_info is recorded in shard 0/2, not recorded in shard 1/2; "
                                       "arm inhouse's server_info is recorded in shard 0/2, not recorded in shard 1/2")


def test_a_whole_run_is_not_a_shard(tmp_path: Path) -> None:
    whole = write_run(tmp_path, run_config("whole"), synthetic("zlab", 4, 3.0, seed=1))
    with pytest.raises(FieldError) as refused:
        read_shard(whole)
    assert refused.value.field == "shards"
    assert refused.value.render({"shards": "SHARDS", "shard": "--shard"}) == (
        f"SHARDS: {whole} is not a shard (run without --shard)")


def test_a_shard_that_lost_records_is_refused_unless_forced() -> None:
    """1/3 holds indexes 1, 4, 7, 10 of both arms, and its summary counts 4 each."""
    whole = shard_runs(3)
    lost_one = [r for r in whole[1].records if (r.arm, r.index) != ("inhouse", 10)]
    cases = [
        (replace(whole[1], cut=True), "requests.jsonl's last line is cut"),
        (replace(whole[1], records=lost_one), "arm inhouse: 3 measured records in requests.jsonl, summary.json "
         "counts 4; arm inhouse: indexes 10 of its schedule have no record"),
        (replace(whole[1], records=[]), "arm zlab: 0 measured records in requests.jsonl, summary.json counts 4; "
         "arm zlab: indexes 1, 4, 7, 10 of its schedule have no record"),
        (replace(whole[1], records=lost_one, counted={"zlab": 4, "inhouse": 3}),
         "arm inhouse: indexes 10 of its schedule have no record"),
        (replace(whole[1], counted={"zlab": 4}), "arm inhouse: not in summary.json"),
        (replace(whole[1], edited="shard-1/requests.jsonl is not as its writer left it"),
         "shard-1/requests.jsonl is not as its writer left it"),
    ]
    for shard, problem in cases:
        shards = [whole[0], shard, whole[2]]
        with pytest.raises(Untrusted) as refused:
            merge(shards, "m")
        assert str(refused.value).startswith(f"runs/shard-1: shard 1/3 lost records ({problem}")
        assert str(refused.value).endswith(")") and "--" not in str(refused.value)
        forced = merge(shards, "m", force=True)
        assert forced.interrupted and len(forced.incomplete) == 1
        assert forced.incomplete[0].startswith(f"runs/shard-1: {problem}")
        assert len(forced.records) == sum(len(s.records) for s in shards)
    stopped = replace(whole[1], records=lost_one, counted={"zlab": 4, "inhouse": 3}, interrupted=True)
    assert merge([whole[0], stopped, whole[2]], "m").incomplete == ()  # Ctrl-C: fewer records, all counted
    assert not merge(whole, "m").interrupted


def test_shards_not_started_together_are_refused_unless_forced() -> None:
    """Shard 1 of another launch of the same configuration, an hour later: its load never met shard 0's."""
    shards = shard_runs(2)
    ended = max(max(r.dispatched_s, r.end_s or 0.0) for r in shards[0].records)

    def started(late_s: float) -> ShardRun:
        """Shard 1 started `late_s` after shard 0."""
        return replace(shards[1], config=shards[1].config.model_copy(update={"t0_unix_s": 100.0 + late_s}))

    assert ended < SHARDS_START_WITHIN_S
    assert merge([shards[0], started(SHARDS_START_WITHIN_S)], "m").incomplete == ()  # short shards start unevenly
    long_shard = replace(shards[0], records=[r.model_copy(update={"end_s": 900.0}) if r.index == 0 else r
                                             for r in shards[0].records])
    assert apart([long_shard, started(600.0)]) is None  # a slow start, while shard 0 was still running
    refusal = ("shard 1/2 (runs/shard-1) started 3600.0 s after shard 0/2 (runs/shard-0), which had ended by then: the "
               "shards of one run run together")
    with pytest.raises(Untrusted, match=f"^{re.escape(refusal)}$"):
        merge([shards[0], started(3600.0)], "m")
    forced = merge([started(3600.0), shards[0]], "m", force=True)
    assert forced.interrupted and forced.incomplete == (refusal,)


def test_duplicated_or_foreign_records_are_never_merged() -> None:
    whole = shard_runs(3)
    first = whole[1].records[0]
    foreign = first.model_copy(update={"index": 2})
    stranger = first.model_copy(update={"arm": "other"})
    cases = [
        (replace(whole[1], records=[*whole[1].records, first]), f"arm {first.arm}: indexes {first.index} recorded twice"),
        (replace(whole[1], records=[*whole[1].records, foreign]), "indexes 2 outside shard 1/3's part of the schedule"),
        (replace(whole[1], records=[*whole[1].records, stranger]), "records of arms ['other'] it does not have"),
    ]
    for shard, problem in cases:
        for force in (False, True):
            with pytest.raises(UserError, match=rf"^runs/shard-1: shard 1/3 holds {re.escape(problem)}; it is never "
                               "merged$"):
                merge([whole[0], shard, whole[2]], "m", force=force)


def killed_shards(out: Path) -> list[Path]:
    """Shards 0/2 and 1/2 of one launch; 1/2 killed mid-write: no summary.json, its last line torn."""
    records = synthetic("zlab", 12, 3.0, seed=1) + synthetic("inhouse", 12, 4.0, seed=2)
    folders = []
    for i in range(2):
        shard = Shard(index=i, count=2)
        config = run_config(f"shard-{i}", num_requests=12).model_copy(update={"shard": shard, "t0_unix_s": 100.0 + i})
        mine = set(shard_indices(12, shard))
        folders.append(write_run(out, config, [r for r in records if r.index in mine], summary=i == 0))
    with (folders[1] / "requests.jsonl").open("a") as requests:
        requests.write('{"arm": "zlab", "index": 13, "task_')
    return folders


def test_a_killed_shard_is_refused_saying_what_to_do_and_merged_as_it_is_when_forced(tmp_path: Path) -> None:
    folders = killed_shards(tmp_path)
    killed = read_shard(folders[1])
    assert killed.unfinished and killed.interrupted and killed.cut and len(killed.records) == 12  # the torn line read
    shards = [read_shard(folders[0]), killed]
    refusal = (f"{folders[1]}: shard 1/2 has no summary.json: it was killed (run the 2 shards again, together) or "
               "has not finished (wait for it)")
    with pytest.raises(Untrusted, match=f"^{re.escape(refusal)}$"):
        merge(shards, "m")
    forced = merge(shards, "m", force=True)
    assert forced.interrupted and len(forced.records) == 24
    assert forced.incomplete == (f"{folders[1]}: no summary.json: killed, or not finished; requests.jsonl's last "
                                 "line is cut",)
    cut_short = replace(killed, records=killed.records[:-3], cut=False)
    assert merge([shards[0], cut_short], "m", force=True).incomplete == (
        f"{folders[1]}: no summary.json: killed, or not finished",)  # nothing counts what it sent


def test_a_forced_merge_of_a_killed_shard_is_judged_only_forced(tmp_path: Path) -> None:
    """Through the commands: merge refuses naming what to do; forced, the run is interrupted, so compare refuses it
    in turn unless forced, and stamps the verdict."""
    folders = killed_shards(tmp_path / "shards")
    refused = CliRunner().invoke(merge_command, [*map(str, folders), "--out", str(tmp_path / "runs")],
                                 standalone_mode=False)
    assert isinstance(refused.exception, UserError) and not (tmp_path / "runs").exists()
    assert str(refused.exception) == (f"{folders[1]}: shard 1/2 has no summary.json: it was killed (run the 2 shards "
                                      "again, together) or has not finished (wait for it); --force merges what the "
                                      "shards hold, marked interrupted")
    forced = CliRunner().invoke(merge_command, [*map(str, folders), "--out", str(tmp_path / "runs"), "--name", "m",
                                                "--force"], standalone_mode=False)
    assert forced.exception is None, forced.output
    assert f"forced: {folders[1]}: no summary.json: killed, or not finished" in forced.output
    merged = tmp_path / "runs" / "m"
    assert json.loads((merged / "summary.json").read_text())["interrupted"] is True
    judged = CliRunner().invoke(compare, [str(merged), "--out", str(tmp_path / "verdicts")], standalone_mode=False)
    assert isinstance(judged.exception, UserError) and "interrupted" in str(judged.exception)
    assert not (tmp_path / "verdicts").exists()
    CliRunner().invoke(compare, [str(merged), "--out", str(tmp_path / "verdicts"), "--force"], standalone_mode=False)
    [verdict] = (tmp_path / "verdicts").glob("verdict-*/verdict.json")
    assert json.loads(verdict.read_text())["forced"] is True


def test_read_lag_read_back_from_a_summary_is_validated() -> None:
    """Negative counts, more late reads than reads, a negative or NaN wait: refused in one line naming the field."""
    good = {"reads": 10, "late_reads": 2, "max_lag_s": 0.004}
    adapter = TypeAdapter(ReadLag)
    assert adapter.validate_python(good) == ReadLag(10, 2, 0.004)
    for bad, field in [({"reads": -1, "late_reads": 0}, "reads"), ({"late_reads": -3}, "late_reads"),
                       ({"max_lag_s": -0.5}, "max_lag_s"), ({"max_lag_s": float("nan")}, "max_lag_s"),
                       ({"late_reads": 11}, "late_reads 11 is more than reads 10")]:
        with pytest.raises(ValidationError, match=re.escape(field)):
            adapter.validate_python({**good, **bad})


def test_a_shard_whose_records_were_edited_after_its_summary_says_so(tmp_path: Path) -> None:
    config = run_config("shard-0", num_requests=4).model_copy(update={"shard": Shard(index=0, count=2)})
    folder = write_run(tmp_path, config, [r for r in synthetic("zlab", 4, 3.0, seed=1) if r.index % 2 == 0])
    assert read_shard(folder).edited is None
    requests = folder / "requests.jsonl"
    requests.write_text(requests.read_text().replace('"zlab"', '"zlab" '))
    edited = read_shard(folder).edited
    assert edited is not None and edited.endswith("is not as its writer left it (its sha256 is not summary.json's): edited")
    other = write_run(tmp_path, config.model_copy(update={"run_id": "shard-0b"}),
                      [r for r in synthetic("zlab", 4, 3.0, seed=1) if r.index % 2 == 0])
    (other / "config.json").write_text((other / "config.json").read_text().replace('"run_id"', ' "run_id"', 1))
    edited = read_shard(other).edited
    assert edited is not None and edited.startswith("shard-0b/config.json is not as its writer left it")
    late = write_run(tmp_path, config.model_copy(update={"run_id": "shard-0c"}),
                     [r for r in synthetic("zlab", 4, 3.0, seed=1) if r.index % 2 == 0], interrupted=True)
    summary = late / "summary.json"
    summary.write_text(summary.read_text().replace('"interrupted": true', '"interrupted": false'))
    assert '"interrupted": false' in summary.read_text() and not read_shard(late).interrupted
    edited = read_shard(late).edited  # an interrupted shard turned whole merged as whole
    assert edited == ("shard-0c/summary.json is not as its writer left it (its fields' sha256 is not the one it "
                      "holds): edited")
