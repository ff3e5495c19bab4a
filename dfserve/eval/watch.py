"""`dfserve eval watch`: beside a trainer, score each checkpoint it saves against a baseline scored once, and keep
the trend (trend.json, report.html) and its projection up to date.

The watch folder holds `watch.json` (the state: what was done with each checkpoint), `staged/` (each checkpoint
hard-linked, or copied when asked, before it is scored: the trainer may rotate it away meanwhile), `runs/` (one
eval run per checkpoint, immutable, and the baseline's), `trend.json` and `report.html`. The checkpoint folder is
only ever read. Each poll lists the candidates (`watch_files.scan`); one unchanged over two polls that loads is
complete (`watch_discovery.Stability`, `watch_files.probe`), and is scored through `runner.run_eval` on the shared
feature cache::

    result = watch(plan, Console(stderr=True), print)

The eval entry points used: `runner.EvalPlan`, `runner.run_eval`, and `verdict.judge_offline` (pairing each
checkpoint's run with the baseline's by task).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from dfserve.errors import FieldError, UserError
from dfserve.eval.records import AnchorRecord, EvalConfig, EvalSummary
from dfserve.eval.runner import EvalPlan, run_eval
from dfserve.eval.trend import Passed, Trend, TrendBaseline, TrendPoint, build_trend, scored
from dfserve.eval.trend_report import render_trend_html
from dfserve.eval.verdict import judge_offline, judged_against_itself
from dfserve.eval.watch_discovery import Ready, Seen, Stability, choose, step_from_name
from dfserve.eval.watch_files import Gone, Incomplete, StageMode, probe, scan, stage
from dfserve.eval.watch_push import push_trend
from dfserve.eval.watch_state import (
    CheckpointEntry,
    WatchState,
    entry,
    read_state,
    replace_atomic,
    write_state,
)
from dfserve.runs import read_jsonl, read_model

BASELINE_RUN = "baseline"
TREND = "trend.json"
REPORT = "report.html"
_ATTEMPT = re.compile(r"-attempt\d+$")


@dataclass(frozen=True)
class WatchPlan:
    checkpoints: Path
    out: Path
    eval: EvalPlan
    """The settings of every run; its drafters, out and name are the watch's to set."""
    baseline: str
    """zlab, baseline (the registry's), a folder or a checkpoint: scored once."""
    every_checkpoint: bool = False
    poll_s: float = 30.0
    stop_after_idle_s: float | None = None
    """Stop once nothing new has appeared for this long (None: watch until stopped)."""
    stage: StageMode = "link"
    pushgateway: str | None = None
    name: str = "watch"
    """The watch's name in the Pushgateway's grouping key and the report's title."""

    def settings(self) -> dict[str, str]:
        """What every run of one watch must share; a restart under other settings is refused. The drafter config
        and the profile (whose z-lab config stands in for a missing one) build every checkpoint's drafter: by
        content, as an edited file is another setting under the same name."""
        e = self.eval
        if e.drafter_config is None:
            drafter_config = "none"
        else:
            try:
                drafter_config = hashlib.sha256(e.drafter_config.read_bytes()).hexdigest()
            except OSError as exc:
                raise FieldError("drafter_config", f"cannot read {e.drafter_config} ({exc.strerror})") from None
        profile = hashlib.sha256(e.profile.model_dump_json().encode()).hexdigest()
        return {"checkpoints": str(self.checkpoints.resolve()), "baseline": self.baseline, "target": e.target,
                "tasks": e.tasks.sha256, "num_tasks": str(e.num_tasks), "max_new_tokens": str(e.max_new_tokens),
                "block_size": str(e.block_size), "ddtree_budgets": ",".join(map(str, e.ddtree_budgets)),
                "prompt_format": e.prompt_format, "thinking": str(e.thinking), "reference": e.reference,
                "dtype": e.dtype, "gate": e.gate.model_dump_json(), "drafter_config": drafter_config,
                "profile": f"{e.profile.name} {profile}"}


class _BaselineItself(Exception):
    """A checkpoint holding the baseline's own weights (a fine-tune saves them as its first step): scored, on the
    trend's list of skipped ones, never judged, as it would pass any gate at exactly 0%."""


@dataclass
class WatchResult:
    scored: list[str] = field(default_factory=list)
    """Checkpoint keys scored by this watch, in order."""
    trend: Trend | None = None


class Watcher:
    """One watch's loop; the clock, the sleep and the poll are injectable, so its decisions are testable alone."""

    def __init__(self, plan: WatchPlan, console: Console, log: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 poll: Callable[[Path], list[Seen]] = scan) -> None:
        """`console`: the eval runs' progress; `log`: one line per thing the watch did (scored, skipped, corrupt)."""
        self.plan, self.console, self.log, self.clock, self.sleep, self.poll = plan, console, log, clock, sleep, poll
        self.runs = plan.out / "runs"
        self.stability = Stability()
        self.failed: dict[str, tuple[int, int]] = {}
        """Candidates that failed to load once, at this fingerprint: corrupt if they fail again unchanged."""
        self.waiting: set[str] = set()
        """Candidates still being written (a sharded folder short of a file): reported once, then waited for."""
        self.result = WatchResult()
        self.state = WatchState()

    def run(self) -> WatchResult:
        self.plan.out.mkdir(parents=True, exist_ok=True)
        self.runs.mkdir(exist_ok=True)
        self.state = self._checked(read_state(self.plan.out))
        self._ensure_baseline()
        self._resume()
        idle_since = self.clock()
        while True:
            seen = self.poll(self.plan.checkpoints)
            ready = self.stability.observe(seen)
            if self._step(ready) or len(ready) < len(seen):
                idle_since = self.clock()
            elif self.plan.stop_after_idle_s is not None and self.clock() - idle_since >= self.plan.stop_after_idle_s:
                return self.result
            self.sleep(self.plan.poll_s)

    def _checked(self, state: WatchState) -> WatchState:
        wanted = self.plan.settings()
        if state.settings and state.settings != wanted:
            differ = [k for k in wanted if state.settings.get(k) != wanted[k]]
            raise FieldError("out", f"{self.plan.out} holds a watch started under other settings ({', '.join(differ)}"
                             "); use another folder")
        return state.model_copy(update={"settings": wanted})

    def _save(self, new: CheckpointEntry | None = None) -> None:
        if new is not None:
            self.state = self.state.with_entry(new)
        write_state(self.plan.out, self.state)

    def _resume(self) -> None:
        """A run started before a kill: adopted when it finished, else scored again under the next attempt's name."""
        for started in self.state.of("started"):
            if started.run_id is None or started.step is None:
                raise FieldError("out", f"{self.plan.out / 'watch.json'}: {started.key} is started without a run "
                                 "or a step; the file was edited")
            summary_path = self.runs / started.run_id / "summary.json"
            summary = read_model(summary_path, EvalSummary, "") if summary_path.is_file() else None
            if summary is not None and not summary.interrupted:
                self._finish(started, started.run_id)
                self.log(f"resumed: {started.key} (step {started.step}) had finished scoring")
            else:
                self.log(f"resumed: {started.key} (step {started.step}) was cut short in run "
                                   f"{started.run_id}; it is scored again")
        self._save()
        if any(e.point is not None for e in self.state.checkpoints.values()):
            self._publish()

    def _ensure_baseline(self) -> None:
        """The baseline's run, made once; one cut short by a kill stays as it was and the next attempt is named
        after it."""
        if self.state.baseline is not None:
            return
        attempt = 1
        while True:
            run_id = BASELINE_RUN + (f"-attempt{attempt}" if attempt > 1 else "")
            run_dir = self.runs / run_id
            if not run_dir.exists():
                self.log(f"scoring the baseline {self.plan.baseline} once")
                self._eval(((None, self.plan.baseline),), run_id)
            if (run_dir / "summary.json").is_file():
                break
            attempt += 1
        config, summary = _read_run(run_dir)
        baseline = TrendBaseline(drafter=self.plan.baseline, identity=config.drafters[0].identity,
                                 **scored(config.run_id, str(run_dir.resolve()), summary.drafters[0]))
        self.state = self.state.model_copy(update={"baseline": baseline})
        self._save()

    def _eval(self, drafters: tuple[tuple[str | None, str], ...], run_id: str) -> None:
        plan = dataclasses.replace(self.plan.eval, drafters=drafters, out=self.runs, name=run_id)
        outcome = run_eval(plan, self.console)
        if outcome.summary.interrupted:
            raise KeyboardInterrupt

    def _step(self, ready: list[Seen]) -> bool:
        """Score what the poll found complete; True when anything was done."""
        candidates: dict[str, tuple[Ready, Seen]] = {}
        probed: set[str] = set()
        for seen in ready:
            known = self.state.checkpoints.get(seen.key)
            if (known is not None and known.status in ("scored", "skipped")
                    and not seen.folder  # a folder grows (optimizer state)
                    and (known.size, known.mtime_ns) != seen.fingerprint):
                self._replaced(known)
                known = None
            if known is not None and (known.status in ("scored", "skipped") or (
                    known.status == "corrupt" and (known.size, known.mtime_ns) == seen.fingerprint)):
                continue
            step = step_from_name(seen.key)
            if step is None:
                if (step := self._probe(seen)) is None:
                    continue
                probed.add(seen.key)
            candidates[seen.key] = (Ready(seen.key, step), seen)
        pending = [r for r, _ in candidates.values()]
        acted = False
        while pending:
            chosen, skipped = choose(pending, set(), self.plan.every_checkpoint)
            first, seen = candidates[chosen[0].key]
            pending.remove(first)
            if first.key not in probed and self._probe(seen) is None:
                acted = acted or first.key not in self.waiting  # one only waited for is nothing new
                continue  # reported; the next one is chosen instead
            acted = True
            for passed in skipped:
                pending.remove(passed)
                self._save(entry(passed.key, passed.step, "skipped", candidates[passed.key][1].fingerprint,
                                 detail=f"step {first.step} arrived before it was scored"))
                self.log(f"skipped: {passed.key} (step {passed.step}): step {first.step} arrived first")
            self._score(first, seen)
        return acted

    def _replaced(self, known: CheckpointEntry) -> None:
        """A checkpoint scored or skipped that the trainer saved over (`latest.pt`): its point or its place on the
        skipped list stays, kept under the run that scored it (or its step), and the new bytes are a checkpoint of
        their own."""
        kept = known.model_copy(update={"key": f"{known.key}@{known.run_id or f'step-{known.step}'}"})
        others = {key: e for key, e in self.state.checkpoints.items() if key != known.key}
        self.state = self.state.model_copy(update={"checkpoints": {**others, kept.key: kept}})
        self._save()
        self.log(f"replaced: {known.key} (step {known.step}) was saved over; its new bytes are a new checkpoint")

    def _probe(self, seen: Seen) -> int | None:
        """The step of a loadable candidate (its name's, else the one stored in it); None when it does not load or
        has no step anywhere. One that fails twice unchanged is corrupt: reported in one line, recorded, and tried
        again only when its bytes change (a trainer paused mid-write fails once, then grows). One still being written
        is waited for; one removed meanwhile is reported gone."""
        try:
            stored = probe(self.plan.checkpoints / seen.key).step
        except Incomplete as exc:
            if seen.key not in self.waiting:
                self.log(f"waiting: {seen.key}: {exc.message}")
            self.waiting.add(seen.key)
            return None
        except Gone as exc:
            self.log(f"gone: {seen.key}: {exc.message}")
            return None
        except FieldError as exc:
            if self.failed.get(seen.key) == seen.fingerprint:
                self._corrupt(seen, step_from_name(seen.key), exc.message)
            self.failed[seen.key] = seen.fingerprint
            return None
        self.failed.pop(seen.key, None)
        self.waiting.discard(seen.key)
        step = step_from_name(seen.key)
        if step is None and stored is None:
            self._corrupt(seen, None, "no step in its name nor in the checkpoint (step, global_step)")
        return step if step is not None else stored

    def _corrupt(self, seen: Seen, step: int | None, detail: str) -> None:
        self._save(entry(seen.key, step, "corrupt", seen.fingerprint, detail=detail))
        self.log(f"corrupt: {seen.key}: {detail}")
        self._publish()  # the trend lists it

    def _name(self, ready: Ready) -> str:
        """The checkpoint's run and staged name: `step-N`, unless another checkpoint of step N holds it
        (`step_15/ema.pt` beside `step_15/checkpoint.pt`), then `step-N-` and a hash of its key, and a count after it
        where that is held too (one file saved over at one step again and again). watch.json keeps who holds which,
        so a restart names each the same."""
        known = self.state.checkpoints.get(ready.key)
        if known is not None and known.run_id is not None:
            return _ATTEMPT.sub("", known.run_id)
        name = f"step-{ready.step:09d}"
        held = {_ATTEMPT.sub("", e.run_id) for e in self.state.checkpoints.values() if e.run_id is not None}
        if name not in held:
            return name
        hashed = f"{name}-{hashlib.sha256(ready.key.encode()).hexdigest()[:8]}"
        return next(n for n in itertools.chain([hashed], (f"{hashed}-{i}" for i in itertools.count(2)))
                    if n not in held)

    def _score(self, ready: Ready, seen: Seen) -> None:
        known = self.state.checkpoints.get(ready.key)
        attempt = known.attempt + 1 if known is not None and known.status == "started" else 1
        name = self._name(ready)
        run_id = name + (f"-attempt{attempt}" if attempt > 1 else "")
        source = self.plan.checkpoints / ready.key
        try:
            staged = stage(source, self.plan.out / "staged" / f"{name}{'' if seen.folder else source.suffix}",
                           self.plan.stage)
        except Gone as exc:  # rotated away while another was scored: nothing to score
            self.log(f"gone: {ready.key} (step {ready.step}): {exc.message}")
            return
        started = entry(ready.key, ready.step, "started", seen.fingerprint, run_id=run_id, attempt=attempt)
        self._save(started)
        try:
            self._eval(((f"step-{ready.step}", str(staged)),), run_id)
        except UserError as exc:
            self._corrupt(seen, ready.step, str(exc))
            return
        except Exception as exc:  # a checkpoint no check foresaw must not stop the watch, at every restart
            self._corrupt(seen, ready.step, f"scoring failed ({type(exc).__name__}: {str(exc)[:300]})")
            return
        self._finish(started, run_id)

    def _finish(self, started: CheckpointEntry, run_id: str) -> None:
        """Its run paired with the baseline's into the trend; a run that cannot be (another feature cache: its
        drafter taps other layers) marks the checkpoint corrupt, as at every restart it would stop the watch."""
        try:
            point = self._point(started, self.runs / run_id)
        except FieldError as exc:
            self._save(started.model_copy(update={"status": "corrupt", "detail": exc.message}))
            self.log(f"corrupt: {started.key}: {exc.message}")
            self._publish()
            return
        except _BaselineItself as exc:
            self._save(started.model_copy(update={"status": "skipped", "detail": str(exc)}))
            self.log(f"skipped: {started.key} (step {started.step}): {exc}")
            self._publish()
            return
        self._save(started.model_copy(update={"status": "scored", "point": point}))
        self.result.scored.append(started.key)
        trend = self._publish()
        line = ", ".join(f"τ {m} {point.tau[m].estimate:.3f}" for m in trend.methods)
        projection = trend.projections[trend.methods[0]]
        self.log(f"scored: {started.key} (step {point.step}): {line}; vs baseline "
                           f"{point.judgement.verdict}; projection: {projection.outcome} ({projection.detail})")

    def _point(self, started: CheckpointEntry, run_dir: Path) -> TrendPoint:
        assert self.state.baseline is not None and started.step is not None
        base_dir = Path(self.state.baseline.run_dir)
        base_config, base_records = _read_records(base_dir)
        config, records = _read_records(run_dir)
        if problems := base_config.comparable_with(config):
            raise FieldError("out", f"its run {run_dir.name} cannot be paired with the baseline's run {base_dir.name}: "
                             + "; ".join(problems))
        base_label, label = base_config.drafters[0].label, config.drafters[0].label
        if why := judged_against_itself("the baseline", base_config.drafters[0], "this checkpoint",
                                        config.drafters[0]):
            raise _BaselineItself(why)
        judgement = judge_offline(base_label, base_records, label, records, [t.id for t in base_config.tasks.tasks],
                                  config.methods(), self.plan.eval.gate)
        _, summary = _read_run(run_dir)
        return TrendPoint(step=started.step, checkpoint=started.key, judgement=judgement,
                          **scored(run_id=config.run_id, run_dir=str(run_dir.resolve()),
                                   drafter=summary.drafters[0]))

    def _publish(self) -> Trend:
        assert self.state.baseline is not None
        entries = self.state.checkpoints.values()
        trend = build_trend(
            self.plan.eval.methods(), self.state.baseline, [e.point for e in entries if e.point is not None],
            [Passed(checkpoint=e.key, step=e.step, detail=e.detail or "") for e in entries if e.status == "skipped"],
            [Passed(checkpoint=e.key, step=e.step, detail=e.detail or "") for e in entries if e.status == "corrupt"])
        replace_atomic(self.plan.out / TREND, trend.model_dump_json(indent=2) + "\n")
        replace_atomic(self.plan.out / REPORT, render_trend_html(trend, self.plan.name))
        self.result.trend = trend
        if self.plan.pushgateway:
            try:
                push_trend(self.plan.pushgateway, self.plan.name, trend)
            except FieldError as exc:  # the watch goes on; the next checkpoint pushes the whole trend again
                self.log(f"warning: {exc.message}")
        return trend


def _read_run(run_dir: Path) -> tuple[EvalConfig, EvalSummary]:
    return (read_model(run_dir / "config.json", EvalConfig, f"{run_dir}: not an evaluation run (no config.json)"),
            read_model(run_dir / "summary.json", EvalSummary, f"{run_dir}: no summary.json (the run did not finish)"))


def _read_records(run_dir: Path) -> tuple[EvalConfig, list[AnchorRecord]]:
    config, _ = _read_run(run_dir)
    label = config.drafters[0].label
    return config, [r for r in read_jsonl(run_dir / "anchors.jsonl", AnchorRecord, "an anchor record")
                    if r.drafter == label]


def watch(plan: WatchPlan, console: Console, log: Callable[[str], None]) -> WatchResult:
    return Watcher(plan, console, log).run()
