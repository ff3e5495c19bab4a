"""`dfserve eval watch` beside a fake trainer: a tiny drafter distilled for more and more steps, saved the ways
trainers save (a plain file, a temporary name renamed, a slow write, a corrupt file, a Hugging Face folder, one
sharded and written shard by shard, a NaN file replaced, two files of one step), a watch killed mid-run and
started again, and a real Pushgateway receiving the gauges."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fixtures.eval import models
from tests.integration.servers import pushgateway_server
from tests.integration.test_eval import run_cli

pytestmark = pytest.mark.heavy

TASKS = 6
MAX_NEW = 32
STEPS = (2, 15, 50, 120)
POLL_S = 0.2


@dataclass(frozen=True)
class Trained:
    root: Path
    target: Path
    tasks: Path
    drafter_config: Path
    states: dict[int, dict[str, torch.Tensor]]
    """The drafter's weights after each number of distillation steps, as a DDP trainer names them."""
    final: Any
    baseline: Path
    """A Hugging Face folder of the most trained drafter."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    root = tmp_path_factory.mktemp("watch")
    states = {}
    with models.one_thread():
        target = models.qwen3_target(root / "qwen3")
        data = models.distillation_data(target)
        drafter = models.new_drafter(target, seed=3)
        done = 0
        for step in STEPS:
            models.distil(drafter, data, steps=step - done, seed=step)
            done = step
            states[step] = {f"module.{k}": v.detach().clone() for k, v in drafter.state_dict().items()}
    config = root / "drafter-config.json"
    config.write_text(json.dumps(models.drafter_config(target)))
    return Trained(root, target, models.write_tasks(root / "tasks.jsonl", TASKS), config, states, drafter,
                   models.save_drafter(drafter, root / "baseline"))


class FakeTrainer:
    """Writes checkpoints into a folder over time and remembers what it wrote (name -> inode, size, mtime)."""

    def __init__(self, folder: Path, trained: Trained) -> None:
        self.folder, self.trained = folder, trained
        self.wrote: dict[str, tuple[int, int, int]] = {}
        folder.mkdir(parents=True, exist_ok=True)

    def _done(self, path: Path) -> None:
        for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
            if p.is_file():
                stat = p.stat()
                self.wrote[str(p.relative_to(self.folder))] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def _bytes(self, step: int) -> bytes:
        tmp = self.trained.root / f"bytes-{step}.pt"
        torch.save({"step": step, "model": self.trained.states[step]}, tmp)
        return tmp.read_bytes()

    def plain(self, step: int) -> None:
        path = self.folder / f"step_{step}" / "checkpoint.pt"
        path.parent.mkdir()
        path.write_bytes(self._bytes(step))
        self._done(path)

    def renamed(self, step: int) -> None:
        tmp = self.folder / f"drafter_step{step}.pt.tmp"
        tmp.write_bytes(self._bytes(step))
        time.sleep(4 * POLL_S)  # long enough for the watch to see it, were it looking
        tmp.rename(self.folder / f"drafter_step{step}.pt")
        self._done(self.folder / f"drafter_step{step}.pt")

    def slowly(self, step: int, chunks: int = 12) -> None:
        """Written in pieces, each poll seeing a bigger file; a pause between pieces shorter than a poll."""
        data = self._bytes(step)
        path = self.folder / f"step_{step}" / "checkpoint.pt"
        path.parent.mkdir()
        with path.open("wb") as handle:
            for i in range(chunks):
                handle.write(data[i * len(data) // chunks:(i + 1) * len(data) // chunks])
                handle.flush()
                time.sleep(POLL_S * 0.7)
        self._done(path)

    def corrupt(self, step: int) -> None:
        path = self.folder / f"step_{step}" / "checkpoint.pt"
        path.parent.mkdir()
        data = self._bytes(STEPS[0])
        path.write_bytes(data[: len(data) // 3])
        self._done(path)

    def folder_checkpoint(self, step: int) -> None:
        """The most trained drafter with one weight nudged past bfloat16's resolution: as good as the baseline, and
        not the baseline's own weights (those are never judged)."""
        drafter = copy.deepcopy(self.trained.final)
        with torch.no_grad():
            next(iter(drafter.parameters())).view(-1)[0] += 0.01
        tmp = self.folder / f".checkpoint-{step}"
        models.save_drafter(drafter, tmp)
        tmp.rename(self.folder / f"checkpoint-{step}")
        self._done(self.folder / f"checkpoint-{step}")


def watch_args(trained: Trained, folder: Path, out: Path, *extra: str | Path) -> list[str]:
    settings = {"target": trained.target, "tasks": trained.tasks, "num-tasks": TASKS, "max-new-tokens": MAX_NEW,
                "ddtree-budgets": "2,4", "drafter-config": trained.drafter_config, "cache": trained.root / "cache",
                "drafter-store": trained.root / "store", "registry": trained.root / "registry", "out": out,
                "baseline": trained.baseline, "poll-seconds": POLL_S, "threads": 1}
    args = ["eval", "watch", str(folder), "--every-checkpoint", "--quiet"]
    for flag, value in settings.items():
        args += [f"--{flag}", str(value)]
    return args + [str(e) for e in extra]


def _state(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / "watch.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _wait(until: Callable[[], bool], what: str, timeout_s: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            _, err = process.communicate()
            raise AssertionError(f"{what}: watch exited {process.returncode} or timed out; {err.decode()[-2000:]}")
        time.sleep(0.01)


def _gauges(url: str) -> dict[str, float]:
    """`name{label=...,}` -> value of every dfserve_eval_watch sample the Pushgateway holds (labels sorted)."""
    found = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("dfserve_eval_watch"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            parts = sorted(p for p in labels.rstrip("}").split(",") if p and not p.startswith(("instance=", "job=")))
            found[f"{name}{{{','.join(parts)}}}"] = float(value)
    return found


def test_a_watch_beside_a_trainer_scores_each_checkpoint_once_in_order_through_a_kill(
        trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, out = tmp_path / "checkpoints", tmp_path / "watch"
    trainer = FakeTrainer(folder, trained)
    trainer.plain(STEPS[0])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    first = subprocess.Popen([sys.executable, "-m", "dfserve", *watch_args(trained, folder, out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        _wait(lambda: _state(out).get("checkpoints", {}).get("step_2/checkpoint.pt", {}).get("status") == "scored",
              "step 2 scored", 300, first)
        assert os.getpriority(os.PRIO_PROCESS, first.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
        trainer.renamed(STEPS[1])
        _wait(lambda: "drafter_step15.pt" in _state(out).get("checkpoints", {}), "step 15 started", 60, first)
        killed_while = _state(out)["checkpoints"]["drafter_step15.pt"]["status"]
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first_err = first.communicate()[1].decode()

    def write_the_rest() -> None:
        trainer.slowly(STEPS[2])
        trainer.corrupt(80)
        time.sleep(3 * POLL_S)
        trainer.folder_checkpoint(STEPS[3])

    writer = threading.Thread(target=write_the_rest)
    pushed_steps: list[float] = []
    done = threading.Event()

    def read_pushes(gateway: str) -> None:
        """Each push replaces the watch's group: the steps seen over time are one per scored checkpoint."""
        while not done.wait(0.05):
            step = _gauges(gateway).get('dfserve_eval_watch_step{watch="run7"}')
            if step is not None and (not pushed_steps or pushed_steps[-1] != step):
                pushed_steps.append(step)

    with pushgateway_server() as gateway, models.one_thread():
        reader = threading.Thread(target=read_pushes, args=(gateway,))
        writer.start()
        reader.start()
        status, stdout, err = run_cli(capsys, *watch_args(trained, folder, out, "--pushgateway", gateway,
                                                          "--watch-name", "run7", "--stop-after-idle", 4,
                                                          "--nice", 0))
        writer.join()
        done.set()
        reader.join()
        gauges = _gauges(gateway)
    assert status == 0, err
    assert "scored 3 checkpoints" in stdout  # 15 (again or adopted), 50, 120: nothing scored twice

    state = json.loads((out / "watch.json").read_text())["checkpoints"]
    assert {k: v["status"] for k, v in state.items()} == {
        "step_2/checkpoint.pt": "scored", "drafter_step15.pt": "scored", "step_50/checkpoint.pt": "scored",
        "step_80/checkpoint.pt": "corrupt", "checkpoint-120": "scored"}
    runs = sorted(p.name for p in (out / "runs").iterdir())
    if killed_while == "started":  # killed mid-run: the partial run stays, the next attempt has its own name
        assert state["drafter_step15.pt"]["attempt"] == 2 and "resumed: drafter_step15.pt (step 15) was cut" in err
        # the kill may come before the first attempt's run folder exists
        assert [r for r in runs if r != "step-000000015"] == [
            "baseline", "step-000000002", "step-000000015-attempt2", "step-000000050", "step-000000120"]
        assert not (out / "runs" / "step-000000015" / "summary.json").exists()
    else:
        assert runs == ["baseline", "step-000000002", "step-000000015", "step-000000050", "step-000000120"]
    assert "scoring the baseline" in first_err and "scoring the baseline" not in err  # scored once

    corrupt = [line for line in err.splitlines() if "corrupt:" in line]
    assert len(corrupt) == 1 and corrupt[0].startswith("corrupt: step_80/checkpoint.pt: ") and "does not load" in corrupt[0]
    assert "step_50" not in "".join(corrupt) and "skipped:" not in err  # the slow one waited until it was whole
    scored_lines = [line.split()[1] for line in (first_err + err).splitlines() if line.startswith("scored:")]
    assert scored_lines == ["step_2/checkpoint.pt", "drafter_step15.pt", "step_50/checkpoint.pt", "checkpoint-120"]

    trend = json.loads((out / "trend.json").read_text())
    assert [p["step"] for p in trend["points"]] == list(STEPS)
    taus = [p["tau"]["vanilla"]["estimate"] for p in trend["points"]]
    assert max(taus[:2]) < taus[2] < taus[3]  # τ rises with training (the first few steps are noise)
    assert [c["checkpoint"] for c in trend["corrupt"]] == ["step_80/checkpoint.pt"]
    last, baseline = trend["points"][-1], trend["baseline"]
    assert last["tau"] == baseline["tau"] and last["judgement"]["verdict"] == "PASS"  # the baseline's weights, nudged
    assert trend["points"][0]["judgement"]["verdict"] == "FAIL"
    assert trend["projections"]["vanilla"]["outcome"] == "reached"
    assert trend["projections"]["vanilla"]["crossing_step"] == STEPS[3]
    report = (out / "report.html").read_text()
    assert "τ by training step" in report and "draft accuracy by training step" in report
    assert report.count("<polyline") == 3 + 4 + 3  # τ per method (baselines are <line>s), 4 positions, 3 curves
    assert "<div class='plots'><svg" in report and ".plots svg{min-width:520px}" in report  # read on a phone too

    # what the trainer wrote is as it wrote it, and nothing else is in its folder
    found = {str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
             for p in folder.rglob("*") if p.is_file()}
    assert found == trainer.wrote
    assert (out / "staged" / "step-000000050.pt").samefile(folder / "step_50" / "checkpoint.pt")

    # on restart the trend as it stood (step 2 alone when 15 was cut short), then each checkpoint as it is scored
    resumed_with = [STEPS[0]] if state["drafter_step15.pt"]["attempt"] == 2 else []
    assert pushed_steps == [*resumed_with, STEPS[1], STEPS[2], STEPS[3]]
    assert gauges['dfserve_eval_watch_step{watch="run7"}'] == STEPS[3]
    for method in ("vanilla", "ddtree2", "ddtree4"):
        tau = last["tau"][method]["estimate"]
        assert gauges[f'dfserve_eval_watch_tau{{method="{method}",watch="run7"}}'] == pytest.approx(tau)
        assert gauges[f'dfserve_eval_watch_tau_gap{{method="{method}",watch="run7"}}'] == pytest.approx(0.0)
        assert gauges[f'dfserve_eval_watch_projection{{method="{method}",outcome="reached",watch="run7"}}'] == 1.0
        assert gauges[f'dfserve_eval_watch_projection{{method="{method}",outcome="plateau_below",watch="run7"}}'] == 0


def test_a_watch_refuses_to_write_inside_the_checkpoint_folder_and_a_restart_under_other_settings(
        trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    status, _, err = run_cli(capsys, *watch_args(trained, folder, folder / "watch", "--nice", 0))
    assert status == 2 and err.count("\n") == 1 and "--out: " in err and "never writes into the checkpoint" in err
    assert list(folder.iterdir()) == []
    out = tmp_path / "watch"
    out.mkdir()
    (out / "watch.json").write_text(json.dumps({"schema_version": 1, "kind": "eval-watch-state",
                                                "settings": {"target": "another"}, "checkpoints": {}}))
    status, _, err = run_cli(capsys, *watch_args(trained, folder, out, "--nice", 0))
    assert status == 2 and err.count("\n") == 1 and "started under other settings" in err and "target" in err


def test_a_watch_rescores_a_replaced_checkpoint_waits_for_a_sharded_folder_and_names_two_of_one_step(
        trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, out = tmp_path / "checkpoints", tmp_path / "watch"

    def save(key: str, step: int, weights: dict[str, torch.Tensor]) -> None:
        path = folder / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")  # published by a rename, over what was there
        torch.save({"step": step, "model": weights}, tmp)
        tmp.rename(path)

    nan = {k: v.clone() for k, v in trained.states[STEPS[0]].items()}
    next(iter(nan.values())).view(-1)[0] = float("nan")
    save("step_20/checkpoint.pt", 20, nan)
    with models.one_thread():
        status, _, err = run_cli(capsys, *watch_args(trained, folder, out, "--stop-after-idle", 2, "--nice", 0))
    assert status == 0, err
    corrupt = [line for line in err.splitlines() if line.startswith("corrupt:")]
    assert len(corrupt) == 1 and corrupt[0].startswith("corrupt: step_20/checkpoint.pt: ") and "NaN" in corrupt[0]

    save("step_20/checkpoint.pt", 20, trained.states[STEPS[2]])
    save("step_15/checkpoint.pt", 15, trained.states[STEPS[1]])
    save("step_15/ema.pt", 15, trained.states[STEPS[2]])
    whole = models.save_drafter(trained.final, tmp_path / "whole") / "model.safetensors"
    tensors = load_file(str(whole))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = folder / "checkpoint-40"

    def write_shard(name: str) -> None:
        save_file({k: tensors[k] for k in shards[name]}, str(sharded / name), metadata={"format": "pt"})

    def write_in_parts() -> None:
        """The config and a shard, then, several polls later, the other shard and the index."""
        sharded.mkdir()
        (sharded / "config.json").write_text((whole.parent / "config.json").read_text())
        write_shard("model-00001-of-00002.safetensors")
        time.sleep(8 * POLL_S)
        write_shard("model-00002-of-00002.safetensors")
        weight_map = {k: name for name, keys in shards.items() for k in keys}
        (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    writer = threading.Thread(target=write_in_parts)
    writer.start()
    with models.one_thread():
        status, stdout, err = run_cli(capsys, *watch_args(trained, folder, out, "--stop-after-idle", 4, "--nice", 0))
    writer.join()
    assert status == 0, err
    assert "corrupt:" not in err and "scored 3 checkpoints" in stdout
    assert "skipped: checkpoint-40 (step 40): drafters the baseline and this checkpoint are one checkpoint" in err
    assert [line for line in err.splitlines() if line.startswith("waiting:")] == [
        f"waiting: checkpoint-40: {sharded} holds the shard model-00001-of-00002.safetensors but no *.index.json yet"]
    state = json.loads((out / "watch.json").read_text())["checkpoints"]
    assert {k: v["status"] for k, v in state.items()} == {
        "step_20/checkpoint.pt": "scored", "step_15/checkpoint.pt": "scored", "step_15/ema.pt": "scored",
        "checkpoint-40": "skipped"}  # the shards hold the baseline's own weights: scored, never judged
    ema = "step-000000015-" + hashlib.sha256(b"step_15/ema.pt").hexdigest()[:8]
    assert sorted(p.name for p in (out / "runs").iterdir()) == [
        "baseline", "step-000000015", ema, "step-000000020", "step-000000040"]
    assert (out / "staged" / "step-000000020.pt").samefile(folder / "step_20" / "checkpoint.pt")
    assert sorted(p.name for p in (out / "staged" / "step-000000040").iterdir()) == sorted(
        p.name for p in sharded.iterdir())
    trend = json.loads((out / "trend.json").read_text())
    assert [p["step"] for p in trend["points"]] == [15, 15, 20] and trend["corrupt"] == []
    assert [(p["checkpoint"], p["step"]) for p in trend["skipped"]] == [("checkpoint-40", 40)]

    edited = tmp_path / "drafter-config.json"
    edited.write_text(trained.drafter_config.read_text() + "\n")
    args = watch_args(trained, folder, out, "--nice", 0)
    args[args.index("--drafter-config") + 1] = str(edited)
    status, _, err = run_cli(capsys, *args)
    assert status == 2 and err.count("\n") == 1 and "started under other settings (drafter_config)" in err


def _run(trained: Trained, tmp_path: Path, name: str, cache: Path, *extra: str) -> list[str]:
    settings = {"target": trained.target, "tasks": trained.tasks, "num-tasks": TASKS, "max-new-tokens": MAX_NEW,
                "ddtree-budgets": "2,4", "drafter-store": trained.root / "store", "registry": tmp_path / "registry",
                "out": tmp_path / "runs", "cache": cache, "name": name}
    args = ["eval", "run", "--drafter", str(trained.baseline), "--quiet", *extra]
    for flag, value in settings.items():
        args += [f"--{flag}", str(value)]
    return args


def test_a_feature_cache_built_in_parts_merges_into_the_one_a_whole_run_reuses(
        trained: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with models.one_thread():
        for i in range(2):
            status, _, err = run_cli(capsys, *_run(trained, tmp_path, f"part-{i}", tmp_path / f"part-{i}",
                                                   "--shard", f"{i}/2"))
            assert status == 0, err
        registry = tmp_path / "registry" / "baselines.json"
        assert not registry.exists() or "part-" not in registry.read_text()  # a part's τ is not the drafter's
        part0 = json.loads((tmp_path / "runs" / "part-0" / "config.json").read_text())
        assert [t["id"] for t in part0["tasks"]["tasks"]] == ["he-0", "he-2", "he-4"]  # tasks 0, 2, 4 of 6
        merge = ["eval", "cache", "merge", "--cache", tmp_path / "cache", "--tasks", trained.tasks, "--num-tasks", TASKS]
        status, out, err = run_cli(capsys, *merge, tmp_path / "part-0")
        assert status == 2 and err.count("\n") == 1 and "PARTS: 3 of 6 tasks are in no part" in err
        status, out, err = run_cli(capsys, *merge, tmp_path / "part-0", tmp_path / "part-0")
        assert status == 2 and "each task belongs to one part" in err
        shutil.copytree(tmp_path / "part-1", tmp_path / "relabelled")  # its tokens' seal holds
        [file] = (tmp_path / "relabelled" / "references").glob("references-*.json")
        file.write_text(file.read_text().replace('"task": "he-1"', '"task": "he-3"'))
        status, out, err = run_cli(capsys, *merge, tmp_path / "part-0", tmp_path / "relabelled")
        assert status == 2 and "are not labelled with its key's tasks in order (task edited)" in err
        assert not (tmp_path / "cache").exists()
        status, out, err = run_cli(capsys, *merge, tmp_path / "part-1", tmp_path / "part-0")
        assert status == 0 and f"merged {TASKS} tasks from 2 parts" in out, err
        status, _, err = run_cli(capsys, *merge, tmp_path / "part-1", tmp_path / "part-0")
        assert status == 2 and "already holds the merged cache" in err

        status, _, err = run_cli(capsys, *_run(trained, tmp_path, "whole", tmp_path / "cache"))
        assert status == 0, err
        status, _, err = run_cli(capsys, *_run(trained, tmp_path, "own", tmp_path / "own-cache"))
        assert status == 0, err
    whole = json.loads((tmp_path / "runs" / "whole" / "config.json").read_text())
    own = json.loads((tmp_path / "runs" / "own" / "config.json").read_text())
    assert whole["features"]["reused"] is True and whole["references"]["reused"] is True  # no target forward
    assert whole["features"]["built_by"] == "merge of part-0, part-1"
    assert own["features"]["reused"] is False and whole["features"]["key"] == own["features"]["key"]
    assert whole["features"]["health"] == own["features"]["health"]
    summaries = [json.loads((tmp_path / "runs" / name / "summary.json").read_text())["drafters"][0]["methods"]
                 for name in ("whole", "own")]
    assert summaries[0] == summaries[1]
