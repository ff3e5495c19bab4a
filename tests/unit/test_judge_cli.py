"""`dfserve compare`, `promote` and `baseline` on run directories written like real ones (no servers needed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from dfserve.baselines import BaselineRegistry, entry
from dfserve.errors import UserError
from dfserve.loadtest.cli import baseline, compare, promote
from dfserve.loadtest.config import RunConfig
from dfserve.loadtest.records import RequestRecord
from dfserve.shard import Shard
from dfserve.verdict.design import SequentialDesign
from dfserve.verdict.gate import Gate, Rule
from tests.integration.servers import dfserve_argv
from tests.synthetic import PASSING, run_config, synthetic, twin, write_run


def make_run(out: Path, name: str, arms: dict[str, list[RequestRecord]], *, interrupted: bool = False,
             summary: bool = True, **config: object) -> Path:
    """A finished run of these arms' records; its schedule is as long as the longest arm's unless given."""
    base = run_config(name, max(len(records) for records in arms.values()))
    keep = tuple(a for a in base.arms if a.name in arms) or base.arms[:1]
    return write_run(out, base.model_copy(update={"arms": keep, **config}), [r for rs in arms.values() for r in rs],
                     interrupted=interrupted, summary=summary)


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_compare_exit_codes_and_verdict_written_outside_the_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    fail = make_run(runs, "ab", {"zlab": synthetic("zlab", PASSING, 9.0, seed=1),
                                 "inhouse": synthetic("inhouse", PASSING, 6.0, seed=2)})
    before = snapshot(fail)
    result = CliRunner().invoke(compare, [str(fail)])
    assert result.exit_code == 1, result.output
    assert "verdict: FAIL" in result.output and "accept_length" in result.output
    assert snapshot(fail) == before
    verdicts = list(runs.glob("verdict-*/verdict.json"))
    assert len(verdicts) == 1
    document = json.loads(verdicts[0].read_text())
    assert document["verdict"] == "FAIL" and document["baseline"]["name"] == "zlab"
    assert document["candidate"]["drafter"] == "/models/dflash-inhouse"

    same = synthetic("zlab", PASSING, 9.0, seed=1)
    aa = make_run(runs, "aa", {"zlab": same, "inhouse": twin(same, "inhouse")})
    assert CliRunner().invoke(compare, [str(aa)]).exit_code == 0

    few = make_run(runs, "few", {"zlab": synthetic("zlab", 30, 9.0, seed=1, noise=0.4),
                                 "inhouse": synthetic("inhouse", 30, 9.0 * 0.98, seed=2, noise=0.4)})
    result = CliRunner().invoke(compare, [str(few)])
    assert result.exit_code == 3, result.output
    assert "distinct tasks would decide it" in result.output


def test_two_runs_must_be_comparable_unless_forced(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    one = make_run(runs, "one", {"zlab": synthetic("zlab", PASSING, 9.0, seed=1)})
    two = make_run(runs, "two", {"inhouse": synthetic("inhouse", PASSING, 9.0, seed=2)}, num_requests=50)
    refused = CliRunner().invoke(compare, [str(one), str(two)], standalone_mode=False)
    assert refused.exception is not None and "not comparable" in str(refused.exception)
    assert "num_requests" in str(refused.exception)
    forced = CliRunner().invoke(compare, [str(one), str(two), "--force"])
    assert forced.exit_code in (0, 3), forced.output
    assert "FORCED" in forced.output
    document = json.loads(next(runs.glob("verdict-*/verdict.json")).read_text())
    assert document["forced"] is True and document["mismatches"]


def test_runs_whose_servers_cannot_be_told_apart_are_not_comparable(tmp_path: Path) -> None:
    """Behind a gateway that answers /server_info for no arm, a run records none: its target and drafter are
    unknown, and a run of another model would pass for the baseline's."""
    runs = tmp_path / "runs"
    one = make_run(runs, "one", {"zlab": synthetic("zlab", PASSING, 9.0, seed=1)})
    blind = run_config("two", 80)
    blind = blind.model_copy(update={"arms": (blind.arms[1].model_copy(update={
        "server_info": None, "model_info": {"model_path": "meta-llama/Llama-3.1-8B"}}),)})
    two = write_run(runs, blind, synthetic("inhouse", PASSING, 9.0, seed=2))
    refused = CliRunner().invoke(compare, [str(one), str(two)], standalone_mode=False)
    assert refused.exception is not None and "arm inhouse: its /server_info was not recorded, so its target and " \
        "drafter are unknown" in str(refused.exception)
    seen = run_config("seen", 80)
    seen = seen.model_copy(update={"arms": (seen.arms[0].model_copy(update={
        "model_info": {"model_path": "Qwen/Qwen3.6-27B"}}),)})
    three = write_run(runs, seen, synthetic("zlab", PASSING, 9.0, seed=1))
    refused = CliRunner().invoke(compare, [str(three), str(two)], standalone_mode=False)
    assert "model_info model_path: Qwen/Qwen3.6-27B vs meta-llama/Llama-3.1-8B" in str(refused.exception)


def test_a_config_edited_after_its_run_is_not_judged_unless_forced(tmp_path: Path) -> None:
    """config.json holds what two runs are compared on: one edited to look like the other's settings shows."""
    runs = tmp_path / "runs"
    one = make_run(runs, "one", {"zlab": synthetic("zlab", PASSING, 9.0, seed=1)})
    two = make_run(runs, "two", {"inhouse": synthetic("inhouse", PASSING, 9.0, seed=2)},
                   sampling=run_config("x", 80).sampling.model_copy(update={"max_new_tokens": 32}))
    config = two / "config.json"
    config.chmod(0o644)
    document = json.loads(config.read_text())
    document["sampling"]["max_new_tokens"] = json.loads((one / "config.json").read_text())["sampling"]["max_new_tokens"]
    config.write_text(json.dumps(document))
    refused = CliRunner().invoke(compare, [str(one), str(two)], standalone_mode=False)
    assert refused.exception is not None
    assert "run two: two/config.json is not as its writer left it" in str(refused.exception)
    forced = CliRunner().invoke(compare, [str(one), str(two), "--force"])
    assert "FORCED" in forced.output, forced.output


def test_a_schedule_edited_past_any_run_is_refused_in_one_line_not_built(tmp_path: Path) -> None:
    """A verdict rebuilds the schedule to check the records against it: 10^12 requests hung compare (and ran a
    merge out of memory) before the seals could say the config was edited."""
    run = make_run(tmp_path / "runs", "one", {"zlab": synthetic("zlab", 40, 9.0, seed=1)})
    config = run / "config.json"
    config.chmod(0o644)
    for field in ("num_requests", "warmup"):
        document = json.loads(config.read_text())
        config.write_text(json.dumps({**document, field: 10**12}))
        refused = CliRunner().invoke(compare, [str(run), "--force"], standalone_mode=False)
        assert f"{field}: Input should be less than or equal to 10000000" in str(refused.exception)
        config.write_text(json.dumps(document))


def test_a_registry_with_no_baseline_is_refused_by_show_and_history_alike(tmp_path: Path) -> None:
    """history listed nothing and exited 0 for a mistyped --registry, where show refused it."""
    for command in ("show", "history"):
        refused = CliRunner().invoke(baseline, [command, "--registry", str(tmp_path / "nowhere")])
        assert isinstance(refused.exception, UserError), refused.output
        assert str(refused.exception) == (f"--registry: no baseline recorded in {tmp_path / 'nowhere' / 'baselines.json'}"
                                          " (`dfserve promote` records one; --registry names another folder than "
                                          "runs/)")  # said also where the default was taken


def test_promote_only_a_pass_whose_baseline_is_current(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    same = synthetic("zlab", PASSING, 9.0, seed=1)
    aa = make_run(runs, "aa", {"zlab": same, "inhouse": twin(same, "inhouse")})
    assert CliRunner().invoke(compare, [str(aa), "--out", str(runs / "v")]).exit_code == 0
    passed = next((runs / "v").glob("verdict-*"))
    result = CliRunner().invoke(promote, [str(passed), "--registry", str(runs)])
    assert result.exit_code == 0, result.output
    shown = CliRunner().invoke(baseline, ["history", "--registry", str(runs)])
    assert shown.output.count("Qwen/Qwen3.6-27B") == 2  # the first promotion records its baseline, then the candidate

    ab = make_run(runs, "ab", {"zlab": synthetic("zlab", PASSING, 9.0, seed=1),
                               "inhouse": synthetic("inhouse", PASSING, 6.0, seed=2)})
    assert CliRunner().invoke(compare, [str(ab), "--out", str(runs / "w")]).exit_code == 1
    failed = next((runs / "w").glob("verdict-*"))
    refused = CliRunner().invoke(promote, [str(failed), "--registry", str(runs)], standalone_mode=False)
    assert refused.exception is not None and "only PASS promotes" in str(refused.exception)
    for reason in ([], ["--reason", " \t"]):
        no_reason = CliRunner().invoke(promote, [str(failed), "--registry", str(runs), "--force", *reason],
                                       standalone_mode=False)
        assert no_reason.exception is not None and "--reason" in str(no_reason.exception)
    forced = CliRunner().invoke(promote, [str(failed), "--registry", str(runs), "--force", "--reason", "drill"])
    assert forced.exit_code == 0 and "FORCED" in forced.output
    history = CliRunner().invoke(baseline, ["history", "--registry", str(runs)]).output
    assert "FORCED (drill)" in history and len(history.strip().splitlines()) == 3
    assert "Qwen/Qwen3.6-27B" in CliRunner().invoke(baseline, ["show", "--registry", str(runs)]).output


@pytest.mark.parametrize(("current", "promoted"), [
    ("inhouse-step-9000", False),
    ("z-lab//Qwen3.6-27B-DFlash/", True),  # the verdict's baseline, its path spelled otherwise
])
def test_promote_takes_only_a_verdict_whose_baseline_is_the_current_one(tmp_path: Path, current: str,
                                                                         promoted: bool) -> None:
    runs = tmp_path / "runs"
    BaselineRegistry(runs).append(entry("Qwen/Qwen3.6-27B", current, "run-0", "zlab"))
    same = synthetic("zlab", PASSING, 9.0, seed=1)
    aa = make_run(runs, "aa", {"zlab": same, "inhouse": twin(same, "inhouse")})
    assert CliRunner().invoke(compare, [str(aa)]).exit_code == 0
    result = CliRunner().invoke(promote, [str(next(runs.glob("verdict-*")))], standalone_mode=False)
    now = BaselineRegistry(runs).current("Qwen/Qwen3.6-27B")
    if promoted:
        assert result.exception is None and now is not None and now.drafter == "/models/dflash-inhouse"
    else:
        assert "is not the current baseline 'inhouse-step-9000'" in str(result.exception)
        assert now is not None and now.drafter == current


def aa_run(runs: Path, name: str, n: int = PASSING, **how: object) -> Path:
    same = synthetic("zlab", n, 9.0, seed=1)
    return make_run(runs, name, {"zlab": same, "inhouse": twin(same, "inhouse")},
                    **how)


def test_a_run_is_never_judged_against_itself(tmp_path: Path) -> None:
    """One folder twice, or a copy of it (the same run id): refused, even with --force."""
    runs = tmp_path / "runs"
    one = make_run(runs, "one", {"zlab": synthetic("zlab", PASSING, 9.0, seed=1)})
    copy = tmp_path / "elsewhere" / "one"
    shutil.copytree(one, copy)
    for second in (one, copy):
        for force in ([], ["--force"]):
            refused = CliRunner().invoke(compare, [str(one), str(second), *force], standalone_mode=False)
            assert refused.exception is not None
            assert "are one run (one): a run is never judged against itself" in str(refused.exception)
    assert not list(runs.glob("verdict-*"))


def shifted(records: list[RequestRecord], by_s: float, arm: str | None = None) -> list[RequestRecord]:
    """The same records with every time `by_s` later (a copy whose clock was moved)."""
    def moved(at: float | None) -> float | None:
        return at + by_s if at is not None else None

    return [r.model_copy(update={"arm": arm or r.arm, "dispatched_s": r.dispatched_s + by_s, "sent_s": moved(r.sent_s),
                                 "first_token_s": moved(r.first_token_s), "end_s": moved(r.end_s),
                                 "chunk_times_s": [t + by_s for t in r.chunk_times_s]}) for r in records]


def test_a_copy_of_a_run_is_one_run_however_renamed_and_its_clock_moved(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    one = make_run(runs, "one", {"zlab": synthetic("zlab", PASSING, 9.0, seed=1)})
    renamed = tmp_path / "renamed"
    shutil.copytree(one, renamed)
    for name in ("config.json", "summary.json"):
        (renamed / name).write_text((renamed / name).read_text().replace('"one"', '"two"'))
    refused = CliRunner().invoke(compare, [str(one), str(renamed), "--force"], standalone_mode=False)
    assert "started at the same instant (t0_unix_s): one run under two names" in str(refused.exception)
    config = json.loads((one / "config.json").read_text())
    config["arms"][0]["server_info"]["speculative_draft_model_path"] = "/models/another"  # all but the records
    later = RunConfig.model_validate({**config, "run_id": "three", "t0_unix_s": config["t0_unix_s"] + 0.5})
    copy = write_run(tmp_path / "copies", later, shifted(synthetic("zlab", PASSING, 9.0, seed=1), 0.5))
    assert "the records of zlab (three) are those of zlab (one), to the microsecond" in refusal([str(one), str(copy)])


def test_a_run_that_stopped_on_its_gate_is_judged_with_another_only_forced(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    base = synthetic("zlab", PASSING, 9.0, seed=1)
    design = SequentialDesign(gate=Gate(rules=(Rule(metric="accept_length", max_worse=0.02),)))
    stopped = make_run(runs, "stopped", {"zlab": base, "inhouse": twin(base, "inhouse")}, sequential=design)
    loose = tmp_path / "loose.yaml"
    loose.write_text("rules:\n  - {metric: error_rate, max_worse: 0.5}\n")
    assert "stopped on their sequential design's gate (rules on accept_length)" in refusal(
        [str(stopped), "--gate", str(loose)])
    same = tmp_path / "same.yaml"
    same.write_text("rules:\n  - {metric: accept_length, max_worse: 0.02}\n")
    judged = CliRunner().invoke(compare, [str(stopped), "--gate", str(same), "--out", str(tmp_path / "v")])
    assert judged.exit_code in (0, 1), judged.output  # judged: PASS or FAIL, not refused (2)
    [verdict] = (tmp_path / "v").glob("verdict-*/verdict.json")
    assert json.loads(verdict.read_text())["forced"] is False


def test_two_runs_that_stopped_on_their_gates_are_judged_against_each_other_only_forced(tmp_path: Path) -> None:
    """Each stopped when its own pair was decided; across the two, a fixed-n interval on samples that stopped on
    looks is what the one-run path refuses (it was a PASS, unforced, that promoted)."""
    runs = tmp_path / "runs"
    design = SequentialDesign(gate=Gate(rules=(Rule(metric="accept_length", max_worse=0.5),)))
    first = make_run(runs, "first", {"zlab": synthetic("zlab", PASSING, 9.0, seed=1)}, sequential=design)
    second = make_run(runs, "second", {"inhouse": synthetic("inhouse", PASSING, 9.0, seed=2)}, sequential=design)
    assert "run first stopped once its own gate was decided (--until-decided)" in refusal([str(first), str(second)])


def refusal(args: list[str]) -> str:
    """The one line `dfserve compare` refuses with; and with --force, the verdict is stamped."""
    refused = CliRunner().invoke(compare, args, standalone_mode=False)
    assert refused.exception is not None
    forced = CliRunner().invoke(compare, [*args, "--force", "--out", str(Path(args[0]).parent / "forced")],
                                standalone_mode=False)
    assert forced.exception is None or isinstance(forced.exception, SystemExit)  # judged: its verdict's exit code
    [verdict] = (Path(args[0]).parent / "forced").glob("verdict-*/verdict.json")
    assert json.loads(verdict.read_text())["forced"] is True
    shutil.rmtree(Path(args[0]).parent / "forced")
    return str(refused.exception)


def test_records_that_cannot_be_the_runs_own_are_refused(tmp_path: Path) -> None:
    """A copy of the baseline's records as the candidate's, an index twice or outside the schedule, summary.json's
    figures against its records (arm labels swapped), two unpinned arms on one server: refused, or stamped."""
    runs = tmp_path / "runs"
    base, cand = synthetic("zlab", 60, 9.0, seed=1), synthetic("inhouse", 60, 6.0, seed=2)
    copy = make_run(runs, "copy", {"zlab": base, "inhouse": [r.model_copy(update={"arm": "inhouse"}) for r in base]})
    assert "the records of inhouse (copy) are those of zlab (copy), to the microsecond" in refusal([str(copy)])
    moved = make_run(runs, "moved-copy", {"zlab": base, "inhouse": shifted(base, 0.5, "inhouse")})
    assert "the records of inhouse (moved-copy) are those of zlab (moved-copy)" in refusal([str(moved)])
    twice = make_run(runs, "twice", {"zlab": base, "inhouse": [*cand[:-1], cand[0]]}, num_requests=60)
    assert "arm inhouse: index 0 recorded twice" in refusal([str(twice)])
    moved = make_run(runs, "moved", {"zlab": base, "inhouse": [r.model_copy(update={"index": r.index + 1000})
                                                               if r.index % 2 else r for r in cand]})
    assert "arm inhouse: index 1001 is not a measured request of its schedule (and 29 more)" in refusal([str(moved)])
    swapped = make_run(runs, "swapped", {"zlab": base, "inhouse": cand})
    lines = (swapped / "requests.jsonl").read_text().replace('"arm":"zlab"', '"arm":"x"')
    (swapped / "requests.jsonl").write_text(lines.replace('"arm":"inhouse"', '"arm":"zlab"')
                                            .replace('"arm":"x"', '"arm":"inhouse"'))
    assert "arm zlab: summary.json's figures are not those of its records" in refusal([str(swapped)])
    shared = make_run(runs, "shared", {"zlab": base, "inhouse": cand})
    config = json.loads((shared / "config.json").read_text())
    config["arms"][1]["url"] = config["arms"][0]["url"]
    (shared / "config.json").write_text(json.dumps(config))
    assert "arms zlab and inhouse are one server (http://127.0.0.1:1) and were not pinned" in refusal([str(shared)])
    config["pin_arms"] = True
    (shared / "config.json").write_text(json.dumps(config))
    assert CliRunner().invoke(compare, [str(shared)]).exit_code == 1  # FAIL, judged: pinned arms behind a gateway


def test_a_shard_is_judged_only_merged_and_never_against_its_merged_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    base, cand = synthetic("zlab", PASSING, 9.0, seed=1), synthetic("inhouse", PASSING, 6.0, seed=2)
    halves = [make_run(runs, f"half{i}", {"zlab": base[i::2], "inhouse": cand[i::2]}, num_requests=60,
                       shard=Shard(index=i, count=2)) for i in range(2)]
    assert "run half0 is shard 0/2 of a schedule: merge its shards to judge the whole" in refusal([str(halves[0])])
    merged = make_run(runs, "merged", {"zlab": base, "inhouse": cand}, merged_from=("half0", "half1"))
    for force in ([], ["--force"]):
        refused = CliRunner().invoke(compare, [str(merged), str(halves[1]), "--baseline", "zlab", "--candidate",
                                               "zlab", *force], standalone_mode=False)
        assert "share a shard (merged_from): a run is never judged against itself" in str(refused.exception)


def test_a_verdict_promotes_only_as_its_runs_give_it_and_once_however_laid_out(tmp_path: Path) -> None:
    """Promote judges the runs again: a FAIL edited into a PASS, or a verdict whose runs are gone, is refused unless
    forced; a copy of a promoted verdict laid out otherwise is the same verdict."""
    runs = tmp_path / "runs"
    ab = make_run(runs, "ab", {"zlab": synthetic("zlab", PASSING, 9.0, seed=1),
                               "inhouse": synthetic("inhouse", PASSING, 6.0, seed=2)})
    assert CliRunner().invoke(compare, [str(ab), "--out", str(runs / "w")]).exit_code == 1
    failed = next((runs / "w").glob("verdict-*")) / "verdict.json"
    edited = runs / "edited" / "verdict.json"
    edited.parent.mkdir()
    edited.write_text(failed.read_text().replace('"verdict": "FAIL"', '"verdict": "PASS"'))
    refused = CliRunner().invoke(promote, [str(edited), "--registry", str(runs)], standalone_mode=False)
    assert "its runs give FAIL, not the PASS it says, judged again" in str(refused.exception)
    assert not BaselineRegistry(runs).history()
    aa = aa_run(runs, "aa")
    assert CliRunner().invoke(compare, [str(aa), "--out", str(runs / "v")]).exit_code == 0
    passed = next((runs / "v").glob("verdict-*")) / "verdict.json"
    figures = json.loads(passed.read_text())  # a PASS whose pairs were edited: still PASS, not as its runs give it
    figures["judgement"]["pairs"] += 1
    (runs / "figures").mkdir()
    (runs / "figures" / "verdict.json").write_text(json.dumps(figures))
    refused = CliRunner().invoke(promote, [str(runs / "figures" / "verdict.json"), "--registry", str(runs)],
                                 standalone_mode=False)
    assert "its figures are not those its runs give, judged again, though both say PASS" in str(refused.exception)
    copy = runs / "copy" / "verdict.json"
    copy.parent.mkdir()
    copy.write_text(json.dumps(json.loads(passed.read_text()), indent=4))
    assert CliRunner().invoke(promote, [str(passed), "--registry", str(runs)]).exit_code == 0
    again = CliRunner().invoke(promote, [str(copy), "--registry", str(runs)], standalone_mode=False)
    assert "a verdict promotes once" in str(again.exception)
    shutil.move(str(aa), str(tmp_path / "moved"))
    aa2 = aa_run(runs, "aa2")
    assert CliRunner().invoke(compare, [str(aa2), "--out", str(runs / "x")]).exit_code == 0
    shutil.rmtree(aa2)
    gone = CliRunner().invoke(promote, [str(next((runs / "x").glob("verdict-*"))), "--registry", str(runs)],
                              standalone_mode=False)
    assert "the runs it judged are not at" in str(gone.exception) and "cannot be judged again" in str(gone.exception)


def test_promoting_one_verdict_twice_records_it_once(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    assert CliRunner().invoke(compare, [str(aa_run(runs, "aa")), "--out", str(runs / "v")]).exit_code == 0
    passed = next((runs / "v").glob("verdict-*"))
    assert CliRunner().invoke(promote, [str(passed), "--registry", str(runs)]).exit_code == 0
    again = CliRunner().invoke(promote, [str(passed / "verdict.json"), "--registry", str(runs), "--force",
                                         "--reason", "again"], standalone_mode=False)
    assert again.exception is not None and "a verdict promotes once" in str(again.exception)
    assert len(BaselineRegistry(runs).history()) == 2  # the first baseline, then the candidate: once


def test_an_interrupted_or_killed_run_is_judged_only_when_forced_and_then_never_promotes(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    cases = {"interrupted": (aa_run(runs, "stopped", interrupted=True), "was interrupted before its end"),
             "killed": (aa_run(runs, "killed", summary=False), "has no summary.json: it was killed"),
             "short": (aa_run(runs, "short", n=90, num_requests=PASSING),
                       f"90 of the {PASSING} scheduled requests recorded")}
    for run, why in cases.values():
        refused = CliRunner().invoke(compare, [str(run)], standalone_mode=False)
        assert refused.exception is not None and why in str(refused.exception)
        assert "--force judges anyway" in str(refused.exception)
    assert not list(runs.glob("verdict-*"))
    run, why = cases["interrupted"]
    forced = CliRunner().invoke(compare, [str(run), "--force", "--out", str(runs / "v")])
    assert forced.exit_code == 0 and "FORCED verdict on incomplete data" in forced.output and why in forced.output
    file = next((runs / "v").glob("verdict-*/verdict.json"))
    document = json.loads(file.read_text())
    assert document["forced"] is True and document["incomplete"] == ["run stopped was interrupted before its end"]
    refused = CliRunner().invoke(promote, [str(file), "--registry", str(runs)], standalone_mode=False)
    assert refused.exception is not None and "the verdict was forced past run stopped was interrupted" in str(
        refused.exception)
    assert BaselineRegistry(runs).history() == []


def test_records_missing_against_the_summary_are_refused(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run = aa_run(runs, "cut")
    lines = (run / "requests.jsonl").read_text().splitlines(keepends=True)
    (run / "requests.jsonl").chmod(0o644)
    (run / "requests.jsonl").write_text("".join(lines[:-2]) + lines[-1])
    refused = CliRunner().invoke(compare, [str(run)], standalone_mode=False)
    assert refused.exception is not None
    assert (f"not the whole run: run cut arm inhouse: requests.jsonl holds {PASSING - 1} measured records, summary.json "
            f"counts {PASSING}") in str(refused.exception)


def test_records_no_recorder_writes_are_judged_only_forced(tmp_path: Path) -> None:
    """Sealed with the run, yet impossible: a count below 0, more verify rounds than tokens in an exact
    acceptance."""
    runs = tmp_path / "runs"
    same = synthetic("zlab", PASSING, 9.0, seed=1)
    for name, change, why in (
            ("negative", {"completion_tokens": -5}, "index 3: a count below 0"),
            ("rounds", {"spec_verify_ct": 10**6}, "index 3: spec_verify_ct 1000000 is more than completion_tokens")):
        cand = [r.model_copy(update=change) if r.index == 3 else r for r in twin(same, "inhouse")]
        run = make_run(runs, name, {"zlab": same, "inhouse": cand})
        refused = CliRunner().invoke(compare, [str(run)], standalone_mode=False)
        assert refused.exception is not None and f"run {name} arm inhouse: {why}" in str(refused.exception)
    forced = CliRunner().invoke(compare, [str(run), "--force"])
    assert "FORCED" in forced.output, forced.output


def test_a_damaged_registry_beside_the_runs_leaves_the_verdict_and_its_exit_status(tmp_path: Path) -> None:
    """The registry is read after the verdict only to show offline τ: a verdict written must be said, and its exit
    status kept, whatever that file holds."""
    runs = tmp_path / "runs"
    run = aa_run(runs, "aa")
    (runs / "baselines.json").write_text('{"entries": [')
    result = CliRunner().invoke(compare, [str(run)])
    assert result.exit_code == 0, result.output
    assert "offline acceptance not shown: " in result.output and "baselines.json" in result.output
    assert "verdict: " in result.output and next(runs.glob("verdict-*/verdict.json")).exists()


def test_a_summary_must_be_its_runs_and_count_every_arm(tmp_path: Path) -> None:
    """An arm left out of summary.json escapes every count; another run's summary.json seals its own records."""
    runs = tmp_path / "runs"
    for name, edit, why in (
            ("armless", lambda s: {**s, "arms": [a for a in s["arms"] if a["arm"] != "inhouse"]},
             "run armless arm inhouse: not in summary.json"),
            ("other", lambda s: {**s, "run_id": "elsewhere"}, "run other: its summary.json is run elsewhere's")):
        run = aa_run(runs, name)
        summary = run / "summary.json"
        summary.chmod(0o644)
        summary.write_text(json.dumps(edit(json.loads(summary.read_text()))))
        refused = CliRunner().invoke(compare, [str(run)], standalone_mode=False)
        assert refused.exception is not None and why in str(refused.exception), refused.output


def test_a_verdict_of_a_run_against_itself_never_promotes(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    assert CliRunner().invoke(compare, [str(aa_run(runs, "aa")), "--out", str(runs / "v")]).exit_code == 0
    file = next((runs / "v").glob("verdict-*/verdict.json"))
    document = json.loads(file.read_text())
    document["candidate"] = document["baseline"]
    file.chmod(0o644)
    file.write_text(json.dumps(document))
    refused = CliRunner().invoke(promote, [str(file), "--registry", str(runs), "--force", "--reason", "try"],
                                 standalone_mode=False)
    assert refused.exception is not None and "judged run aa against itself" in str(refused.exception)
    assert BaselineRegistry(runs).history() == []


def test_two_arms_serving_one_drafter_are_judged_only_forced_and_never_promote(tmp_path: Path) -> None:
    """Two servers of the baseline's drafter, one named the candidate: a PASS would promote the baseline over
    itself."""
    runs = tmp_path / "runs"
    same = synthetic("zlab", PASSING, 9.0, seed=1)
    config = run_config("aa", PASSING)
    arms = tuple(a.model_copy(update={"server_info": config.arms[0].server_info}) for a in config.arms)
    run = write_run(runs, config.model_copy(update={"arms": arms}), [*same, *twin(same, "inhouse")])
    assert refusal([str(run)]) == ("runs are not comparable (both sides serve drafter 'z-lab/Qwen3.6-27B-DFlash': "
                                   "the candidate would be judged against the baseline's own drafter); --force "
                                   "judges anyway, stamped in the verdict")
    forced = CliRunner().invoke(compare, [str(run), "--force", "--out", str(runs / "v")])
    assert "verdict: PASS" in forced.output
    file = next((runs / "v").glob("verdict-*/verdict.json"))
    refused = CliRunner().invoke(promote, [str(file), "--registry", str(runs), "--force", "--reason", "try"],
                                 standalone_mode=False)
    assert refused.exception is not None
    assert "both sides serve drafter 'z-lab/Qwen3.6-27B-DFlash'" in str(refused.exception)
    assert BaselineRegistry(runs).history() == []


def test_an_offline_verdict_never_promotes(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    assert CliRunner().invoke(compare, [str(aa_run(runs, "aa")), "--out", str(runs / "v")]).exit_code == 0
    file = next((runs / "v").glob("verdict-*/verdict.json"))
    offline = json.loads(file.read_text()) | {"source": "eval"}
    file.chmod(0o644)
    file.write_text(json.dumps(offline))
    refused = CliRunner().invoke(promote, [str(file), "--registry", str(runs), "--force", "--reason", "try"],
                                 standalone_mode=False)
    assert refused.exception is not None and "an offline verdict screens drafters and promotes none" in str(
        refused.exception)


def test_an_arm_a_run_has_not_is_named_with_its_flag_and_folder(tmp_path: Path) -> None:
    ab = make_run(tmp_path, "ab", {"zlab": synthetic("zlab", 20, 9.0, seed=1),
                                   "inhouse": synthetic("inhouse", 20, 6.0, seed=2)})
    for flag in ("--baseline", "--candidate"):
        refused = CliRunner().invoke(compare, [str(ab), flag, "nope"], standalone_mode=False)
        assert str(refused.exception) == f"{flag}: {ab} has no arm named 'nope' (its arms: zlab, inhouse)"


def test_a_run_whose_config_python_cannot_parse_is_one_line(tmp_path: Path) -> None:
    """Nested past Python's recursion limit: neither a shadow folder nor a run, said in one line."""
    run = tmp_path / "deep"
    run.mkdir()
    (run / "config.json").write_bytes(b"[" * 100_000)
    (run / "requests.jsonl").write_text("")
    refused = CliRunner().invoke(compare, [str(run)], standalone_mode=False)
    assert refused.exception is not None and type(refused.exception).__name__ == "UserError"
    assert str(refused.exception).startswith(f"{run / 'config.json'}") and "\n" not in str(refused.exception)


def test_a_verdict_whose_sides_were_edited_never_promotes_what_was_not_judged(tmp_path: Path) -> None:
    """A PASS whose candidate (or baseline, or target) names another drafter than the run it judged: promote would
    deploy a drafter never tested."""
    runs = tmp_path / "runs"
    assert CliRunner().invoke(compare, [str(aa_run(runs, "aa")), "--out", str(runs / "v")]).exit_code == 0
    passed = json.loads((next((runs / "v").glob("verdict-*")) / "verdict.json").read_text())
    for role, field in (("candidate", "drafter"), ("baseline", "drafter"), ("candidate", "target")):
        edited = json.loads(json.dumps(passed))
        edited[role][field] = "evil/never-tested"
        file = runs / f"edited-{role}-{field}" / "verdict.json"
        file.parent.mkdir()
        file.write_text(json.dumps(edited))
        refused = CliRunner().invoke(promote, [str(file), "--registry", str(runs)], standalone_mode=False)
        assert refused.exception is not None, (role, field)
        assert f"its {role}'s {field} are not those of the run it names" in str(refused.exception), (role, field)
    assert not BaselineRegistry(runs).history()


def test_a_runs_arm_promotes_once_whatever_verdict_names_it(tmp_path: Path) -> None:
    """A second verdict of the same runs (judged again, or a copy whose provenance was touched): the same arm of the
    same run is not promoted twice."""
    runs = tmp_path / "runs"
    aa = aa_run(runs, "aa")
    for out in ("v1", "v2"):
        assert CliRunner().invoke(compare, [str(aa), "--out", str(runs / out)]).exit_code == 0
    first, second = (next((runs / out).glob("verdict-*")) for out in ("v1", "v2"))
    assert CliRunner().invoke(promote, [str(first), "--registry", str(runs)]).exit_code == 0
    again = CliRunner().invoke(promote, [str(second), "--registry", str(runs), "--force", "--reason", "again"],
                               standalone_mode=False)
    assert again.exception is not None and "arm inhouse of run aa was promoted on" in str(again.exception)
    assert len(BaselineRegistry(runs).history()) == 2


def test_a_promotion_waits_for_one_under_way_and_is_then_checked_against_it(tmp_path: Path) -> None:
    """Two promotions at once: the second's checks run once the first has written, so it cannot pass them too."""
    runs = tmp_path / "runs"
    assert CliRunner().invoke(compare, [str(aa_run(runs, "aa")), "--out", str(runs / "v")]).exit_code == 0
    passed = next((runs / "v").glob("verdict-*")) / "verdict.json"
    verdict = json.loads(passed.read_text())
    outcome: list[BaseException | None] = []

    def second() -> None:
        result = CliRunner().invoke(promote, [str(passed), "--registry", str(runs)], standalone_mode=False)
        outcome.append(result.exception)

    first = BaselineRegistry(runs)
    with first.locked():
        racer = threading.Thread(target=second)
        racer.start()
        racer.join(0.5)
        assert racer.is_alive() and not outcome  # held at the registry, its checks not yet made
        cand = verdict["candidate"]
        first.append(entry(cand["target"], cand["drafter"], cand["run_id"], cand["name"], "elsewhere/verdict.json"))
    racer.join(30)
    assert outcome and outcome[0] is not None and "was promoted on" in str(outcome[0])
    assert len(BaselineRegistry(runs).history()) == 1


def test_records_edited_whatever_figures_are_kept_are_judged_only_forced(tmp_path: Path) -> None:
    """The candidate's output hashes made the baseline's: the summary's figures do not cover them, its seal does."""
    runs = tmp_path / "runs"
    ab = make_run(runs, "ab", {"zlab": synthetic("zlab", PASSING, 9.0, seed=1),
                               "inhouse": synthetic("inhouse", PASSING, 9.0, seed=1, lossy=0.5)})
    requests = ab / "requests.jsonl"
    records = [json.loads(line) for line in requests.read_text().splitlines()]
    base = {r["index"]: r["output_sha256"] for r in records if r["arm"] == "zlab"}
    requests.write_text("".join(json.dumps({**r, "output_sha256": base[r["index"]]}) + "\n" for r in records))
    said = refusal([str(ab)])
    assert "ab/requests.jsonl is not as its writer left it (its sha256 is not summary.json's): edited" in said
    summary = json.loads((ab / "summary.json").read_text())
    del summary["records_sha256"]
    (ab / "summary.json").write_text(json.dumps(summary))
    assert "ab/summary.json holds no sha256 of requests.jsonl" in refusal([str(ab)])


def test_a_summary_whose_flags_or_seals_were_edited_is_refused(tmp_path: Path) -> None:
    """Turning `interrupted` off, or dropping config.json's seal to edit config.json, passed unforced."""
    edits = {"config-seal-dropped": lambda s: {k: v for k, v in s.items() if k != "config_sha256"},
             "interrupted-turned-off": lambda s: {**s, "interrupted": False},
             "own-seal-dropped": lambda s: {k: v for k, v in s.items() if k != "summary_sha256"}}
    for name, edit in edits.items():
        ab = make_run(tmp_path / name, name, {"zlab": synthetic("zlab", PASSING, 9.0, seed=1),
                                              "inhouse": synthetic("inhouse", PASSING, 9.0, seed=2)},
                      interrupted=name == "interrupted-turned-off")
        path = ab / "summary.json"
        summary = json.loads(path.read_text())
        assert summary["summary_sha256"]
        path.write_text(json.dumps(edit(summary)))
        said = refusal([str(ab)])
        assert (f"{name}/summary.json holds no sha256 of its own fields" in said if name == "own-seal-dropped" else
                f"{name}/summary.json is not as its writer left it (its fields' sha256 is not the one it holds): "
                "edited" in said), said
    dropped = tmp_path / "config-seal-dropped" / "config-seal-dropped"
    assert "config-seal-dropped/summary.json holds no sha256 of config.json" in refusal([str(dropped)])


def test_a_reader_that_stops_early_does_not_turn_a_verdict_into_a_fail(tmp_path: Path) -> None:
    """`dfserve compare RUN | head -1`: the pipe closes before the verdict's lines are written. The exit status is
    still the verdict's (here PASS), never 1, which is FAIL's."""
    same = synthetic("zlab", PASSING, 9.0, seed=1)
    aa = make_run(tmp_path / "runs", "aa", {"zlab": same, "inhouse": twin(same, "inhouse")})
    reading, writing = os.pipe()
    os.close(reading)  # the reader is gone before anything is written
    try:
        done = subprocess.run(dfserve_argv("compare", str(aa)), stdout=writing, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(writing)
    assert done.returncode == 0 and not done.stderr, done.stderr


def test_a_pass_of_simulated_engines_promotes_only_forced(tmp_path: Path) -> None:
    """A rehearsal on dfserve's simulator judges no drafter: its PASS moves no baseline unless forced (and said)."""
    runs = tmp_path / "runs"
    same = synthetic("zlab", PASSING, 9.0, seed=1)
    base = run_config("sim", PASSING)
    sim = write_run(runs, base.model_copy(update={"arms": tuple(a.model_copy(update={"simulated": True})
                                                                 for a in base.arms)}),
                    [*same, *twin(same, "inhouse")])
    assert CliRunner().invoke(compare, [str(sim), "--out", str(runs / "v")]).exit_code == 0
    passed = next((runs / "v").glob("verdict-*"))
    refused = CliRunner().invoke(promote, [str(passed), "--registry", str(runs)], standalone_mode=False)
    assert refused.exception is not None and "simulated engines" in str(refused.exception)
    forced = CliRunner().invoke(promote, [str(passed), "--registry", str(runs), "--force", "--reason", "rehearsal"])
    assert forced.exit_code == 0 and "FORCED: the verdict is of simulated engines" in forced.output
