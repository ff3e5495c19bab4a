"""A load test sharded over three processes, merged into one run: the same records as one process sends for the
same seed, judged by `dfserve compare` like any run; an incomplete or mixed set of shards is refused."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dfserve.deploy.hashes import file_sha256
from dfserve.loadtest.records import RequestRecord, read_records
from dfserve.loadtest.report import Summary
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


def run_shards(out: Path, arms: list[str], prefix: str, count: int, *extra: str) -> list[Path]:
    """The `count` shards of one run, launched together as their processes would be on several hosts."""
    argvs = [dfserve_argv("loadtest", "run", "--out", str(out), "--name", f"{prefix}{i}", *arms, *LOAD, *extra,
                          "--shard", f"{i}/{count}") for i in range(count)]
    processes = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in argvs]
    for process in processes:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
    return [out / f"{prefix}{i}" for i in range(count)]


def comparable(path: Path) -> list[dict[str, object]]:
    """The records apart from timings, in schedule order."""
    records: list[RequestRecord] = sorted(read_records(path / "requests.jsonl"), key=lambda r: (r.index, r.arm))
    return [r.model_dump(exclude=TIMINGS) for r in records]


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, str]]:
    """The zlab and inhouse engines every test of the module loads: a simulated engine answers each request from
    its seed and the request alone, so runs after runs on one engine get the same records."""
    with sim_server("zlab", 0.002, 0) as zlab, sim_server("inhouse", 0.002, 0) as inhouse:
        yield {"zlab": zlab, "inhouse": inhouse}


@pytest.fixture(scope="module")
def two_shards(engines: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A run of the zlab engine in two shards, each shard complete; tests copy them before changing anything."""
    out = tmp_path_factory.mktemp("two-shards")
    return run_shards(out, ["--arm", f"zlab={engines['zlab']}"], "s", 2, "--concurrency", "2")


def copies(shards: list[Path], out: Path) -> list[Path]:
    copied = [out / shard.name for shard in shards]
    for shard, copy in zip(shards, copied, strict=True):
        shutil.copytree(shard, copy)
    return copied


@pytest.mark.parametrize("load", [("--concurrency", "6"), ("--rate", "40", "--concurrency", "4")],
                         ids=["closed", "open"])
def test_three_shards_merge_into_the_unsharded_run(tmp_path: Path, load: tuple[str, ...],
                                                   engines: dict[str, str]) -> None:
    arms = ["--arm", f"zlab={engines['zlab']}", "--arm", f"inhouse={engines['inhouse']}"]
    whole = run(tmp_path, arms, "whole", *load)
    shards = run_shards(tmp_path / "shards", arms, "shard-", 3, *load)
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


def sealed(config: Path, document: dict[str, Any]) -> None:
    """`document` written as the run's config.json, and sealed in its summary.json as the run would have."""
    config.write_text(json.dumps(document))
    summary = config.parent / "summary.json"
    resealed = Summary.model_validate_json(summary.read_text()).model_copy(
        update={"config_sha256": file_sha256(config)}).sealed()
    summary.write_text(resealed.model_dump_json())


def test_merge_refuses_missing_duplicate_and_foreign_shards(tmp_path: Path, engines: dict[str, str],
                                                            two_shards: list[Path]) -> None:
    arms = ["--arm", f"zlab={engines['zlab']}"]
    shards = copies(two_shards, tmp_path)
    foreign = run(tmp_path, arms, "foreign", "--concurrency", "4", "--shard", "1/2")
    whole = run(tmp_path, arms, "whole", "--concurrency", "2")
    cases = {
        (shards[0],): "dfserve: error: merge: shard 1/2 missing (given: 0/2)",
        (shards[0], shards[0], shards[1]): f"dfserve: error: {shards[0]}: shard 0/2 given twice (also {shards[0]})",
        (shards[0], foreign): f"dfserve: error: {foreign}: not a shard of the same run as {shards[0]} (differs in load)",
        (whole, shards[1]): f"dfserve: error: SHARDS: {whole} is not a shard (run without --shard)",
    }
    for given, line in cases.items():
        refused = dfserve("loadtest", "merge", *map(str, given), "--out", str(tmp_path / "merged"))
        assert refused.returncode == 2 and refused.stderr.strip() == line, refused.stderr
    assert not (tmp_path / "merged").exists()
    config = shards[1] / "config.json"  # shard 1 of a launch an hour later (its summary seals its own config)
    document = json.loads(config.read_text())
    document["t0_unix_s"] += 3600
    sealed(config, document)
    apart = dfserve("loadtest", "merge", *map(str, shards), "--out", str(tmp_path / "merged"))
    assert apart.returncode == 2 and apart.stderr.count("\n") == 1, apart.stderr
    assert re.fullmatch(rf"dfserve: error: shard 1/2 \({shards[1]}\) started 3[56]\d\d\.\d s after shard 0/2 "
                        rf"\({shards[0]}\), which had ended by then: the shards of one run run together; --force "
                        r"merges what the shards hold, marked interrupted\n", apart.stderr), apart.stderr
    assert not (tmp_path / "merged").exists()
    document["t0_unix_s"] -= 3600
    sealed(config, document)
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


def test_merge_refuses_shards_whose_records_do_not_match_their_summary(tmp_path: Path,
                                                                      two_shards: list[Path]) -> None:
    """A finished shard with its last line cut, a line removed or an empty requests.jsonl used to merge with exit 0
    and fewer pairs; a negative read-lag count was merged as given."""
    pristine = copies(two_shards, tmp_path / "pristine")

    def damaged(name: str, damage: Any) -> list[Path]:
        copied = copies(pristine, tmp_path / name)
        damage(copied[1] / "requests.jsonl")
        return copied

    def summary_edit(path: Path) -> None:
        summary = path.parent / "summary.json"
        document = json.loads(summary.read_text())
        document["arms"][0]["tester_read_lag"] = {"reads": 4, "late_reads": -2, "max_lag_s": 0.0}
        summary.write_text(json.dumps(document))

    lines = (pristine[1] / "requests.jsonl").read_text().splitlines(keepends=True)
    measured = sum(not json.loads(line)["warmup"] for line in lines)
    cases = [
        ("cut", lambda p: p.write_text("".join(lines)[:-40]), "requests.jsonl's last line is cut; arm zlab: "
         f"{measured - 1} measured records in requests.jsonl, summary.json counts {measured}"),
        ("removed", lambda p: p.write_text("".join(lines[:3] + lines[5:])), "arm zlab: "
         f"{measured - 2} measured records in requests.jsonl, summary.json counts {measured}"),
        ("empty", lambda p: p.write_text(""), f"arm zlab: 0 measured records in requests.jsonl, summary.json counts "
         f"{measured}"),
    ]
    for name, damage, problem in cases:
        shards = damaged(name, damage)
        refused = dfserve("loadtest", "merge", *map(str, shards), "--out", str(tmp_path / "merged"))
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith(f"dfserve: error: {shards[1]}: shard 1/2 lost records ({problem}")
        assert not (tmp_path / "merged").exists()
        forced = dfserve("loadtest", "merge", *map(str, shards), "--out", str(tmp_path / "forced"), "--name", name,
                         "--force")
        assert forced.returncode == 0 and f"forced: {shards[1]}: {problem}" in forced.stderr, forced.stderr
        summary = json.loads((tmp_path / "forced" / name / "summary.json").read_text())
        assert summary["interrupted"] is True  # judged only as an incomplete run
        assert "--force" in json.loads((tmp_path / "forced" / name / "config.json").read_text())["provenance"]["argv"]
    shards = damaged("lag", summary_edit)
    refused = dfserve("loadtest", "merge", *map(str, shards), "--out", str(tmp_path / "merged"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"dfserve: error: {shards[1] / 'summary.json'}: arms.0.tester_read_lag.late_reads")
    assert not (tmp_path / "merged").exists()
    whole = dfserve("loadtest", "merge", *map(str, pristine), "--out", str(tmp_path / "merged"), "--name", "m")
    assert whole.returncode == 0 and "forced" not in whole.stderr, whole.stderr
    assert json.loads((tmp_path / "merged" / "m" / "summary.json").read_text())["interrupted"] is False


def test_a_run_name_is_one_folder_under_out(tmp_path: Path, engines: dict[str, str], two_shards: list[Path]) -> None:
    """`--name ../../x` wrote outside `--out`; now refused before any request is sent."""
    out = tmp_path / "a" / "b" / "out"
    for name, problem in [("../../x", "holds a path separator"), ("..", "begins with a dot"),
                          (".hidden", "begins with a dot"), ("", "is empty"), ("a/b", "holds a path separator")]:
        refused = dfserve("loadtest", "run", "--out", str(out), "--name", name, "--arm", f"zlab={engines['zlab']}",
                          *LOAD, "--concurrency", "2")
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith(f"dfserve: error: --name: run name {name!r} {problem}"), refused.stderr
    shards = copies(two_shards, out)
    refused = dfserve("loadtest", "merge", *map(str, shards), "--name", "../../x")
    assert refused.returncode == 2 and refused.stderr.startswith("dfserve: error: --name: run name '../../x' holds")
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_dir() and p.parent != out) == ["a", "b", "out"]
