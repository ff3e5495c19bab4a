"""The watch's loop on a clock and a poll of its own, no sleeping and no scoring: which checkpoints it takes, in
which order, what it skips, when it calls one corrupt or waits for one, what it stages and names each run, and
that it stops once idle. Scoring itself is the integration test's (tests/integration/test_eval_watch.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import SupportsIndex

import pytest
import torch
from rich.console import Console
from safetensors.torch import save_file

from dfserve.deploy.profiles import load_profile
from dfserve.errors import FieldError
from dfserve.eval.records import Figure
from dfserve.eval.runner import EvalPlan
from dfserve.eval.trend import TrendBaseline, TrendPoint
from dfserve.eval.verdict import DEFAULT_EVAL_GATE
from dfserve.eval.watch import Watcher, WatchPlan
from dfserve.eval.watch_discovery import Ready, Seen
from dfserve.eval.watch_files import scan
from dfserve.eval.watch_state import CheckpointEntry, entry, read_state
from dfserve.tasks import TaskSet


def _plan(root: Path, every: bool, drafter_config: Path | None = None, profile: str = "pro6000") -> WatchPlan:
    settings = EvalPlan(
        target="t", drafters=(), profile=load_profile(profile), drafter_config=drafter_config, tasks=TaskSet("x", ()),
        num_tasks=1, max_new_tokens=8, block_size=None, ddtree_budgets=(), prompt_format="chat", thinking=False,
        reference="local", dtype="float32", anchors_per_forward=1, cache=root / "cache", features=None,
        store=root / "store", registry=root / "registry", out=root / "runs", name=None, gate=DEFAULT_EVAL_GATE)
    return WatchPlan(checkpoints=root / "ckpt", out=root / "watch", eval=settings, baseline="zlab",
                     every_checkpoint=every, poll_s=1.0, stop_after_idle_s=3.0)


def _baseline(watcher: Watcher) -> None:
    baseline = TrendBaseline(run_id="baseline", run_dir="runs/baseline", drafter="zlab", identity="zlab",
                             tau={"vanilla": Figure(estimate=6.0, low=5.8, high=6.2, n=100)}, accuracy=[0.9])
    watcher.state = watcher.state.model_copy(update={"baseline": baseline})


class Scripted(Watcher):
    """A watcher whose polls are scripted (one list of candidates per poll) and whose scoring only records."""

    def __init__(self, plan: WatchPlan, polls: list[list[Seen]]) -> None:
        self.now, self.lines, self.scoring = 0.0, [], []
        super().__init__(plan, Console(quiet=True), self.lines.append, clock=lambda: self.now,
                         sleep=self._sleep, poll=lambda _: polls.pop(0) if polls else self.last)
        self.last: list[Seen] = []

    def _sleep(self, seconds: float) -> None:
        self.now += seconds

    _ensure_baseline = _baseline

    def _score(self, ready: Ready, seen: Seen) -> None:
        self.scoring.append(ready.step)
        self._save(entry(ready.key, ready.step, "scored", seen.fingerprint, run_id=f"step-{ready.step}"))


def _checkpoint(root: Path, key: str, step: int | None = None, corrupt: bool = False) -> Seen:
    path = root / "ckpt" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"w": torch.ones(2)}, **({"step": step} if step is not None else {})}, path)
    if corrupt:
        path.write_bytes(path.read_bytes()[:50])
    return Seen(key, False, path.stat().st_size, path.stat().st_mtime_ns)


def test_newest_first_skips_what_piled_up_and_scores_a_late_one_when_it_lands(tmp_path: Path) -> None:
    a, b, c = (_checkpoint(tmp_path, f"step_{s}/checkpoint.pt") for s in (100, 200, 300))
    d = _checkpoint(tmp_path, "latest.pt", step=400)  # no step in the name: read from the checkpoint
    watcher = Scripted(_plan(tmp_path, every=False), [[a, b, c], [a, b, c], [a, b, c, d], [a, b, c, d]])
    result = watcher.run()
    assert watcher.scoring == [300, 400] and result.scored == []  # the scripted scoring reports nothing itself
    state = read_state(tmp_path / "watch")
    assert {k: e.status for k, e in state.checkpoints.items()} == {
        "step_100/checkpoint.pt": "skipped", "step_200/checkpoint.pt": "skipped", "step_300/checkpoint.pt": "scored",
        "latest.pt": "scored"}
    assert watcher.lines == ["skipped: step_100/checkpoint.pt (step 100): step 300 arrived first",
                             "skipped: step_200/checkpoint.pt (step 200): step 300 arrived first"]
    assert watcher.now >= 3.0  # stopped once idle, on its own clock


def test_every_checkpoint_in_step_order_and_a_file_that_never_loads_is_corrupt_once(tmp_path: Path) -> None:
    bad = _checkpoint(tmp_path, "step_50/checkpoint.pt", corrupt=True)
    a, b = _checkpoint(tmp_path, "step_200/checkpoint.pt"), _checkpoint(tmp_path, "step_100/checkpoint.pt")
    watcher = Scripted(_plan(tmp_path, every=True), [[bad, a, b]] * 6)
    watcher.run()
    assert watcher.scoring == [100, 200]
    corrupt = [line for line in watcher.lines if line.startswith("corrupt:")]
    assert len(corrupt) == 1 and corrupt[0].startswith("corrupt: step_50/checkpoint.pt: ")
    assert read_state(tmp_path / "watch").checkpoints["step_50/checkpoint.pt"].status == "corrupt"
    trend = json.loads((tmp_path / "watch" / "trend.json").read_text())
    assert [c["checkpoint"] for c in trend["corrupt"]] == ["step_50/checkpoint.pt"]


def test_a_restarted_watch_scores_nothing_it_scored_before(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path, "step_100/checkpoint.pt")
    first = Scripted(_plan(tmp_path, every=True), [[a], [a]])
    first.run()
    again = Scripted(_plan(tmp_path, every=True), [[a], [a], [a]])
    again.run()
    assert first.scoring == [100] and again.scoring == []


class Staging(Watcher):
    """A watcher on a real checkpoint folder (scan, probe and staging as they are) whose eval only records the run
    name and the staged checkpoint it was given, after `check` had a look (raising as a run would, or acting as
    the trainer meanwhile); `trainer(n)` acts on the folder before poll n."""

    def __init__(self, plan: WatchPlan, trainer: Callable[[int], None] = lambda _: None,
                 check: Callable[[Path], None] = lambda _: None) -> None:
        self.now, self.polls, self.lines, self.evals = 0.0, 0, [], []
        self.trainer, self.check = trainer, check
        super().__init__(plan, Console(quiet=True), self.lines.append, clock=lambda: self.now, sleep=self._sleep,
                         poll=self._poll)

    def _poll(self, root: Path) -> list[Seen]:
        self.trainer(self.polls)
        self.polls += 1
        return scan(root)

    def _sleep(self, seconds: float) -> None:
        assert self.now < 60, "the watch never went idle"
        self.now += seconds

    _ensure_baseline = _baseline

    def _eval(self, drafters: tuple[tuple[str | None, str], ...], run_id: str) -> None:
        staged = Path(drafters[0][1])
        self.evals.append((run_id, staged))
        self.check(staged)

    def _finish(self, started: CheckpointEntry, run_id: str) -> None:
        self._save(started.model_copy(update={"status": "scored"}))


def _no_nan(staged: Path) -> None:
    weights = torch.load(staged, weights_only=True)["model"]["w"]
    if nan := int(weights.isnan().sum()):
        raise FieldError("drafter", f"{staged}: model.w has {nan} NaN")


def test_a_checkpoint_called_corrupt_then_replaced_is_scored_from_its_new_bytes_after_a_restart(
        tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "step_20" / "checkpoint.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model": {"w": torch.tensor([1.0, float("nan")])}}, path)
    first = Staging(_plan(tmp_path, every=True), check=_no_nan)
    first.run()
    assert [line for line in first.lines if line.startswith("corrupt:")] == [
        f"corrupt: step_20/checkpoint.pt: drafter: {first.evals[0][1]}: model.w has 1 NaN"]
    tmp = path.with_name("checkpoint.pt.tmp")  # the trainer replaces it the way trainers publish: a rename
    torch.save({"model": {"w": torch.ones(2)}}, tmp)
    tmp.rename(path)
    again = Staging(_plan(tmp_path, every=True), check=_no_nan)
    again.run()
    assert [line for line in again.lines if line.startswith("corrupt:")] == []
    assert [run for run, _ in again.evals] == ["step-000000020"] and again.evals[0][1].samefile(path)
    assert read_state(tmp_path / "watch").checkpoints["step_20/checkpoint.pt"].status == "scored"


def test_a_scored_file_the_trainer_saves_over_is_scored_again_and_its_first_point_stays(tmp_path: Path) -> None:
    """`latest.pt`, step 100 then step 200 renamed over it: the second was never scored."""
    first = _checkpoint(tmp_path, "latest.pt", step=100)
    path = tmp_path / "ckpt" / "latest.pt"
    second = Seen("latest.pt", False, first.size, first.mtime_ns + 1)

    class Saving(list[list[Seen]]):
        def pop(self, index: SupportsIndex = -1) -> list[Seen]:
            if len(self) == 2:  # the third poll: step 100 was scored, the trainer saves step 200 over it
                torch.save({"model": {"w": torch.ones(2)}, "step": 200}, path.with_name("latest.pt.tmp"))
                path.with_name("latest.pt.tmp").rename(path)
            return super().pop(index)

    watcher = Scripted(_plan(tmp_path, every=False), Saving([[first], [first], [second], [second]]))
    watcher.run()
    assert watcher.scoring == [100, 200]
    assert "replaced: latest.pt (step 100) was saved over; its new bytes are a new checkpoint" in watcher.lines
    state = read_state(tmp_path / "watch").checkpoints
    assert {key: (e.key, e.step, e.status) for key, e in state.items()} == {
        "latest.pt@step-100": ("latest.pt@step-100", 100, "scored"), "latest.pt": ("latest.pt", 200, "scored")}


def test_a_skipped_file_saved_over_is_scored_and_one_saved_over_at_one_step_again_gets_a_name_of_its_own(
        tmp_path: Path) -> None:
    """A fine-tune's first `latest.pt` holds the baseline's weights (skipped, never judged); its next save was never
    scored. Saved over at one step three times, the third run's name was the second's."""
    seen = _checkpoint(tmp_path, "latest.pt", step=100)
    (tmp_path / "watch").mkdir()
    watcher = Scripted(_plan(tmp_path, every=False), [[seen], [seen]])
    watcher._save(entry("latest.pt", 0, "skipped", (1, 1), run_id="step-000000000", detail="the baseline's own"))
    watcher.run()
    assert watcher.scoring == [100]
    state = read_state(tmp_path / "watch").checkpoints
    assert (state["latest.pt@step-000000000"].status, state["latest.pt"].status) == ("skipped", "scored")
    hashed = "step-000000100-" + hashlib.sha256(b"latest.pt").hexdigest()[:8]
    for held in ("step-000000100", hashed):
        watcher._save(entry(f"latest.pt@{held}", 100, "scored", (1, 1), run_id=held))
    watcher.state = watcher.state.model_copy(update={"checkpoints": {
        k: e for k, e in watcher.state.checkpoints.items() if k != "latest.pt"}})
    assert watcher._name(Ready("latest.pt", 100)) == f"{hashed}-2"


def test_a_checkpoint_whose_scoring_fails_unforeseen_is_corrupt_and_the_watch_goes_on(tmp_path: Path) -> None:
    """An error no check named (a forward pass that fails, say) must not stop the watch at every restart."""
    _checkpoint(tmp_path, "step_10/checkpoint.pt")
    _checkpoint(tmp_path, "step_20/checkpoint.pt", step=20)

    def fails_first(staged: Path) -> None:
        if staged.name.startswith("step-000000010"):
            raise RuntimeError("shape '[1, 8, 3, 16]' is invalid")

    watch = Staging(_plan(tmp_path, every=True), check=fails_first)
    watch.run()
    assert [line for line in watch.lines if line.startswith("corrupt:")] == [
        "corrupt: step_10/checkpoint.pt: scoring failed (RuntimeError: shape '[1, 8, 3, 16]' is invalid)"]
    assert read_state(tmp_path / "watch").checkpoints["step_20/checkpoint.pt"].status == "scored"


class Unpaired(Staging):
    """Runs that cannot be paired with the baseline's (their drafter taps other layers: another feature cache)."""

    _finish = Watcher._finish

    def _point(self, started: CheckpointEntry, run_dir: Path) -> TrendPoint:
        raise FieldError("out", f"its run {run_dir.name} cannot be paired with the baseline's run baseline: "
                         "feature cache: fff5 vs 1221")


def test_a_run_that_cannot_be_paired_with_the_baselines_is_corrupt_and_the_watch_goes_on(tmp_path: Path) -> None:
    """It stopped the watch, and the restart's resume stopped it again, at every restart."""
    _checkpoint(tmp_path, "step_10/checkpoint.pt")
    _checkpoint(tmp_path, "step_20/checkpoint.pt")
    watch = Unpaired(_plan(tmp_path, every=True))
    watch.run()
    assert [line for line in watch.lines if line.startswith("corrupt:")] == [
        f"corrupt: step_{step}/checkpoint.pt: its run step-0000000{step} cannot be paired with the baseline's run "
        "baseline: feature cache: fff5 vs 1221" for step in (10, 20)]
    assert {e.status for e in read_state(tmp_path / "watch").checkpoints.values()} == {"corrupt"}


def test_two_checkpoints_of_one_step_get_their_own_names_and_keep_them_through_a_restart(tmp_path: Path) -> None:
    model, ema = _checkpoint(tmp_path, "step_15/checkpoint.pt"), _checkpoint(tmp_path, "step_15/ema.pt", step=15)
    second = f"step-000000015-{hashlib.sha256(ema.key.encode()).hexdigest()[:8]}"

    def killed_on_ema(staged: Path) -> None:
        if staged.samefile(tmp_path / "ckpt" / ema.key):
            raise KeyboardInterrupt

    first = Staging(_plan(tmp_path, every=True), check=killed_on_ema)
    with pytest.raises(KeyboardInterrupt):
        first.run()
    again = Staging(_plan(tmp_path, every=True))
    again.run()
    staged = tmp_path / "watch" / "staged"
    assert [(run, p.name) for run, p in first.evals + again.evals] == [
        ("step-000000015", "step-000000015.pt"), (second, f"{second}.pt"), (f"{second}-attempt2", f"{second}.pt")]
    assert (staged / "step-000000015.pt").samefile(tmp_path / "ckpt" / model.key)
    assert (staged / f"{second}.pt").samefile(tmp_path / "ckpt" / ema.key)
    assert {k: e.status for k, e in read_state(tmp_path / "watch").checkpoints.items()} == {
        model.key: "scored", ema.key: "scored"}
    assert not [line for line in first.lines + again.lines if line.startswith("corrupt:")]


def test_a_checkpoint_rotated_away_while_another_is_scored_is_reported_gone_and_the_watch_goes_on(
        tmp_path: Path) -> None:
    a, b = _checkpoint(tmp_path, "a.pt", step=1), _checkpoint(tmp_path, "b.pt", step=2)

    def rotate(staged: Path) -> None:
        (tmp_path / "ckpt" / b.key).unlink()

    watcher = Staging(_plan(tmp_path, every=True), check=rotate)
    watcher.run()
    assert [run for run, _ in watcher.evals] == ["step-000000001"]
    assert watcher.lines == [f"gone: b.pt (step 2): {tmp_path / 'ckpt' / 'b.pt'} was removed before it "
                             "was staged"]
    assert read_state(tmp_path / "watch").checkpoints[a.key].status == "scored"


def _shards(folder: Path, names: list[str], index: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    for i, name in enumerate(names):
        save_file({f"w{i}": torch.ones(2)}, str(folder / name))
    if index:
        weight_map = {f"w{i}": f"model-{i + 1:05d}-of-00002.safetensors" for i in range(2)}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_sharded_folder_is_waited_for_until_whole_and_one_that_never_is_stops_no_watch(tmp_path: Path) -> None:
    """checkpoint-40 gets its second shard and its index a while after the first; checkpoint-50's index names a
    shard that never comes."""
    one, two = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    ckpt = tmp_path / "ckpt"

    def trainer(poll: int) -> None:
        if poll == 0:
            _shards(ckpt / "checkpoint-40", [one], index=False)
            _shards(ckpt / "checkpoint-50", [one], index=True)
        if poll == 2:
            _shards(ckpt / "checkpoint-40", [two], index=True)

    watcher = Staging(_plan(tmp_path, every=True), trainer=trainer)
    watcher.run()
    assert watcher.lines == [
        f"waiting: checkpoint-40: {ckpt / 'checkpoint-40'} holds the shard {one} but no *.index.json yet",
        f"waiting: checkpoint-50: {ckpt / 'checkpoint-50'}: model.safetensors.index.json names {two}, not there yet"]
    assert [run for run, _ in watcher.evals] == ["step-000000040"]
    staged = watcher.evals[0][1]
    assert sorted(p.name for p in staged.iterdir()) == ["config.json", one, two, "model.safetensors.index.json"]
    assert {k: e.status for k, e in read_state(tmp_path / "watch").checkpoints.items()} == {"checkpoint-40": "scored"}


def test_a_restart_under_another_drafter_config_or_profile_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "drafter-config.json"
    config.write_text('{"hidden_size": 64}')
    Scripted(_plan(tmp_path, every=True, drafter_config=config), []).run()
    Scripted(_plan(tmp_path, every=True, drafter_config=config), []).run()  # the same: resumed
    config.write_text('{"hidden_size": 128}')  # edited under the same name
    with pytest.raises(FieldError, match=r"started under other settings \(drafter_config\)"):
        Scripted(_plan(tmp_path, every=True, drafter_config=config), []).run()
    config.write_text('{"hidden_size": 64}')
    with pytest.raises(FieldError, match=r"started under other settings \(profile\)"):
        Scripted(_plan(tmp_path, every=True, drafter_config=config, profile="cpu"), []).run()
    with pytest.raises(FieldError, match=r"started under other settings \(drafter_config\)"):
        Scripted(_plan(tmp_path, every=True), []).run()
    with pytest.raises(FieldError, match=r"cannot read .*missing\.json \(No such file or directory\)") as refused:
        Scripted(_plan(tmp_path, every=True, drafter_config=tmp_path / "missing.json"), []).run()
    assert refused.value.field == "drafter_config"
