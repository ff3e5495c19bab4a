"""`dfserve loadtest run --until-decided` against simulated engines on loopback: it stops sending as soon as the gate
is decided, runs to its maximum when it is not, and `dfserve compare` judges the run on the same always-valid
intervals and says so."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dfserve.loadtest.records import RequestRecord, read_records
from tests.integration.servers import dfserve_argv, sim_server

pytestmark = pytest.mark.slow


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dfserve_argv(*args), capture_output=True, text=True, timeout=120)


def measured(run_dir: Path) -> list[RequestRecord]:
    return [r for r in read_records(run_dir / "requests.jsonl") if not r.warmup]


def verdict_of(out: Path) -> dict:  # type: ignore[type-arg]
    return json.loads(next(out.glob("verdict-*/verdict.json")).read_text())


def test_an_undertrained_drafter_is_failed_early_and_the_run_stops_sending(tmp_path: Path) -> None:
    with sim_server("zlab", 0.02, 0) as zlab, sim_server("inhouse", 0.02, 0) as inhouse:
        result = run("loadtest", "run", "--arm", f"zlab={zlab}", "--arm", f"inhouse={inhouse}", "--until-decided",
                     "--num-requests", "160", "--warmup", "4", "--rate", "40", "--concurrency", "8",
                     "--max-new-tokens", "128", "--out", str(tmp_path), "--name", "ab", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "until decided: FAIL at look 1, after 16 paired requests (decided)" in result.stdout
    records = measured(tmp_path / "ab")
    per_arm = {arm: sum(r.arm == arm for r in records) for arm in ("zlab", "inhouse")}
    # 160 allowed; the in-flight ones finish, and a loaded machine takes longer to decide while 40 a second go out
    assert all(16 <= n < 120 for n in per_arm.values()), per_arm
    assert all(r.ok for r in records)
    config = json.loads((tmp_path / "ab" / "config.json").read_text())
    assert config["sequential"]["look_every"] == 16 and config["num_requests"] == 160

    judged = run("compare", str(tmp_path / "ab"))
    assert judged.returncode == 1, judged.stdout + judged.stderr
    assert "sequential: always-valid confidence sequences" in judged.stdout
    verdict = verdict_of(tmp_path)
    assert verdict["verdict"] == "FAIL"
    sequential = verdict["sequential"]
    assert sequential["stopped"] == "decided" and sequential["stopped_after_pairs"] == 16
    assert sequential["verdict_when_stopped"] == "FAIL" and sequential["design"]["alpha"] == 0.05
    accept = next(r for r in verdict["judgement"]["rules"] if r["metric"] == "accept_length")
    assert accept["status"] == "FAIL" and accept["low"] > 0.2  # inhouse is about a third worse than zlab


def test_an_aa_pair_stays_inconclusive_up_to_its_maximum(tmp_path: Path) -> None:
    with sim_server("zlab", 0.02, 0) as first, sim_server("zlab", 0.02, 1) as second:
        result = run("loadtest", "run", "--arm", f"a={first}", "--arm", f"b={second}", "--until-decided",
                     "--num-requests", "48", "--warmup", "0", "--concurrency", "12", "--max-new-tokens", "128",
                     "--out", str(tmp_path), "--name", "aa", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "until decided: INCONCLUSIVE at look 3, after 48 paired requests (undecided at the end)" in result.stdout
    records = measured(tmp_path / "aa")
    assert sorted(r.index for r in records if r.arm == "a") == list(range(48))
    assert sorted(r.index for r in records if r.arm == "b") == list(range(48))

    judged = run("compare", str(tmp_path / "aa"), "--force")  # one drafter on both: judged only forced
    assert judged.returncode == 3, judged.stdout + judged.stderr
    verdict = verdict_of(tmp_path)
    assert verdict["verdict"] == "INCONCLUSIVE" and verdict["forced"]
    assert verdict["sequential"]["stopped"] == "end" and verdict["sequential"]["pairs"] == 48
    rules = {r["metric"]: r for r in verdict["judgement"]["rules"]}
    assert rules["accept_length"]["status"] == "INCONCLUSIVE" and rules["accept_length"]["tasks_needed"] > 48
    assert rules["error_rate"]["status"] == "INCONCLUSIVE" and rules["error_rate"]["requests_needed"] > 48


@pytest.mark.parametrize(("args", "message"), [
    (["--until-decided", "--arm", "c=http://127.0.0.1:9"], "--until-decided: give exactly two arms"),
    (["--look-every", "8"], "--gate, --look-every: only with --until-decided"),
    (["--until-decided", "--look-every", "0"], "--look-every:"),
])
def test_bad_sequential_options_are_one_line_naming_the_flag(args: list[str], message: str) -> None:
    result = run("loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--arm", "b=http://127.0.0.1:9",
                 "--concurrency", "1", *args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
