"""Acceptance along the trajectory, per-position accuracy, the offline verdict and the registry's offline τ, on
constructed drafts whose answers are known."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from dfserve.baselines import BaselineRegistry, OfflineScore, drafter_identity, one_drafter
from dfserve.errors import FieldError, UserError
from dfserve.eval.features import FeatureBuild, FeatureKey, health, open_features
from dfserve.eval.metrics import anchor_records, summarize_drafter
from dfserve.eval.records import AnchorRecord, EvalConfig, FeatureInfo, PromptSettings
from dfserve.eval.references import greedy
from dfserve.eval.scoring import AnchorScores
from dfserve.eval.trajectory import PositionTally, leading_matches, trajectory
from dfserve.eval.verdict import DEFAULT_EVAL_GATE, EvalRun, compare_eval_runs, judge_offline, metrics_of
from dfserve.loadtest.cli import compare
from dfserve.runs import write_model
from dfserve.verdict.gate import Gate, Rule, check_rules
from tests.synthetic import run_config, synthetic, write_run

METHODS = ["vanilla", "ddtree2"]


def test_trajectory_advances_by_tau_and_stops_at_the_last_token() -> None:
    # anchors 10..19; accepted drafts at each anchor
    accepted = [3, 0, 0, 0, 1, 0, 0, 5, 0, 0]
    rounds = trajectory(first=10, last=20, accepted=accepted, offset=10)
    assert [(r.anchor, r.tau, r.capped) for r in rounds] == [(10, 4, False), (14, 2, False), (16, 1, False),
                                                           (17, 3, True)]
    assert sum(r.tau for r in rounds) == 20 - 10  # every token after the first is committed once
    assert trajectory(first=10, last=10, accepted=[]) == []  # one generated token: no round


def test_leading_matches_and_position_tally() -> None:
    assert leading_matches([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert leading_matches([1, 2], [1]) == 1  # a reference cut by its end
    tally = PositionTally.empty(3)
    for row in ([True, True, False], [True, False, True], [False, True, True], [True, True]):
        tally.add(row)
    assert tally.seen == [4, 4, 3] and tally.hits == [3, 3, 2]
    assert tally.seen_after_hits == [4, 3, 1] and tally.hits_after_hits == [3, 2, 0]


def scores_for(tokens: list[int], prompt_len: int, correct: dict[int, int], depth: int = 3) -> AnchorScores:
    """Drafts that match the reference for `correct[anchor]` positions, then miss; DDTree's rank 1 holds the
    reference token one position further."""
    anchors = np.arange(prompt_len, len(tokens) - 1)
    drafts = np.full((len(anchors), depth), 999)
    top_ids = np.full((len(anchors), depth, 2), 998)
    top_logprobs = np.log(np.tile(np.array([0.6, 0.4], dtype=np.float32), (len(anchors), depth, 1)))
    for row, anchor in enumerate(anchors.tolist()):
        for i in range(depth):
            if anchor + 1 + i >= len(tokens):
                break
            wanted = tokens[anchor + 1 + i]
            if i < correct.get(anchor, 0):
                drafts[row, i] = wanted
                top_ids[row, i, 0] = wanted
            elif i == correct.get(anchor, 0):
                top_ids[row, i, 1] = wanted
    return AnchorScores(anchors.astype(np.int64), drafts.astype(np.int64), top_ids.astype(np.int64),
                        top_logprobs.astype(np.float32))


def test_records_and_summary_of_known_drafts() -> None:
    tokens = list(range(100, 112))  # prompt 100..103, reference 104..111 (last index 11)
    scores = scores_for(tokens, 4, correct={4: 2, 7: 1, 9: 2})
    records = anchor_records("d", "t", tokens, 4, scores, budgets=(2,))
    by_anchor = {r.anchor: r for r in records}
    assert [r.anchor for r in records] == list(range(4, 11))
    assert by_anchor[4].matches == "110" and by_anchor[4].accepted == {"vanilla": 2, "ddtree2": 1}
    assert by_anchor[9].matches == "11" and by_anchor[10].matches == "0"  # the reference ends at index 11
    # vanilla: anchor 4 (τ 3) -> 7 (τ 2) -> 9 (2 drafts accepted, but only 2 tokens remain: τ capped at 2)
    assert {a: r.rounds["vanilla"] for a, r in by_anchor.items() if "vanilla" in r.rounds} == {4: 3, 7: 2, 9: 2}
    # ddtree2: two nodes, the top draft at position 1 and its sibling (log 0.4 beats the child's log 0.36), and the
    # reference's token at position 1 is one of them at every anchor: one draft accepted each round
    assert {a: r.rounds["ddtree2"] for a, r in by_anchor.items() if "ddtree2" in r.rounds} == {4: 2, 6: 2, 8: 2, 10: 1}
    summary = summarize_drafter("d", records, ["t"], METHODS, block_size=4)
    vanilla = summary.method("vanilla")
    assert (vanilla.tokens, vanilla.rounds, vanilla.capped_rounds) == (7, 3, 1)
    assert vanilla.tau.estimate == pytest.approx(7 / 3) and vanilla.accepted_drafts == pytest.approx(4 / 3)
    assert vanilla.tau_as_sglang == pytest.approx(8 / 3) and vanilla.histogram == [0, 0, 2, 1, 0]
    assert summary.positions.n == [7, 6, 5] and summary.positions.accuracy[0] == pytest.approx(3 / 7)
    assert summary.positions.accuracy_after_hits[1] == pytest.approx(2 / 3)


def records_of(drafter: str, taus: dict[str, list[int]]) -> list[AnchorRecord]:
    """Each task's vanilla rounds with the given τ values (DDTree the same)."""
    records = []
    for task, values in taus.items():
        anchor = 0
        for tau in values:
            rounds = {"vanilla": tau, "ddtree2": tau}
            records.append(AnchorRecord(drafter=drafter, task=task, anchor=anchor, matches="",
                                        accepted={m: tau - 1 for m in rounds}, rounds=rounds))
            anchor += tau
    return records


def test_offline_verdict_pairs_by_task() -> None:
    rng = np.random.default_rng(0)
    tasks = [f"t{i}" for i in range(12)]
    base = {t: list(rng.integers(1, 4, size=20)) for t in tasks}
    better = {t: [v + 1 for v in values] for t, values in base.items()}
    gate = DEFAULT_EVAL_GATE
    passed = judge_offline("a", records_of("a", base), "b", records_of("b", better), tasks, METHODS, gate)
    assert passed.verdict == "PASS" and passed.metrics[0].change_low is not None and passed.metrics[0].change_low > 0
    failed = judge_offline("b", records_of("b", better), "a", records_of("a", base), tasks, METHODS, gate)
    assert failed.verdict == "FAIL" and failed.rules[0].status == "FAIL"
    noisy = {t: list(rng.integers(1, 4, size=20)) for t in tasks[:3]}
    unsure = judge_offline("a", records_of("a", {t: base[t] for t in tasks[:3]}), "b", records_of("b", noisy),
                           tasks, METHODS, Gate(rules=(Rule(metric="tau_ddtree2", max_worse=0.0),)))
    assert unsure.verdict == "INCONCLUSIVE" and unsure.tasks == 3


def test_gate_names_only_scored_methods() -> None:
    check_rules(DEFAULT_EVAL_GATE, metrics_of(METHODS))
    with pytest.raises(FieldError, match=r"gate: rules.0.metric: unknown metric 'tau_ddtree8' \(known: tau_vanilla"):
        check_rules(Gate(rules=(Rule(metric="tau_ddtree8", max_worse=0.02),)), metrics_of(METHODS))


def test_health_warns_below_agreement() -> None:
    assert health(100, 100).warning is None
    warned = health(80, 100)
    assert warned.fraction == 0.8 and warned.warning is not None and "80/100" in warned.warning


def feature_key(**changes: object) -> FeatureKey:
    base = {"target_sha256": "a" * 64, "target": "/models/a", "references_key": "r", "references_sha256": "s",
            "taps": (1, 2), "dtype": "float32", "versions": {"torch": "2.13.0"}}
    return FeatureKey.model_validate({**base, **changes})


def test_a_feature_cache_built_for_another_target_or_taps_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "features"
    folder.mkdir()
    write_model(folder / "build.json", FeatureBuild(key=feature_key(), tasks=(), built_at="x", built_by="run-1",
                                                    build_s=1.0, health=health(1, 1), files={}))
    assert open_features(folder, feature_key()).build.built_by == "run-1"
    with pytest.raises(FieldError, match=r"built for target /models/a \(sha256 aaaaaaaaaaaa\), this run's target is "
                                         r"/models/b \(sha256 bbbbbbbbbbbb\)"):
        open_features(folder, feature_key(target_sha256="b" * 64, target="/models/b"))
    with pytest.raises(FieldError, match=r"taps \(1, 2\) vs this run.s \(1, 3\)"):
        open_features(folder, feature_key(taps=(1, 3)))
    with pytest.raises(FieldError, match="not a feature cache"):
        open_features(tmp_path, feature_key())


def test_greedy_keeps_the_end_of_sequence_token_and_stops_at_the_limit() -> None:
    def step(tokens: list[int], state: int | None) -> tuple[int, int]:
        position = (state or 0) + len(tokens)
        return (7 if position == 6 else position), position

    assert greedy(step, [1, 2, 3], 10, stop_ids=[7]) == ([3, 4, 5, 7], "eos")
    assert greedy(step, [1, 2, 3], 2, stop_ids=[7]) == ([3, 4], "length")


def test_prompt_settings_record_the_template() -> None:
    settings = PromptSettings(format="chat", thinking=False, template_sha256="x")
    assert json.loads(settings.model_dump_json())["thinking"] is False


def offline(drafter: str, tau: float) -> OfflineScore:
    return OfflineScore(target="Qwen/Qwen3.6-27B", drafter=drafter_identity(drafter), label="x", run_id="eval-1",
                        run_dir="/runs/eval-1", features="f" * 16, tasks=10, rounds=300, tau=tau, tau_low=tau - 0.3,
                        tau_high=tau + 0.3, tau_as_sglang=tau + 0.02, recorded_at="now")


@pytest.mark.parametrize("spelling", ["/models/dflash/", "/models//dflash", "//models/./dflash", "/models/x/../dflash"])
def test_one_folder_in_another_spelling_is_one_drafter(spelling: str) -> None:
    assert drafter_identity(spelling) == "/models/dflash"
    assert one_drafter("/models/dflash", spelling) and not one_drafter("/models/dflash", "/models/dflash-2")


def test_registry_keeps_offline_tau_and_compare_shows_it_beside_online(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    converted = "/srv/deployments/drafters/inhouse-0123456789abcdef"
    assert drafter_identity(converted) == "inhouse-0123456789abcdef"
    assert drafter_identity("z-lab/Qwen3.6-27B-DFlash") == "z-lab/Qwen3.6-27B-DFlash"
    registry = BaselineRegistry(runs)
    registry.record_offline(offline("z-lab/Qwen3.6-27B-DFlash", 8.1), offline("/elsewhere/inhouse-0123456789abcdef", 5.4))
    assert registry.offline(converted) is not None and registry.offline(converted).tau == 5.4  # type: ignore[union-attr]
    assert registry.offline("/other/inhouse-ffffffffffffffff") is None

    config = run_config("ab", num_requests=60)
    inhouse = config.arms[1].model_copy(update={"server_info": {**(config.arms[1].server_info or {}),
                                                                "speculative_draft_model_path": converted}})
    run_dir = write_run(runs, config.model_copy(update={"arms": (config.arms[0], inhouse)}),
                        [*synthetic("zlab", 60, 9.0, seed=1), *synthetic("inhouse", 60, 6.0, seed=2)])
    shown = CliRunner().invoke(compare, [str(run_dir)])
    assert "acceptance length offline (dfserve eval, counted as SGLang does) beside online" in shown.output
    assert "zlab (z-lab/Qwen3.6-27B-DFlash): online" in shown.output and "offline 8.120" in shown.output
    assert f"inhouse ({converted}): online" in shown.output and "offline 5.420" in shown.output


def test_an_evaluation_is_never_compared_with_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run folder twice, or a copy of it: refused before anything is judged."""
    loaded: list[Path] = []

    def load(cls: type[EvalRun], path: Path) -> EvalRun:
        loaded.append(path)
        return cls(path, SimpleNamespace(run_id="eval-1"), [], None)  # type: ignore[arg-type]

    monkeypatch.setattr(EvalRun, "load", classmethod(load))
    with pytest.raises(UserError, match=r"are one run \(eval-1\): give it once, with both drafters"):
        compare_eval_runs(tmp_path / "a", tmp_path / "copy-of-a", None, None, None, tmp_path / "out")
    assert loaded == [tmp_path / "a", tmp_path / "copy-of-a"] and not (tmp_path / "out").exists()


def test_runs_that_cannot_be_paired_say_so_in_readable_lines_as_dfserve_compare_does() -> None:
    def config(key: str, block_size: int | None, dtype: str) -> EvalConfig:
        return EvalConfig.model_construct(features=FeatureInfo.model_construct(key=key), block_size=block_size,
                                          max_new_tokens=64, dtype=dtype)

    first, second = config("a" * 64, 8, "float32"), config("b" * 64, None, "bfloat16")
    assert first.comparable_with(second) == [
        "feature cache: aaaaaaaaaaaa… vs bbbbbbbbbbbb… (target, tasks, prompts, references or taps differ)",
        "block_size: 8 vs not set", "dtype: float32 vs bfloat16"]
    assert first.comparable_with(config("a" * 64, 8, "float32")) == []


def test_a_reference_cache_entry_that_is_not_a_file_is_one_line_naming_it(tmp_path: Path) -> None:
    from dfserve.eval import references as refs

    key = refs.ReferenceKey(target_sha256="t", tasks_sha256="s", task_ids=("a",), prompts_sha256="p",
                            prompt=PromptSettings(format="raw", thinking=False, template_sha256=None),
                            max_new_tokens=8, stop_ids=(), source="local", server_model=None)
    assert refs.cached_references(tmp_path, key) is None
    refs.reference_path(tmp_path, key).mkdir(parents=True)
    with pytest.raises(UserError, match=r"reference cache .*references-[0-9a-f]{16}\.json: not a file; remove it"):
        refs.cached_references(tmp_path, key)


def test_references_a_run_sharing_the_cache_stored_first_are_the_ones_kept(tmp_path: Path) -> None:
    """Two runs started together on a new cache: the second to finish its references failed, after making them all,
    with "exists; run files are written once"."""
    from dfserve.eval import references as refs

    key = refs.ReferenceKey(target_sha256="t", tasks_sha256="s", task_ids=("a",), prompts_sha256="p",
                            prompt=PromptSettings(format="raw", thinking=False, template_sha256=None),
                            max_new_tokens=8, stop_ids=(), source="local", server_model=None)

    def made(output: tuple[int, ...]) -> refs.ReferenceSet:
        return refs.ReferenceSet(key=key, source="local", created_at="now", references=(
            refs.Reference(task="a", prompt_ids=(1,), output_ids=output, finish="length"),))

    first, reused = refs.keep_references(tmp_path, made((5, 6)))
    assert not reused
    second, reused = refs.keep_references(tmp_path, made((5, 7)))
    assert reused and first.references[0].output_ids == second.references[0].output_ids == (5, 6)
    assert refs.cached_references(tmp_path, key) == first


def test_a_reference_cache_whose_tokens_were_edited_is_refused_in_one_line(tmp_path: Path) -> None:
    """New features would be built on them, and both drafters scored τ 1.0 and PASSed at +0%."""
    from dfserve.eval import references as refs

    key = refs.ReferenceKey(target_sha256="t", tasks_sha256="s", task_ids=("a",), prompts_sha256="p",
                            prompt=PromptSettings(format="raw", thinking=False, template_sha256=None),
                            max_new_tokens=8, stop_ids=(), source="local", server_model=None)
    refs.keep_references(tmp_path, refs.ReferenceSet(key=key, source="local", created_at="now", references=(
        refs.Reference(task="a", prompt_ids=(1,), output_ids=(5, 6), finish="length"),)))
    path = refs.reference_path(tmp_path, key)
    stored = json.loads(path.read_text())
    stored["references"][0]["output_ids"] = [5, 5]
    path.write_text(json.dumps(stored))
    with pytest.raises(UserError, match=r"references-[0-9a-f]{16}\.json: its tokens no longer match their hash "
                                        r"\(tokens_sha256\): edited or damaged"):
        refs.cached_references(tmp_path, key)
    stored["references"][0]["output_ids"] = [5, 6]
    stored["references"][0]["task"] = "b"  # the tokens' seal holds: a run would pair a's records as b's
    path.write_text(json.dumps(stored))
    with pytest.raises(UserError, match=r"references-[0-9a-f]{16}\.json: its references are not labelled with its "
                                        r"key's tasks in order \(task edited\)"):
        refs.cached_references(tmp_path, key)
    del stored["tokens_sha256"]
    path.write_text(json.dumps(stored))
    with pytest.raises(UserError, match=r"holds no hash of its tokens \(stored by an earlier dfserve\); remove"):
        refs.cached_references(tmp_path, key)
