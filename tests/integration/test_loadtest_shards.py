"""A load test sharded over three processes, merged into one run: the same records as one process sends for the
same seed, judged by `dfserve compare` like any run; an incomplete or mixed set of shards is refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dfserve.loadtest.records import RequestRecord, read_records
from tests.integration.servers import dfserve_argv, sim_server

pytestmark = pytest.mark.slow
LOAD = ("--num-requests", "30", "--warmup", "3", "--max-new-tokens", "64", "--seed", "7", "--quiet")
TIMINGS = {"scheduled_s", "dispatched_s", "sent_s", "first_token_s", "end_s", "chunk_times_s", "server_e2e_latency_s",
           "sim_chunk_sent_unix_s", "sim_chunk_due_unix_s"}


def dfserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dfserve_argv(*args), capture_output=True, text=True, timeout=120)


def run(out: Path, arms: list[str], name: str, *extra: str) -> Path:
    done = dfserve("loadtest", "run", "--out", str(out), "--name", name, *arms, *LOAD, *extra)
    assert done.returncode == 0, done.stderr
    return out / name


def comparable(path: Path) -> list[dict[str, object]]:
    """The records apart from timings, in schedule order."""
    records: list[RequestRecord] = sorted(read_records(path / "requests.jsonl"), key=lambda r: (r.index, r.arm))
    return [r.model_dump(exclude=TIMINGS) for r in records]


@pytest.mark.parametrize("load", [("--concurrency", "6"), ("--rate", "40", "--concurrency", "4")],
                         ids=["closed", "open"])
def test_three_shards_merge_into_the_unsharded_run(tmp_path: Path, load: tuple[str, ...]) -> None:
    with sim_server("zlab", 0.002, 0) as zlab, sim_server("inhouse", 0.002, 0) as inhouse:
        arms = ["--arm", f"zlab={zlab}", "--arm", f"inhouse={inhouse}"]
        whole = run(tmp_path, arms, "whole", *load)
        shards = [run(tmp_path / "shards", arms, f"shard-{i}", *load, "--shard", f"{i}/3") for i in range(3)]
    for i, shard in enumerate(shards):
        assert {r.index for r in read_records(shard / "requests.jsonl")} == set(range(i, 33, 3))
    merged = dfserve("loadtest", "merge", *map(str, reversed(shards)), "--out", str(tmp_path), "--name", "merged")
    assert merged.returncode == 0, merged.stderr
    assert comparable(tmp_path / "merged") == comparable(whole)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["shard"] is None and config["merged_from"] == ["shard-0", "shard-1", "shard-2"]
    summary = json.loads((tmp_path / "merged" / "summary.json").read_text())
    assert [a["requests"] for a in summary["arms"]] == [30, 30]
    shard_arms = [json.loads((shard / "summary.json").read_text())["arms"] for shard in shards]
    for i, arm in enumerate(summary["arms"]):  # the tester's read lag: each shard's reads, the worst wait
        lag = arm["tester_read_lag"]
        assert lag["reads"] == sum(s[i]["tester_read_lag"]["reads"] for s in shard_arms) > 0
        assert lag["max_lag_s"] == max(s[i]["tester_read_lag"]["max_lag_s"] for s in shard_arms)
    judged = dfserve("compare", str(tmp_path / "merged"), "--out", str(tmp_path / "verdicts"))
    assert judged.returncode == 1, judged.stdout + judged.stderr  # the in-house drafter accepts fewer tokens
    verdict = json.loads(next((tmp_path / "verdicts").glob("verdict-*/verdict.json")).read_text())
    judgement = verdict["judgement"]
    assert judgement["pairs"] == 30 and judgement["lossless"]["identical"] == 30
    assert {r["metric"]: r["status"] for r in judgement["rules"]}["accept_length"] == "FAIL"


def test_merge_refuses_missing_duplicate_and_foreign_shards(tmp_path: Path) -> None:
    with sim_server("zlab", 0.002, 0) as zlab:
        arms = ["--arm", f"zlab={zlab}"]
        shards = [run(tmp_path, arms, f"s{i}", "--concurrency", "2", "--shard", f"{i}/2") for i in range(2)]
        foreign = run(tmp_path, arms, "foreign", "--concurrency", "4", "--shard", "1/2")
        whole = run(tmp_path, arms, "whole", "--concurrency", "2")
    cases = {
        (shards[0],): "dfserve: error: merge: shard 1/2 missing (given: 0/2)",
        (shards[0], shards[0], shards[1]): f"dfserve: error: {shards[0]}: shard 0/2 given twice (also {shards[0]})",
        (shards[0], foreign): f"dfserve: error: {foreign}: not a shard of the same run as {shards[0]} (differs in load)",
        (whole, shards[1]): f"dfserve: error: {whole}: not a shard (run without --shard)",
    }
    for given, line in cases.items():
        refused = dfserve("loadtest", "merge", *map(str, given), "--out", str(tmp_path / "merged"))
        assert refused.returncode == 2 and refused.stderr.strip() == line, refused.stderr
    assert not (tmp_path / "merged").exists()
    summary = shards[1] / "summary.json"  # an edited summary: a count with nothing to count it of
    document = json.loads(summary.read_text())
    document["arms"][0]["read_with_next"]["of_chunks"] = 0
    summary.write_text(json.dumps(document))
    refused = dfserve("loadtest", "merge", *map(str, shards), "--out", str(tmp_path / "merged"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"dfserve: error: {summary}: ") and "of_chunks" in refused.stderr
    assert not (tmp_path / "merged").exists()
    bad = dfserve("loadtest", "run", "--out", str(tmp_path), *arms, *LOAD, "--concurrency", "2", "--shard", "3/3")
    assert bad.returncode == 2 and bad.stderr.strip() == "dfserve: error: --shard: '3/3' needs 0 <= I < N"
