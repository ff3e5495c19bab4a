"""Sharded load tests: the split of the schedule and of the concurrency, and merging shards into one run."""

from __future__ import annotations

from pathlib import Path

import pytest

from dfserve.errors import UserError
from dfserve.loadtest.merge import ShardRun, check_shards, merge
from dfserve.loadtest.schedule import LoadShape
from dfserve.loadtest.shard import Shard, parse_shard, shard_concurrency, shard_indices
from dfserve.stamped_socket import ReadLag
from tests.synthetic import run_config, synthetic


def test_parse_shard() -> None:
    assert parse_shard("2/3") == Shard(index=2, count=3)
    assert str(parse_shard("0/1")) == "0/1"
    for bad in ("3/3", "1", "a/3", "-1/3", "1/0", "1/3/4"):
        with pytest.raises(UserError, match=r"^--shard: "):
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
    with pytest.raises(UserError, match=r"^--concurrency: 2 cannot be divided between 3 shards"):
        shard_concurrency(2, Shard(index=0, count=3))


def shard_runs(count: int, total: int = 12) -> list[ShardRun]:
    """The shards of one synthetic run: shard i holds the records of its indexes, its clock starting i s late."""
    whole = synthetic("zlab", total, 3.0, seed=1) + synthetic("inhouse", total, 4.0, seed=2)
    runs = []
    for i in range(count):
        shard = Shard(index=i, count=count)
        config = run_config(f"shard-{i}", num_requests=total).model_copy(update={"shard": shard, "t0_unix_s": 100.0 + i})
        mine = set(shard_indices(total, shard))
        lag = {"zlab": ReadLag(reads=100 * (i + 1), late_reads=i, max_lag_s=0.001 * (3 - i))}
        runs.append(ShardRun(Path(f"runs/shard-{i}"), config, [r for r in whole if r.index in mine], False, lag))
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
    shards[1] = ShardRun(shards[1].path, shards[1].config, shards[1].records, True, {})
    assert merge(shards, "m").interrupted


def test_merge_refuses_a_set_that_is_not_whole() -> None:
    shards = shard_runs(3)
    with pytest.raises(UserError, match=r"^merge: shard 1/3 missing \(given: 0/3, 2/3\)$"):
        check_shards([shards[0], shards[2]])
    with pytest.raises(UserError, match=r"^runs/shard-0: shard 0/3 given twice \(also runs/shard-0\)$"):
        check_shards([shards[0], shards[0], shards[1], shards[2]])
    other = shards[1].config.model_copy(update={"load": LoadShape(kind="closed", concurrency=4)})
    with pytest.raises(UserError, match=r"^runs/shard-1: not a shard of the same run as runs/shard-0 \(differs in load\)$"):
        check_shards([shards[0], ShardRun(shards[1].path, other, [], False, {}), shards[2]])
    fewer = shard_runs(2)
    with pytest.raises(UserError, match=r"\(differs in shard count\)$"):
        check_shards([shards[0], fewer[1]])
    with pytest.raises(UserError, match=r"^merge: give the shard directories$"):
        check_shards([])


def test_merge_ignores_the_live_figures_in_server_documents() -> None:
    shards = shard_runs(2)
    arms = tuple(a.model_copy(update={"server_info": {"last_gen_throughput": 12.5}}) for a in shards[1].config.arms)
    shards[1] = ShardRun(shards[1].path, shards[1].config.model_copy(update={"arms": arms}), shards[1].records, False,
                         {})
    assert len(merge(shards, "m").records) == 24
