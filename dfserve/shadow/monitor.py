"""Deciding the gate on live traffic (`shadow.until_decided`): the sequential design of `dfserve.verdict.sequential`
on the mirrored pairs as the recorder writes them. Once every rule is decided the gateway stops mirroring (clients
stay on the primary), the record folder gets its decision (decision.json) and is closed, complete and judgeable,
and nothing mirrors again until the gateway is restarted, which starts a new decision in a new folder.

Which pairs a look sees. The gateway numbers every client request in the order it read it (`request_id`); only
mirrored ones are recorded, and exchanges finish out of order. A look sees the complete prefix of request ids: the
pairs of every request up to the last one whose fate is known in full, taken in request-id order. A request's fate
is known once its client's exchange has come (it names the arms it was mirrored to, `Exchanged.mirrors`) and, if it
was mirrored to the candidate, once the recorder has written its records (together, when every arm's exchange has
come). It is then a pair (both records in the folder being decided, neither cancelled by the client or the
gateway's stop) or it is not (never mirrored, its records not written), and which it is never depends on what the
answers were. A mirror that failed is a pair whose candidate failed: it counts towards `error_rate`, it is not left
out, and so is one the gateway skipped because the candidate's arm was down (`Exchanged.skipped`).

Why not pairs in the order they finish: at any moment the requests still in flight are the slow ones, so every
look would favour short answers, and a rule on E2E or acceptance would be decided on a biased sample (the load
tester's looks take the schedule's complete prefix for the same reason). The id order is fixed when the request is
read, before any outcome, so the prefix is the traffic's own sample and each pair enters it once, at its place.
The looks are therefore a pure function of a folder's pairs in id order, and `dfserve compare` replays them from
requests.jsonl (`judge_live`), finding the gateway's decision at the same look, or refusing the folder.

The decision is the first record folder's (a folder holds one baseline and is judged alone): one closed
undecided (full, or a new primary) gives it up, since each folder decided afresh would be another chance at a
PASS for a candidate no better than the baseline; the gateway writes why it gave up into it (`GivenUp`), and
compare judges it after the fact with the same design (forced where its records replay to a decision the gateway
never took), and later folders, which carry no design, as fixed-size samples. The live decision never
decides what `dfserve compare` would refuse unforced: it is given up, said once (state `abandoned`; mirroring and
recording go on), when the open folder becomes incomplete (a mirror the gateway's own concurrency limit refused; an
exchange dropped behind a full queue, whose request the recorder writes without it `max_pending` requests later),
when its arms are not comparable (the candidate on the primary's drafter or another target, an engine that could
not be asked, a secondary arm that is no noise floor), when a request is never written at all (once twice the
recorder's `max_pending` requests wait behind it), and when recording stops at `max_folders`. Live traffic has no finite task set (a task is a distinct request body), so no rule is ever limited by one;
greedy and sampled requests may mix, so determinism is read pair by pair (`greedy_held`): losslessness is judged
on the greedy pairs, the other metrics as for sampled requests once one pair is not greedy. A greedy request may
come at any time, so a gate with an identical-output rule passes only once that rule has judged greedy pairs
(traffic that never asks for temperature 0 is decided by `dfserve compare` when its folder closes, or by a gate
without the rule).

    decider = DecidingRecorder(recorder, LiveDecision(design, "inhouse", max_pending=10_000), metrics, stop)
    gateway.observers.add("shadow", decider)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dfserve.gateway.observers import Exchanged
from dfserve.loadtest.judge import METRICS, TIMED
from dfserve.loadtest.records import RequestRecord
from dfserve.metrics import ShadowDecisionMetrics
from dfserve.runs import write_model
from dfserve.shadow import arms
from dfserve.shadow.recorder import ShadowRecorder, ShadowRunConfig
from dfserve.shadow.records import greedy_held
from dfserve.verdict.design import Outcome, SequentialDesign
from dfserve.verdict.gate import Gate
from dfserve.verdict.pairs import Pairs
from dfserve.verdict.sequential import Look, Monitor, Sequential

log = logging.getLogger("dfserve.gateway")

LIVE_TASKS = 1 << 62
"""The task set of live traffic: unbounded, so no census decides a lossless rule and none is limited by the set."""
DECISION = "decision.json"
GIVEN_UP = "decision-given-up.json"
State = Literal["deciding", "pass", "fail", "abandoned"]


class Decided(BaseModel):
    """decision.json: what the gateway decided on a folder, written before its summary; `dfserve compare` replays
    the folder's records and refuses it unless they give the same."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["shadow-decision"] = "shadow-decision"
    verdict: Literal["PASS", "FAIL"]
    look: int = Field(description="the look that decided, from 1")
    pairs: int = Field(description="mirrored pairs in the prefix at that look")
    last_request_id: int = Field(description="the request id of the prefix's last pair")
    candidate: str
    design: SequentialDesign


class GivenUp(BaseModel):
    """decision-given-up.json: why the gateway stopped deciding on the folder it was deciding (its design in
    config.json). Its records may replay to a decision the gateway never took, on pairs that may leave out the
    requests then in flight (the slowest): `dfserve compare` names why, and judges such a folder only forced."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["shadow-decision-given-up"] = "shadow-decision-given-up"
    why: str
    candidate: str
    design: SequentialDesign


def judge_live(pairs: Pairs[RequestRecord], design: SequentialDesign, gate: Gate) -> Outcome:
    """A folder's verdict with its looks replayed as the gateway took them: its pairs in request-id order."""
    ordered = Pairs(pairs.names, tuple(range(len(pairs))), pairs.task_ids, pairs.base, pairs.cand,
                    pairs.deterministic, pairs.greedy)
    outcome = Sequential(design, LIVE_TASKS, deterministic_pair=greedy_held, started_deterministic=True,
                         awaits_greedy=True).judge(ordered, METRICS, gate)
    assert outcome.sequential is not None
    return Outcome(outcome.judgement, outcome.sequential.model_copy(update={"live": True}))


def live_monitor(design: SequentialDesign) -> Monitor[RequestRecord]:
    return Monitor(design, METRICS, True, LIVE_TASKS, deterministic_pair=greedy_held, awaits_greedy=True)


@dataclass
class _Request:
    primary: str | None = None
    """The arm of the client's exchange, once it has come."""
    mirrored: bool = False
    recorded: bool = False
    """The recorder wrote its records (all at once, or what it had when it let the request go)."""
    records: dict[str, tuple[RequestRecord, Path]] = field(default_factory=dict)

    @property
    def known(self) -> bool:
        return self.recorded or (self.primary is not None and not self.mirrored)


class LiveDecision:
    """The decision's state, pure: each exchange (`seen`) and each record written (`written`) in, the folder being
    decided's monitor fed the complete prefix of request ids."""

    def __init__(self, design: SequentialDesign, candidate: str, max_pending: int) -> None:
        self.design = design
        self.candidate = candidate
        self.max_pending = max_pending
        self.state: State = "deciding"
        self.folder: Path | None = None
        self.monitor: Monitor[RequestRecord] | None = None
        self.decision: Decided | None = None
        self.last_request_id = -1
        self.gave_up: str | None = None
        """Why the decision was given up (state `abandoned`)."""
        self._primary = ""
        self._next = 0
        self._requests: dict[int, _Request] = {}

    @property
    def pairs(self) -> int:
        return self.monitor.pairs if self.monitor is not None else 0

    def written(self, record: RequestRecord, folder: Path, primary: str) -> None:
        """A record the recorder wrote into `folder` (whose baseline is `primary`). The decision is the first
        folder's: one written into the next gives it up."""
        if self.state != "deciding":
            return
        if folder != self.folder:
            if self.folder is not None:
                return  # the decision's folder was closed undecided: the deciding recorder gives it up
            self.folder, self._primary = folder, primary
            self.monitor = live_monitor(self.design) if primary != self.candidate else None
        if record.client_bound and any(rule.metric in TIMED for rule in self.design.gate.rules):
            self.abandon(f"request {record.index} was read at a slow client's pace (client_bound): which pairs a "
                         "slow client holds up depends on the baseline's speed, so latency rules are not decided live")
            return
        if record.index >= self._next:
            request = self._requests.setdefault(record.index, _Request())
            request.recorded = True
            if record.arm in (primary, self.candidate):
                request.records[record.arm] = (record, folder)

    def seen(self, exchanged: Exchanged) -> Look | None:
        """One exchange, after the recorder took it (and wrote its request's records, if it completed them); the look
        that decided, if this one completed it."""
        if self.state != "deciding" or exchanged.request_id < self._next:
            return None
        if not exchanged.mirror:
            request = self._requests.setdefault(exchanged.request_id, _Request())
            request.primary = exchanged.outcome.arm
            request.mirrored = self.candidate in exchanged.mirrors or self.candidate in exchanged.skipped
        while (first := self._requests.get(self._next)) is not None and first.known:
            del self._requests[self._next]
            look = self._take(self._next, first)
            self._next += 1
            if look is not None:
                return look
        if len(self._requests) > self.max_pending:
            self.abandon(f"request {self._next} was never recorded and {self.max_pending} later ones wait behind it")
        return None

    def abandon(self, why: str) -> None:
        """Give the decision up, for `why`."""
        self.state, self.gave_up = "abandoned", why
        self._requests.clear()

    def _take(self, request_id: int, request: _Request) -> Look | None:
        monitor, folder = self.monitor, self.folder
        base, cand = request.records.get(self._primary), request.records.get(self.candidate)
        if (monitor is None or request.primary != self._primary or base is None or cand is None
                or base[1] != folder or cand[1] != folder or base[0].cancelled or cand[0].cancelled):
            return None
        monitor.offer(0, monitor.pairs, base[0].task_id, base[0])
        monitor.offer(1, monitor.pairs, cand[0].task_id, cand[0])
        self.last_request_id = request_id
        look = monitor.decision
        if look is None or look.stop != "decided" or look.verdict not in ("PASS", "FAIL"):
            return None
        self.decision = Decided(verdict="PASS" if look.verdict == "PASS" else "FAIL", look=look.number,
                                pairs=look.pairs, last_request_id=request_id, candidate=self.candidate,
                                design=self.design)
        self.state = "pass" if look.verdict == "PASS" else "fail"
        self._requests.clear()
        return look


class DecidingRecorder:
    """The gateway's `shadow` observer when it decides as it records: the recorder writes, the decision follows
    on the same thread; once decided, the folder is closed with its decision and `stop_mirroring` is called (it
    hands the switch to the event loop)."""

    def __init__(self, recorder: ShadowRecorder, decision: LiveDecision, metrics: ShadowDecisionMetrics,
                 stop_mirroring: Callable[[], None]) -> None:
        self.recorder = recorder
        self.decision = decision
        self.metrics = metrics
        self.stop_mirroring = stop_mirroring
        recorder.on_record = decision.written
        metrics.set_state("deciding")
        self._checked = ""
        self._differ: list[str] = []
        self._said = False

    def observe(self, exchanged: Exchanged) -> None:
        self.recorder.observe(exchanged)
        decision = self.decision
        if decision.state == "deciding":
            folder = self.recorder.folder
            if folder is None:
                decision.abandon("recording stopped (shadow.max_folders) before the gate was decided")
            elif (first := self.recorder.first_folder) is not None and folder[0].run_id != first.name:
                decision.abandon(f"record folder {first.name} was closed before the gate was decided "
                                 "(shadow.records_per_folder or folder_bytes, or a new primary), and deciding afresh "
                                 "on the next would be another chance at a PASS")
            elif (why := self._untrusted(*folder)) is not None:
                decision.abandon(why)
            elif (look := decision.seen(exchanged)) is not None:
                self.metrics.pairs.set(decision.pairs)
                self._decided(look)
                return
            self.metrics.pairs.set(decision.pairs)
        if decision.state == "abandoned" and not self._said:
            self._say_given_up()

    def _say_given_up(self) -> None:
        """Once: the metric, one log line, and decision-given-up.json in the folder the decision was on (the first,
        which holds its design), where it was opened."""
        self._said = True
        why = self.decision.gave_up or ""
        self.metrics.set_state("abandoned")
        folder = self.recorder.first_folder
        if folder is not None:
            with contextlib.suppress(OSError):  # unwritable: compare names the decision missing instead
                write_model(folder / GIVEN_UP, GivenUp(why=why, candidate=self.decision.candidate,
                                                       design=self.decision.design))
        log.error("shadow.until_decided: %s; the live decision is given up, mirroring and recording go on, and "
                  "dfserve compare judges each folder", why)

    def _untrusted(self, config: ShadowRunConfig, incomplete: bool) -> str | None:
        """Why the open folder cannot be decided on, as `dfserve compare` would refuse it unforced; each folder's
        arms are read once."""
        if incomplete:
            return (f"record folder {config.run_id} is incomplete (a mirror the gateway's own limit refused, or a "
                    "request written without all its records), so the pairs kept are not the traffic's sample")
        if config.primary == self.decision.candidate:
            return None  # such a folder decides nothing
        if config.run_id != self._checked:
            self._checked = config.run_id
            self._differ = arms.mismatches(config, config.primary, self.decision.candidate)
            if config.secondary is not None:
                self._differ += arms.floor_mismatches(config, config.primary, config.secondary)
        return "arms are not comparable (" + "; ".join(self._differ) + ")" if self._differ else None

    def _decided(self, look: Look) -> None:
        decision = self.decision
        assert decision.decision is not None and decision.folder is not None
        self.stop_mirroring()
        write_model(decision.folder / DECISION, decision.decision)
        self.recorder.close()
        self.metrics.set_state(decision.state)
        rules = "; ".join(f"{r.metric} {r.status}" for r in look.rules)
        log.warning("shadow decided: %s at look %d after %d mirrored pairs (%s); mirroring stopped, clients stay on "
                    "the primary, and a restart starts a new decision; record folder complete: %s",
                    look.verdict, look.number, look.pairs, rules, decision.folder)

    def flush(self) -> None:
        self.recorder.flush()

    def close(self) -> None:
        if self.decision.state == "deciding":  # said before the folder's summary is written, as a decision is
            self.decision.abandon("the gateway stopped before the gate was decided")
            self._say_given_up()
        self.recorder.close()
