"""`dfserve eval` end to end on tiny random-weight targets and tiny drafters in z-lab's layout: real forwards,
z-lab's own online loop as the reference, a distilled drafter against a barely trained one.

The models are the offline demo's (`dfserve.eval.tiny.build_demo`), built once per test session (tests/conftest.py);
the first evaluation run is shared by the tests that read it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dfserve.baselines import BaselineRegistry
from dfserve.cli import main
from dfserve.eval.scoring import torch_threads
from dfserve.verdict.verdict import EXIT
from tests.fixtures.eval import models

if TYPE_CHECKING:
    from dfserve.eval.tiny import DemoModels

pytestmark = pytest.mark.heavy

TASKS = 6
MAX_NEW = 40


@dataclass(frozen=True)
class World:
    root: Path
    target: Path
    tasks: Path
    short: Path
    """A Hugging Face DFlash folder, barely trained."""
    long_checkpoint: Path
    """The distilled drafter as a trainer's checkpoint (nested state dict, DDP prefix)."""
    short_checkpoint: Path
    drafter_config: Path


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """`dfserve ARGS` in this process (torch is loaded once for the whole session): exit status, stdout, stderr."""
    try:
        main([str(a) for a in args])
        status = 0
    except SystemExit as exc:
        status = int(exc.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _checkpoint(drafter: Path, path: Path) -> Path:
    """A Hugging Face drafter folder as a trainer's checkpoint: nested state dict, DDP prefix."""
    weights = load_file(drafter / "model.safetensors")
    torch.save({"step": 1, "model": {f"module.{k}": v for k, v in weights.items()}}, path)
    return path


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory, demo_models: DemoModels) -> World:
    """The offline demo's target and drafters (distilled for 300 steps and for 10), built once per session."""
    root = tmp_path_factory.mktemp("eval")
    target = shutil.copytree(demo_models.target, root / "qwen3")
    config = root / "drafter-config.json"
    config.write_text(json.dumps(models.drafter_config(target)))
    return World(root, target, models.write_tasks(root / "tasks.jsonl", TASKS),
                 shutil.copytree(demo_models.undertrained, root / "short"),
                 _checkpoint(demo_models.distilled, root / "long.pt"),
                 _checkpoint(demo_models.undertrained, root / "short.pt"), config)


def eval_args(world: World, name: str, *drafters: str, out: str = "runs", cache: str = "cache",
              **flags: Any) -> list[str | Path]:
    settings = {"target": world.target, "tasks": world.tasks, "num-tasks": TASKS, "max-new-tokens": MAX_NEW,
                "ddtree-budgets": "2,4", "drafter-config": world.drafter_config, "cache": world.root / cache,
                "drafter-store": world.root / "store", "registry": world.root / out, "out": world.root / out,
                "name": name, **flags}
    args: list[str | Path] = ["eval", "run"]
    for drafter in drafters:
        args += ["--drafter", drafter]
    for flag, value in settings.items():
        args += [f"--{flag}", str(value)]
    return args


@dataclass(frozen=True)
class FirstRun:
    run_dir: Path
    status: int
    out: str
    err: str
    seconds: float


@pytest.fixture(scope="session")
def first_run(world: World) -> FirstRun:
    """The run the tests read: the barely trained drafter (baseline) and the distilled checkpoint. A session
    fixture cannot take capsys, so its output is captured here."""
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    with models.one_thread(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in eval_args(world, "first", f"short={world.short}", f"long={world.long_checkpoint}")])
            status = 0
        except SystemExit as exc:
            status = int(exc.code or 0)
    return FirstRun(world.root / "runs" / "first", status, out.getvalue(), err.getvalue(), time.monotonic() - started)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_run_writes_config_records_summary_report_and_progress(first_run: FirstRun, world: World) -> None:
    assert first_run.status == 0, first_run.err
    run_dir = first_run.run_dir
    config = json.loads((run_dir / "config.json").read_text())
    assert len(config["target"]["sha256"]) == 64 and config["max_new_tokens"] == MAX_NEW
    assert config["ddtree_budgets"] == [2, 4] and config["prompt"]["format"] == "chat"
    assert config["prompt"]["thinking"] is False and config["prompt"]["template_sha256"]
    short, long = config["drafters"]
    assert (short["label"], short["kind"], long["label"], long["kind"]) == ("short", "folder", "long", "checkpoint")
    assert len(short["sha256"]) == 64 and len(long["sha256"]) == 64 and long["converted"] is True
    assert Path(long["staged"]).samefile(world.long_checkpoint)  # hard-linked into the run, never copied
    assert long["layers"] == ["causal, window 16", "bidirectional"] and long["target_layer_ids"] == [1, 2]
    features = config["features"]
    assert features["reused"] is False and features["built_by"] == "first" and features["taps"] == [1, 2]
    assert features["health"]["fraction"] == 1.0 and features["health"]["warning"] is None
    assert sorted(p.name for p in Path(features["path"]).iterdir()) == ["build.json", *(
        f"task-{i:05d}.safetensors" for i in range(TASKS))]

    records = read_jsonl(run_dir / "anchors.jsonl")
    assert {r["drafter"] for r in records} == {"short", "long"} and {r["task"] for r in records} == {
        f"he-{i}" for i in range(TASKS)}
    assert all(set(r["accepted"]) == {"vanilla", "ddtree2", "ddtree4"} for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    for drafter in summary["drafters"]:
        for method in drafter["methods"]:
            assert 1 <= method["tau"]["estimate"] <= models.BLOCK
            assert method["tau"]["low"] <= method["tau"]["estimate"] <= method["tau"]["high"]
            assert sum(method["histogram"]) == method["rounds"]
            assert method["accepted_drafts"] == pytest.approx(method["tau"]["estimate"] - 1)
        # DDTree-N accepts at most N drafts a round
        assert max(i for i, n in enumerate(drafter["methods"][1]["histogram"]) if n) <= 3
        assert len(drafter["positions"]["accuracy"]) == models.BLOCK - 1
    report = (run_dir / "report.html").read_text()
    assert "accuracy per block position" in report and report.count("<polyline") + report.count('r="2.5"') == 4  # a line each, a dot if one point
    verdict = report.index("<h2>long against short</h2><p class='verdict' style='color:#1e7b34'>PASS</p>")
    assert verdict < report.index("<h2>Settings and scores</h2>")  # the page opens with its verdict
    assert "tokens accepted per verify round, vanilla" in report and "per verify round, ddtree4" in report
    assert "left" in first_run.err and "scoring long (anchors)" in first_run.err  # progress with the time left
    assert "long vs short: PASS" in first_run.out


def test_the_distilled_drafter_beats_the_barely_trained_one(first_run: FirstRun, world: World,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    summary = json.loads((first_run.run_dir / "summary.json").read_text())
    judgement = summary["judgements"][0]
    assert (judgement["baseline"], judgement["candidate"], judgement["verdict"]) == ("short", "long", "PASS")
    vanilla = judgement["metrics"][0]
    assert vanilla["metric"] == "tau_vanilla" and vanilla["change_low"] > 0.2  # τ at least 20% higher, with 95%
    status, out, _ = run_cli(capsys, "eval", "compare", first_run.run_dir, "--baseline", "long", "--candidate", "short",
                             "--out", world.root / "verdicts")
    assert status == 1 and "short vs long: FAIL" in out
    verdict = json.loads(next((world.root / "verdicts").glob("eval-verdict-*/eval-verdict.json")).read_text())
    assert verdict["judgement"]["verdict"] == "FAIL" and verdict["candidate"]["name"] == "short" and verdict["source"] == "eval"
    offline = BaselineRegistry(world.root / "runs").read().offline
    assert [s.label for s in offline] == ["short", "long"] and offline[1].tau > offline[0].tau
    assert offline[1].drafter.startswith("inhouse-") and offline[1].features == json.loads(
        (first_run.run_dir / "config.json").read_text())["features"]["key"]


def _tampered(run_dir: Path, to: Path, kind: str) -> Path:
    """A copy of `run_dir` as a killed, interrupted, cut or edited run leaves it."""
    shutil.copytree(run_dir, to, symlinks=True)
    anchors = to / "anchors.jsonl"
    lines = anchors.read_text().splitlines(keepends=True)
    if kind == "killed":
        (to / "summary.json").unlink()
    elif kind == "interrupted":
        summary = json.loads((to / "summary.json").read_text())
        (to / "summary.json").write_text(json.dumps({**summary, "interrupted": True}))
    elif kind == "cut":  # the last drafter's records of its last task lost
        last = json.loads(lines[-1])
        anchors.write_text("".join(line for line in lines if (json.loads(line)["drafter"], json.loads(line)["task"])
                                   != (last["drafter"], last["task"])))
    elif kind == "duplicated":
        anchors.write_text("".join([*lines, lines[0]]))
    elif kind == "edited":  # one round's τ moved to the round before: sums kept, the tasks' figures not
        records = [json.loads(line) for line in lines]
        first, second = records[0]["rounds"], records[1]["rounds"]
        method = next(m for m in first if m in second)
        first[method], second[method] = first[method] + second[method] - 1, 1
        anchors.write_text("".join(json.dumps(r) + "\n" for r in records))
    return to


@pytest.mark.parametrize(("kind", "said"), [
    ("killed", "no summary.json (killed before its end)"),
    ("interrupted", "interrupted (summary.json)"),
    ("cut", "summary.json's figures are not those of its records in anchors.jsonl"),
    ("edited", "anchors.jsonl is not as its writer left it"),
])
def test_a_run_that_is_not_whole_is_judged_only_when_forced_and_stamped(
        first_run: FirstRun, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, said: str) -> None:
    run = _tampered(first_run.run_dir, tmp_path / kind, kind)
    status, _, err = run_cli(capsys, "eval", "compare", run, "--out", tmp_path / "v")
    assert status == 2 and err.count("\n") == 1 and said in err and "--force judges anyway" in err
    assert not (tmp_path / "v").exists()
    status, _, err = run_cli(capsys, "eval", "compare", run, "--out", tmp_path / "v", "--force")
    verdict = json.loads(next((tmp_path / "v").glob("eval-verdict-*/eval-verdict.json")).read_text())
    assert status == EXIT[verdict["verdict"]] and f"forced: eval run {first_run.run_dir.name}" in err
    assert verdict["forced"] is True and any(said in line for line in verdict["incomplete"])


def test_duplicated_records_are_never_judged(first_run: FirstRun, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = _tampered(first_run.run_dir, tmp_path / "dup", "duplicated")
    for forced in ((), ("--force",)):
        status, _, err = run_cli(capsys, "eval", "compare", run, "--out", tmp_path / "v", *forced)
        assert status == 2 and "recorded more than once; duplicated records are never judged" in err


def online_taus(world: World, drafter: Any, target: Any, prompt: list[int], stop: list[int],
                monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """z-lab's own speculative loop at temperature 0: the τ of each round (tokens it committed)."""
    import dflash.model

    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)  # its timer synchronises CUDA
    stats = dflash.model.dflash_generate(drafter, target, torch.tensor([prompt]), MAX_NEW + models.BLOCK, stop,
                                         temperature=0.0, return_stats=True)
    return list(stats.acceptance_lengths)


def test_offline_tau_per_round_equals_zlab_online_loop(first_run: FirstRun, world: World,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Online, each round commits τ tokens; offline, the trajectory over cached features must make the same rounds.
    z-lab's loop shrinks its last block to fit `max_new_tokens` (SGLang does not), so it runs with a block of room
    and its rounds are cut where the reference ends."""
    from dflash.model import DFlashDraftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((first_run.run_dir / "config.json").read_text())
    references = json.loads(Path(config["references"]["path"]).read_text())["references"]
    records = read_jsonl(first_run.run_dir / "anchors.jsonl")
    target = AutoModelForCausalLM.from_pretrained(world.target, dtype=torch.float32).eval()
    stop = [json.loads((world.target / "generation_config.json").read_text())["eos_token_id"]]
    compared = 0
    with models.one_thread():
        for info in config["drafters"]:
            drafter = DFlashDraftModel.from_pretrained(info["folder"], dtype=torch.float32).eval()
            for reference in references:
                offline = [(r["anchor"], r["rounds"]["vanilla"]) for r in records
                           if r["drafter"] == info["label"] and r["task"] == reference["task"] and "vanilla" in r["rounds"]]
                prompt_len = len(reference["prompt_ids"])
                last = prompt_len + len(reference["output_ids"]) - 1
                online, anchor = [], prompt_len
                for tau in online_taus(world, drafter, target, reference["prompt_ids"], stop, monkeypatch):
                    if anchor >= last:
                        break
                    online.append((anchor, min(tau, last - anchor)))
                    anchor += tau
                assert offline == sorted(offline) and online == offline, (info["label"], reference["task"])
                compared += len(online)
    assert compared > 2 * TASKS


def test_a_second_checkpoint_reuses_the_features_and_compares_across_runs(
        first_run: FirstRun, world: World, capsys: pytest.CaptureFixture[str]) -> None:
    with torch_threads(2):
        status, _, err = run_cli(capsys, *eval_args(world, "second", f"again={world.short_checkpoint}", threads=1))
        assert torch.get_num_threads() == 2  # --threads holds for the run only
    assert status == 0, err
    first = json.loads((first_run.run_dir / "config.json").read_text())
    second = json.loads((world.root / "runs" / "second" / "config.json").read_text())
    assert second["threads"] == 1 and first["threads"] == 1  # the first ran under the fixture's one thread
    assert second["features"]["reused"] is True and second["references"]["reused"] is True
    assert second["features"]["key"] == first["features"]["key"] and second["features"]["built_by"] == "first"
    assert "target features" not in err and "references" not in err  # no target forward ran
    status, out, _ = run_cli(capsys, "eval", "compare", first_run.run_dir, world.root / "runs" / "second",
                             "--baseline", "long", "--candidate", "again", "--out", world.root / "verdicts2")
    assert status == 1 and "again vs long: FAIL" in out


def test_the_same_target_at_another_path_reuses_its_features(first_run: FirstRun, world: World,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The cache is keyed by the target's content: a copy elsewhere (another cache folder of a hub, a moved
    checkout) is the same target."""
    moved = world.root / "moved" / "qwen3"
    shutil.copytree(world.target, moved)
    with models.one_thread():
        status, _, err = run_cli(capsys, *eval_args(world, "moved", f"short={world.short}", target=moved))
    assert status == 0, err
    first = json.loads((first_run.run_dir / "config.json").read_text())
    config = json.loads((world.root / "runs" / "moved" / "config.json").read_text())
    assert config["features"]["reused"] is True and config["features"]["key"] == first["features"]["key"]
    assert "target features" not in err

    status, _, err = run_cli(capsys, *eval_args(world, "other", f"again={world.short_checkpoint}",
                                                **{"max-new-tokens": MAX_NEW // 2}))
    assert status == 0, err
    status, _, err = run_cli(capsys, "eval", "compare", first_run.run_dir, world.root / "runs" / "other",
                             "--baseline", "long", "--candidate", "again")
    assert status == 2 and err.count("\n") == 1
    assert f"runs are not comparable (feature cache: {first['features']['key']} vs " in err
    assert f"; max_new_tokens: {MAX_NEW} vs {MAX_NEW // 2}); evaluate both drafters on one cache" in err


def _tree(folder: Path) -> list[str]:
    """Every path under `folder` but the machine's memo of file content hashes (`.hashes`, shared with deploy)."""
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".hashes" not in p.parts)


def test_bad_inputs_fail_in_one_line_and_write_nothing(world: World, first_run: FirstRun,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    broken = world.root / "broken.pt"
    broken.write_bytes(world.long_checkpoint.read_bytes()[:2000])
    nan = world.root / "nan.pt"
    state = torch.load(world.short_checkpoint, weights_only=True)
    state["model"]["module.fc.weight"][0, 0] = float("nan")
    torch.save(state, nan)
    last_tap = world.root / "last-tap"
    models.save_drafter(models.new_drafter(world.target, taps=(1, models.TARGET_LAYERS - 1)), last_tap)
    outside = world.root / "outside"
    models.save_drafter(models.new_drafter(world.target, taps=(1, models.TARGET_LAYERS + 2)), outside)
    other_target = models.qwen3_target(world.root / "qwen3-other", seed=1)  # same shapes, other weights
    truncated = shutil.copytree(world.short, world.root / "truncated", dirs_exist_ok=True)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    features = json.loads((first_run.run_dir / "config.json").read_text())["features"]["path"]
    bogus = shutil.copytree(world.short, world.root / "bogus-activation", dirs_exist_ok=True)
    (bogus / "config.json").write_text(json.dumps({**json.loads((bogus / "config.json").read_text()),
                                                   "hidden_act": "bogus"}))
    nan_mask = shutil.copytree(world.short, world.root / "nan-mask", dirs_exist_ok=True)
    config = json.loads((nan_mask / "config.json").read_text())
    torch.save({"embedding": torch.full((config["hidden_size"],), float("nan")),
                "mask_token_id": config["dflash_config"]["mask_token_id"]}, nan_mask / "mask_embedding.pt")
    cases = [
        ([str(bogus)], {}, "--drafter: ", "bogus-activation: does not load (KeyError: "),
        ([str(nan_mask)], {}, "--drafter: ", "nan-mask: mask_embedding.pt holds NaN or Inf values as loaded in "
         "torch.float32"),
        ([f"x={broken}"], {}, "--drafter: ", "is not a torch checkpoint that loads with weights_only"),
        ([f"x={nan}"], {}, "--drafter: ", "fc.weight has 1 NaN and 0 Inf values"),
        ([str(last_tap)], {}, "--drafter: drafter config ", "include the target's last layer (3)"),
        ([str(outside)], {}, "--drafter: drafter config ", "target_layer_ids [6] outside the target's 4 layers"),
        ([str(truncated)], {}, "--drafter: ", "model.safetensors is not a safetensors file (ValueError: its tensors "
         "end at byte"),
        ([str(world.short)], {"target": other_target, "features": features}, "--features: ",
         "was built for target"),
    ]
    before = {name: _tree(world.root / name) for name in ("bad", "cache", "store")}
    for drafters, flags, flag, message in cases:
        status, out, err = run_cli(capsys, *eval_args(world, "refused", *drafters, out="bad", **flags))
        assert status == 2 and out == "", err
        assert err.startswith(f"dfserve: error: {flag}") and message in err and err.count("\n") == 1, err
    assert {name: _tree(world.root / name) for name in before} == before


def test_a_run_that_would_score_no_verify_round_is_refused_before_its_folder(
        world: World, capsys: pytest.CaptureFixture[str]) -> None:
    """Outputs of one token leave no round: τ was NaN, written as null into the baseline registry, which no command
    could read after."""
    status, _, err = run_cli(capsys, *eval_args(world, "one-token", str(world.short), out="one-token",
                                                cache="one-token-cache", **{"max-new-tokens": 1}))
    assert status == 2 and err.splitlines()[-1] == (
        "dfserve: error: --max-new-tokens: no task's reference output is two tokens or longer: there is no verify "
        "round to score, and τ is undefined (raise it, or give tasks the target answers at length)")
    assert not (world.root / "one-token").exists()


def test_one_checkpoint_named_twice_is_refused_before_any_work(world: World,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """One checkpoint under two labels, or a folder beside its copy, would pass at exactly 0%: refused once the
    drafters are resolved, before any reference, feature or score, and no run folder is made."""
    copy = shutil.copytree(world.short, world.root / "short-copy")
    bf16 = shutil.copytree(world.short, world.root / "short-bf16")  # in the dtype a checkpoint is converted to
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(bf16 / "model.safetensors").items()},
              str(bf16 / "model.safetensors"))
    trainer = _checkpoint(bf16, world.root / "short-bf16.pt")  # the same weights as a trainer saves them
    float32 = _checkpoint(world.short, world.root / "short-fp32.pt")  # converted to bfloat16, scored in float32
    for drafters in ([f"a={world.short_checkpoint}", f"b={world.short_checkpoint}"], [f"short={world.short}",
                                                                                      f"copy={copy}"],
                     [f"folder={bf16}", f"trainer={trainer}"], [f"folder={world.short}", f"trainer={float32}"]):
        status, out, err = run_cli(capsys, *eval_args(world, "twice", *drafters, out="twice", cache="twice-cache"))
        assert status == 2 and out == "", err
        assert err.startswith("dfserve: error: --drafter: drafters ") and err.count("\n") == 1, err
        assert "are one checkpoint (sha256 " in err and "a drafter is never judged against itself; name it once" in err
    assert not (world.root / "twice").exists() and not (world.root / "twice-cache").exists()


def test_a_hybrid_gated_deltanet_target_in_the_vision_language_layout(world: World,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3.5/3.6: Gated DeltaNet and gated attention layers, loaded as `Qwen3_5ForCausalLM` from the checkpoint
    layout of the 27B; its own greedy references agree with its teacher-forced argmax."""
    hybrid = world.root / "qwen35-run"
    target = models.qwen35_target(hybrid / "target")
    drafter = models.save_drafter(models.new_drafter(target, taps=(1, 5)), hybrid / "drafter")
    with models.one_thread():
        status, out, err = run_cli(capsys, *eval_args(world, "hybrid", str(drafter), out="hybrid-runs",
                                                      cache="hybrid-cache", target=target, **{"num-tasks": 2}))
    assert status == 0, err
    config = json.loads((world.root / "hybrid-runs" / "hybrid" / "config.json").read_text())
    layers = json.loads((target / "config.json").read_text())["text_config"]["layer_types"]
    assert layers.count("linear_attention") == 6 and layers.count("full_attention") == 2
    assert config["target"]["family"] == "qwen3_5_text" and config["features"]["taps"] == [1, 5]
    assert config["features"]["health"]["fraction"] >= 0.99
    assert "drafter" in out


def _zero_data(path: Path) -> None:
    """Every tensor of a safetensors file set to zero, its header left as it was."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start:] = bytes(len(data) - start)
    path.write_bytes(bytes(data))


def test_a_feature_cache_whose_content_no_longer_matches_its_hashes_is_refused(
        world: World, first_run: FirstRun, capsys: pytest.CaptureFixture[str]) -> None:
    """Zeroed tensors scored as features would give a drafter τ 1.0 and a verdict on nothing; a torn header would
    end the run in a traceback inside a half-written run folder. Both are refused before the run folder exists."""
    built = Path(json.loads((first_run.run_dir / "config.json").read_text())["features"]["path"])
    registry = world.root / "runs" / "baselines.json"
    before = registry.read_bytes()

    def damaged(name: str, damage: Any) -> Path:
        copy = world.root / "damaged" / name
        shutil.copytree(built, copy)
        damage(copy)
        return copy

    task = "task-00002.safetensors"
    cases = [
        (damaged("zeroed", lambda f: [_zero_data(p) for p in f.glob("*.safetensors")]),
         "task-00000.safetensors: its content does not match the sha256 recorded in build.json"),
        (damaged("header", lambda f: (f / task).write_bytes(b"\xff" * 8 + (f / task).read_bytes()[8:])),
         f"{task}: its content does not match"),
        (damaged("missing", lambda f: (f / task).unlink()), f"{task}: cannot be read"),
        (damaged("v1", lambda f: (f / "build.json").write_text(json.dumps(
            {**{k: v for k, v in json.loads((f / "build.json").read_text()).items() if k != "files"},
             "schema_version": 1}))), "build.json: built by an earlier dfserve that recorded no content hashes"),
    ]
    for folder, message in cases:
        status, out, err = run_cli(capsys, *eval_args(world, "damaged", f"short={world.short}", features=folder))
        assert status == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith(f"dfserve: error: --features: {folder}") and message in err, err
        assert "never used" in err
        assert not (world.root / "runs" / "damaged").exists()
    assert registry.read_bytes() == before  # no offline τ recorded from damaged features
    shutil.copytree(world.root / "cache", world.root / "damaged-cache")  # found in --cache, not named by --features
    found = world.root / "damaged-cache" / "features" / built.name
    (found / task).unlink()
    status, _, err = run_cli(capsys, *eval_args(world, "damaged", f"short={world.short}", cache="damaged-cache"))
    assert status == 2 and err.startswith(f"dfserve: error: --cache: {found / task}: cannot be read"), err


def test_a_checkpoint_saved_over_while_the_run_prepared_is_refused_not_kept(
        first_run: FirstRun, world: World, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer renamed a newer checkpoint over the one named while references and features were made: the run's
    inputs/ held the newer bytes beside the score and hash of the older."""
    from dfserve.eval import runner

    checkpoint = shutil.copy(world.short_checkpoint, world.root / "rotating.pt")
    prepare = runner._prepare

    def prepared_while_a_trainer_saves(*args: Any, **kwargs: Any) -> Any:
        done = prepare(*args, **kwargs)
        shutil.copy(world.long_checkpoint, world.root / "rotating.pt.tmp")
        os.replace(world.root / "rotating.pt.tmp", checkpoint)
        return done

    monkeypatch.setattr(runner, "_prepare", prepared_while_a_trainer_saves)
    status, _, err = run_cli(capsys, *eval_args(world, "rotated", f"x={checkpoint}"))
    assert status == 2 and err.count("\n") == 1 and "rotating.pt changed while the run prepared" in err, err
    assert not (world.root / "runs" / "rotated").exists()


def test_a_task_file_unreadable_after_its_hash_was_checked_is_one_line(world: World, first_run: FirstRun) -> None:
    from dfserve.errors import FieldError
    from dfserve.eval import features as feat

    built = Path(json.loads((first_run.run_dir / "config.json").read_text())["features"]["path"])
    copy = world.root / "torn" / built.name
    shutil.copytree(built, copy)
    build = feat.FeatureBuild.model_validate_json((copy / "build.json").read_bytes())
    store = feat.open_features(copy, build.key)
    (copy / "task-00001.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(FieldError, match=r"task-00001.safetensors: it no longer reads as safetensors .* never used"):
        store.context(1, build.key.taps)
    with pytest.raises(FieldError, match=r"task-00001.safetensors: its content does not match"):
        feat.open_features(copy, build.key)
    assert store.context(0, build.key.taps).shape[-1] > 0


def test_a_run_name_that_is_not_one_folder_name_is_refused_before_any_work(
        world: World, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("../../escape", "..", ".hidden", ""):
        status, out, err = run_cli(capsys, *eval_args(world, name, f"short={world.short}", out="named"))
        assert status == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith(f"dfserve: error: --name: run name {name!r} "), err
    assert not (world.root / "named").exists() and not (world.root.parent / "escape").exists()


def test_a_target_whose_safetensors_header_is_torn_is_one_line(world: World,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    torn = world.root / "torn-target"
    shutil.copytree(world.target, torn)
    weights = next(torn.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"x" + data[9:])  # the header is no longer JSON
    status, out, err = run_cli(capsys, *eval_args(world, "torn", f"short={world.short}", out="torn-runs",
                                                  cache="torn-cache", target=torn))
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"dfserve: error: --target: {torn}") and "Traceback" not in err, err
    assert not (world.root / "torn-runs").exists()
