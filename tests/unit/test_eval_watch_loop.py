"""The watch's loop on a clock and a poll of its own, no sleeping and no scoring: which checkpoints it takes, in
which order, what it skips, when it calls one corrupt, and that it stops once idle. Scoring itself is the
integration test's (tests/integration/test_eval_watch.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console

from dfserve.deploy.profiles import load_profile
from dfserve.eval.records import Figure
from dfserve.eval.runner import EvalPlan
from dfserve.eval.trend import TrendBaseline
from dfserve.eval.verdict import DEFAULT_EVAL_GATE
from dfserve.eval.watch import Watcher, WatchPlan
from dfserve.eval.watch_discovery import Ready, Seen
from dfserve.eval.watch_state import entry, read_state
from dfserve.tasks import TaskSet


def _plan(root: Path, every: bool) -> WatchPlan:
    settings = EvalPlan(
        target="t", drafters=(), profile=load_profile("pro6000"), drafter_config=None, tasks=TaskSet("x", ()),
        num_tasks=1, max_new_tokens=8, block_size=None, ddtree_budgets=(), prompt_format="chat", thinking=False,
        reference="local", dtype="float32", anchors_per_forward=1, cache=root / "cache", features=None,
        store=root / "store", registry=root / "registry", out=root / "runs", name=None, gate=DEFAULT_EVAL_GATE)
    return WatchPlan(checkpoints=root / "ckpt", out=root / "watch", eval=settings, baseline="zlab",
                     every_checkpoint=every, poll_s=1.0, stop_after_idle_s=3.0)


class Scripted(Watcher):
    """A watcher whose polls are scripted (one list of candidates per poll) and whose scoring only records."""

    def __init__(self, plan: WatchPlan, polls: list[list[Seen]]) -> None:
        self.now, self.lines, self.scoring = 0.0, [], []
        super().__init__(plan, Console(quiet=True), self.lines.append, clock=lambda: self.now,
                         sleep=self._sleep, poll=lambda _: polls.pop(0) if polls else self.last)
        self.last: list[Seen] = []

    def _sleep(self, seconds: float) -> None:
        self.now += seconds

    def _ensure_baseline(self) -> None:
        baseline = TrendBaseline(run_id="baseline", run_dir="runs/baseline", drafter="zlab", identity="zlab",
                                 tau={"vanilla": Figure(estimate=6.0, low=5.8, high=6.2, n=100)}, accuracy=[0.9])
        self.state = self.state.model_copy(update={"baseline": baseline})

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
