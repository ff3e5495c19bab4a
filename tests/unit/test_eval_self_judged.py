"""No offline verdict judges a drafter against itself: one checkpoint under two labels, in one run or across two,
z-lab's folder beside its own weights given as a checkpoint. `eval compare` refuses such a pair whether forced or
not, and `eval run` refuses it before any target work, on run folders built here as a run writes them (no torch
forward)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dfserve.cli import main
from dfserve.deploy.drafters import RECORD_NAME
from dfserve.deploy.hashes import file_sha256
from dfserve.errors import UserError
from dfserve.eval import runner
from dfserve.eval.drafters import EvalDrafter, weights_sha256
from dfserve.eval.features import health
from dfserve.eval.metrics import summarize_drafter
from dfserve.eval.records import (
    AnchorRecord,
    DrafterInfo,
    EvalConfig,
    EvalSummary,
    FeatureInfo,
    PromptSettings,
    ReferenceInfo,
    TargetInfo,
    TaskInfo,
    TaskSetInfo,
)
from dfserve.eval.verdict import compare_eval_runs
from dfserve.runs import Provenance, write_model

TASKS = [f"t{i}" for i in range(8)]
SHA = "1234abcd" * 8
ZLAB_FOLDER_SHA, CONVERSION_KEY, WEIGHTS = "a" * 64, "c" * 64, "e" * 64


def drafter(label: str, sha256: str | None, **changes: Any) -> DrafterInfo:
    info = {"label": label, "kind": "folder", "identity": f"/drafters/{label}", "source": f"/drafters/{label}",
            "folder": f"/drafters/{label}", "sha256": sha256, "converted": False, "staged": None, "block_size": 4,
            "target_layer_ids": (1, 2), "mask_token_id": 7, "layers": ("bidirectional",) * 2,
            "mask_embedding": False, "weights_sha256": None}
    return DrafterInfo.model_validate({**info, **changes})


def records_of(label: str, tau: int) -> list[AnchorRecord]:
    """Ten rounds on each task, all of τ `tau`, vanilla and DDTree alike."""
    return [AnchorRecord(drafter=label, task=task, anchor=anchor, matches="", accepted={"vanilla": tau - 1,
                         "ddtree2": tau - 1}, rounds={"vanilla": tau, "ddtree2": tau})
            for task in TASKS for anchor in range(10)]


def eval_run(root: Path, run_id: str, drafters: dict[DrafterInfo, int], interrupted: bool = False) -> Path:
    """A whole run folder as `runner.run_eval` leaves it: config.json, anchors.jsonl, a summary.json sealing them;
    each drafter's rounds all of the τ given."""
    folder = root / run_id
    folder.mkdir(parents=True)
    config = EvalConfig(
        run_id=run_id,
        target=TargetInfo(model="t", folder="/t", sha256="f" * 64, family="qwen3", num_hidden_layers=4,
                          hidden_size=64, vocab_size=300),
        prompt=PromptSettings(format="raw", thinking=False, template_sha256=None),
        tasks=TaskSetInfo(name="tasks", sha256="9" * 64, tasks=tuple(
            TaskInfo(id=t, prompt_tokens=4, output_tokens=40, finish="length") for t in TASKS)),
        max_new_tokens=40, block_size=None, ddtree_budgets=(2,), dtype="float32", anchors_per_forward=1,
        threads=1, drafters=tuple(drafters),
        references=ReferenceInfo(source="local", key="r" * 16, path="/cache/r", reused=True, created_at="now"),
        features=FeatureInfo(key="k" * 16, path="/cache/k", taps=(1, 2), reused=True, built_at="now",
                             built_by="eval-0", build_s=1.0, health=health(1, 1)),
        versions={}, provenance=Provenance.here())
    write_model(folder / "config.json", config)
    records = {info.label: records_of(info.label, tau) for info, tau in drafters.items()}
    (folder / "anchors.jsonl").write_text("".join(r.model_dump_json() + "\n" for rs in records.values() for r in rs))
    summary = EvalSummary(run_id=run_id, interrupted=interrupted, judgements=(), records_sha256=file_sha256(
        folder / "anchors.jsonl"), config_sha256=file_sha256(folder / "config.json"), drafters=tuple(summarize_drafter(label, rs, TASKS, config.methods(), 4)
                                                  for label, rs in records.items()))
    write_model(folder / "summary.json", summary.sealed())
    return folder


@pytest.mark.parametrize("force", [False, True])
def test_one_checkpoint_under_two_labels_is_never_judged_in_one_run(tmp_path: Path, force: bool) -> None:
    run = eval_run(tmp_path / "runs", "eval-1", {drafter("a", SHA): 3, drafter("b", SHA): 3})
    with pytest.raises(UserError) as refused:
        compare_eval_runs(run, None, None, None, None, tmp_path / "out", force)
    assert str(refused.value) == ("drafters a and b are one checkpoint (sha256 1234abcd1234…): a drafter is never "
                                  "judged against itself")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("force", [False, True])
def test_two_runs_of_one_checkpoint_are_never_judged_against_each_other(tmp_path: Path, force: bool) -> None:
    first = eval_run(tmp_path / "runs", "eval-1", {drafter("zlab", SHA): 3})
    second = eval_run(tmp_path / "runs", "eval-2", {drafter("again", SHA): 3})
    with pytest.raises(UserError, match=r"^drafters zlab \(run eval-1\) and again \(run eval-2\) are one checkpoint "
                                        r"\(sha256 1234abcd1234…\): a drafter is never judged against itself$"):
        compare_eval_runs(first, second, "zlab", None, None, tmp_path / "out", force)
    assert not (tmp_path / "out").exists()


def test_zlab_and_its_own_weights_given_as_a_checkpoint_are_one_checkpoint(tmp_path: Path) -> None:
    """Their `sha256` differ (a folder's files, a conversion key); the weight bytes and the architecture do not."""
    zlab = drafter("zlab", ZLAB_FOLDER_SHA, kind="zlab", weights_sha256=WEIGHTS)
    same = drafter("mine", CONVERSION_KEY, kind="checkpoint", converted=True, weights_sha256=WEIGHTS)
    run = eval_run(tmp_path / "runs", "eval-1", {zlab: 3, same: 3})
    with pytest.raises(UserError, match=r"^drafters zlab and mine are one checkpoint \(sha256 eeeeeeeeeeee…\)"):
        compare_eval_runs(run, None, None, None, None, tmp_path / "out", force=True)


def test_other_drafters_are_judged(tmp_path: Path) -> None:
    """Other weights, the same weights under another architecture, or two drafters with no hash at all (nothing
    proves them one: every drafter `eval run` records has both hashes) are judged as before."""
    rewired = drafter("rewired", CONVERSION_KEY, weights_sha256=WEIGHTS, layers=("causal",) * 2)
    pairs = {"other": (drafter("base", SHA, weights_sha256=WEIGHTS), drafter("cand", "d" * 64, weights_sha256="0" * 64)),
             "rewired": (drafter("base", ZLAB_FOLDER_SHA, weights_sha256=WEIGHTS), rewired),
             "unhashed": (drafter("base", None), drafter("cand", None))}
    for name, (base, cand) in pairs.items():
        run = eval_run(tmp_path / "runs", name, {base: 3, cand: 4})
        verdict, path = compare_eval_runs(run, None, None, None, None, tmp_path / name)
        assert verdict.verdict == "PASS" and path.is_file(), name


def test_one_checkpoint_given_two_ways_has_one_weights_hash(tmp_path: Path) -> None:
    """z-lab's folder, its model.safetensors as a checkpoint, and the folder deploy converts a checkpoint into."""
    zlab = tmp_path / "zlab"
    zlab.mkdir()
    (zlab / "model.safetensors").write_bytes(b"weights")
    (zlab / "config.json").write_text("{}")
    hashes = tmp_path / ".hashes"
    given = weights_sha256(zlab, zlab / "model.safetensors", hashes)
    assert weights_sha256(zlab, None, hashes) == given == file_sha256(zlab / "model.safetensors")
    converted = tmp_path / "store" / "inhouse-0123456789abcdef"
    converted.mkdir(parents=True)
    (converted / "model.safetensors").write_bytes(b"weights in bf16")
    (converted / RECORD_NAME).write_text(json.dumps({"source": str(zlab / "model.safetensors"), "sha256": given,
                                                     "tensors": 1, "renamed": {}, "created_at": "now",
                                                     "torch_version": "2",
                                                     "weights_sha256": file_sha256(converted / "model.safetensors")}))
    assert weights_sha256(converted, None, hashes) == given
    (converted / "model.safetensors").write_bytes(b"zeroed in bf16")  # no longer the checkpoint's: never its hash
    with pytest.raises(UserError, match=r"inhouse-0123456789abcdef: its model.safetensors no longer hashes to the "
                                        r"weights_sha256 of dfserve-conversion.json: edited or damaged"):
        weights_sha256(converted, None, hashes)
    (zlab / "model-2.safetensors").write_bytes(b"more")
    assert weights_sha256(zlab, None, hashes) != given


def test_eval_run_refuses_one_checkpoint_named_twice_before_any_target_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused once the drafters are resolved: no tokenizer, reference, feature or scoring; no run folder."""
    infos = {"/ckpt/step-1.pt": drafter("a", SHA, kind="checkpoint"), "/ckpt/copy.pt": drafter("b", SHA, kind="checkpoint")}
    monkeypatch.setattr(runner, "target_folder", lambda target: tmp_path / "target")
    monkeypatch.setattr(runner, "describe_target", lambda target, folder: SimpleNamespace(model_path=target))
    monkeypatch.setattr(runner, "resolve_eval_drafter", lambda spec, label, context: EvalDrafter(
        infos[spec].model_copy(update={"label": label}), Path(infos[spec].folder), None))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t0", "prompt": "def f():"}\n')
    out = tmp_path / "runs"
    with pytest.raises(SystemExit) as exited:
        main(["eval", "run", "--target", "t", "--drafter", "a=/ckpt/step-1.pt", "--drafter", "b=/ckpt/copy.pt",
              "--tasks", str(tasks), "--out", str(out), "--cache", str(tmp_path / "cache"), "--quiet"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err == ("dfserve: error: --drafter: drafters a and b are one checkpoint (sha256 "
                                              "1234abcd1234…): a drafter is never judged against itself; name it "
                                              "once\n")
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_an_interrupted_run_turned_whole_in_its_summary_is_judged_only_forced(tmp_path: Path) -> None:
    run = eval_run(tmp_path / "runs", "eval-1", {drafter("base", SHA): 3, drafter("cand", "d" * 64): 4},
                   interrupted=True)
    summary = run / "summary.json"
    summary.write_text(summary.read_text().replace('"interrupted": true', '"interrupted": false'))
    assert '"interrupted": false' in summary.read_text()
    with pytest.raises(UserError, match=r"eval-1/summary\.json is not as its writer left it .*: edited"):
        compare_eval_runs(run, None, None, None, None, tmp_path / "out")
    verdict, _ = compare_eval_runs(run, None, None, None, None, tmp_path / "forced", force=True)
    assert verdict.forced


def test_a_run_whose_config_was_edited_is_judged_only_forced(tmp_path: Path) -> None:
    """config.json says which drafters a run scored, on which cache: a second run of one checkpoint, its hashes edited
    away, was judged against the first unforced (PASS, +0.0%)."""
    first = eval_run(tmp_path / "runs", "eval-1", {drafter("base", SHA): 3})
    second = eval_run(tmp_path / "runs", "eval-2", {drafter("cand", SHA): 3})
    config = second / "config.json"
    config.write_text(config.read_text().replace(SHA, "d" * 64))
    with pytest.raises(UserError, match=r"eval-2/config\.json is not as its writer left it .*: edited"):
        compare_eval_runs(first, second, "base", None, None, tmp_path / "out")
    verdict, _ = compare_eval_runs(first, second, "base", None, None, tmp_path / "forced", force=True)
    assert verdict.forced


def test_one_checkpoint_in_other_precisions_is_the_same_weights_and_a_training_step_is_not() -> None:
    """A float16 export of a float32 drafter hashes differently (`tensors_sha256` rounds to bfloat16, and a float16
    round trip moves 6% of values across a rounding boundary): it PASSed against itself at +0%."""
    import torch

    from dfserve.eval.drafters import same_weights, tensors_sha256

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024))
    with torch.no_grad():  # a trained layer's scale: about 150 weights below float16's full precision (2^-14)
        model[0].weight.normal_(0.0, 0.02)
    half = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024))
    half.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    mask = torch.randn(1024)
    assert tensors_sha256(model, mask) != tensors_sha256(half, mask.half().float())
    assert same_weights((model, mask), (half, mask.half().float()))
    assert same_weights((model, None), (half.to(torch.bfloat16), None))
    stepped = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024))
    for lr in (1e-4, 1e-6):  # an Adam step moves every weight by about lr
        stepped.load_state_dict({k: v - lr * torch.sign(torch.randn_like(v)) for k, v in model.state_dict().items()})
        assert not same_weights((model, mask), (stepped, mask))
    assert not same_weights((model, mask), (half, None)) and not same_weights((model, None), (half, mask))
    exported = [EvalDrafter(drafter(label, sha), Path(label), None) for label, sha in (("f32", "1" * 64), ("f16", "2" * 64))]
    with pytest.raises(UserError, match="drafters f32 and f16 hold one checkpoint's weights in other precisions"):
        runner._refuse_self_judged(exported, {"f32": (model, mask), "f16": (half, mask.half().float())})
    runner._refuse_self_judged(exported, {"f32": (model, mask), "f16": (stepped, mask)})
    smaller = torch.nn.Sequential(torch.nn.Linear(1024, 1024))
    smaller.load_state_dict({k: v for k, v in half.state_dict().items() if k.startswith("0.")})
    assert not same_weights((model, mask), (smaller, mask)) and not same_weights((smaller, mask), (model, mask))


def test_one_checkpoint_in_other_precisions_is_never_judged_across_runs(tmp_path: Path) -> None:
    """Across runs only the configs are at hand: a float16 copy of the baseline, its hashes all other, PASSed at
    +0% in `eval compare` and `eval watch`; each run keeps its weights at a few places, compared within bfloat16's
    rounding."""
    import torch

    from dfserve.eval.drafters import weights_sample

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
    with torch.no_grad():
        model[0].weight.normal_(0.0, 0.02)
    half = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
    half.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    stepped = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
    stepped.load_state_dict({k: v - 1e-4 * torch.sign(torch.randn_like(v)) for k, v in model.state_dict().items()})
    base = eval_run(tmp_path / "runs", "eval-1", {drafter("base", SHA, weights_sample=weights_sample(model, None)): 3})
    for name, other, verdict in (("half", half, None), ("stepped", stepped, "PASS")):
        cand = eval_run(tmp_path / "runs", name, {drafter("cand", "d" * 64, weights_sample=weights_sample(other, None)): 3})
        if verdict is None:
            with pytest.raises(UserError, match=r"^drafters base \(run eval-1\) and cand \(run half\) are one "
                                                r"checkpoint \(its weights in other precisions\)"):
                compare_eval_runs(base, cand, "base", None, None, tmp_path / "out", force=True)
        else:
            assert compare_eval_runs(base, cand, "base", None, None, tmp_path / name)[0].verdict == verdict
    assert len(weights_sample(model, torch.zeros(256))) == 4 * 32 + 32  # each tensor's places, and the mask's
