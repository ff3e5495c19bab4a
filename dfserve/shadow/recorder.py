"""The gateway's shadow records: an observer that writes each mirrored request's answers into record folders in the
load tester's format (config.json, requests.jsonl of `RequestRecord`s, summary.json once the folder is complete).

A folder holds up to `records_per_folder` records or `folder_bytes` of them; then it is closed (its summary
written: complete, and judgeable by `dfserve compare` while recording goes on) and the next one is opened. At most
`max_folders` are written: then recording stops, logged once, rather than deleting a folder a verdict may be
reading. The records of a batch of exchanges (what the observer's thread took from its queue at once) are written
in one write at `flush`.

Only requests that were mirrored are recorded (a client's exchange names the arms it was mirrored to; one pinned
to an arm by `x-dfserve-arm`, or sent after mirroring stopped, is no pair and does not rotate the folder). A
request's records wait, as records, until its primary's and every mirror's have come, and are then written
together, so a rotation never splits a request between two folders (one whose primary stops being the folder's
while it waits, a routing change, is written nowhere). A request still waiting `max_pending` requests later (or
past `max_pending` waiting) is written with the records it has: its other exchanges were lost, or are that slow.
That is logged once per folder, and the folder's summary says `interrupted`: a verdict on it is refused unless
forced. A request still waiting when recording ends (the gateway's stop) is written nowhere.

    gateway:
      mode: shadow
      shadow: {dir: /var/lib/dfserve/shadow, secondary: baseline-2}
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from dfserve import sglang
from dfserve.deploy.hashes import file_sha256
from dfserve.gateway.observers import Exchanged
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.report import Summary, summarize_arm
from dfserve.metrics import GATEWAY_OVERLOADED, GATEWAY_STOPPED
from dfserve.runs import JsonlAppender, Provenance, create_run_dir, write_model
from dfserve.sglang import parse_server_info
from dfserve.shadow.policy import ShadowPolicy
from dfserve.shadow.records import RequestTask, rebased, shadow_record, skipped_record
from dfserve.verdict.design import SequentialDesign

log = logging.getLogger("dfserve.gateway")


class ShadowArm(BaseModel):
    """One arm as its first replica described itself when the folder was opened (SGLang's `/server_info`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    url: str
    server_info: dict[str, Any] | None = Field(description="verbatim; None when it could not be read")


class ShadowRunConfig(BaseModel):
    """config.json of a shadow record folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    kind: Literal["shadow-run"] = "shadow-run"
    run_id: str
    primary: str = Field(description="the arm whose answers clients got: the baseline")
    secondary: str | None = Field(description="the noise-floor arm, running the baseline's drafter")
    sequence: int = Field(description="this folder's place among the recorder's folders, from 0")
    arms: dict[str, ShadowArm] = Field(default_factory=dict, description="the engines behind each arm: their "
                                       "target and drafter name the verdict's sides")
    t0_unix_s: float = Field(description="wall clock at the folder's time zero; record times are offsets from it")
    provenance: Provenance
    sequential: SequentialDesign | None = Field(None, description="set when the gateway decides the gate on this "
                                                "folder's pairs as they are recorded (`shadow.monitor`)")
    decides: str | None = Field(None, description="with sequential: the mirrored arm the live decision judges")


SERVER_INFO_TIMEOUT_S = 2.0


def server_info(url: str) -> dict[str, Any] | None:
    """A replica's `/server_info`, or None (said in the log) when it cannot be had: the verdict then names the arm
    only."""
    try:
        response = httpx.get(url.rstrip("/") + "/server_info", timeout=SERVER_INFO_TIMEOUT_S)
        response.raise_for_status()
        info = sglang.printable_json(response.json())  # written into the folder's config.json
    except (httpx.HTTPError, ValueError, RecursionError) as exc:
        log.warning("shadow records: %s/server_info could not be read (%s); the verdict will not name its drafter",
                    url, exc)
        return None
    return info if isinstance(info, dict) else None


class _Folder:
    def __init__(self, policy: ShadowPolicy, primary: str, sequence: int, arms: Mapping[str, str],
                 deciding: tuple[SequentialDesign, str] | None) -> None:
        self.path = create_run_dir(policy.dir, prefix="shadow")
        self.t0_perf_s, t0_unix_s = time.perf_counter(), time.time()  # read together: the arms' /server_info take time
        self.config = ShadowRunConfig(run_id=self.path.name, primary=primary, secondary=policy.secondary,
                                      sequence=sequence, arms={name: ShadowArm(url=url, server_info=server_info(url))
                                                               for name, url in arms.items()},
                                      t0_unix_s=t0_unix_s, provenance=Provenance.here(),
                                      sequential=deciding[0] if deciding else None,
                                      decides=deciding[1] if deciding else None)
        write_model(self.path / "config.json", self.config)
        self.simulated = {name: arm.server_info is not None and parse_server_info(arm.server_info).simulated
                          for name, arm in self.config.arms.items()}
        """Each arm whose engine said it is dfserve's simulator: its records say so, as the load tester's do."""
        self.appender = JsonlAppender(self.path / "requests.jsonl")
        self.records: list[RequestRecord] = []
        self.bytes = 0
        self.pending: list[str] = []
        self.unpaired = 0
        """Requests written without all their records (let go past `max_pending`): the folder is then incomplete."""
        self.cut_by_stop = 0
        """Records of exchanges the gateway's stop cut short: the folder is then incomplete (the slowest answers of
        an arm are those cut, and judging the rest would favour it)."""
        self.refused = 0
        """Records of requests the gateway's own concurrency limit refused: the folder is then incomplete (a slow
        arm's are refused when it is busiest, and judging the pairs it had room for would favour it)."""

    @property
    def incomplete(self) -> bool:
        """Its summary will say `interrupted`: a verdict on it is refused unless forced."""
        return self.unpaired + self.cut_by_stop + self.refused > 0

    def write(self, record: RequestRecord) -> None:
        """Held until `flush`: a batch of records is one write."""
        self.cut_by_stop += record.error_message == GATEWAY_STOPPED
        self.refused += record.error_message == GATEWAY_OVERLOADED
        line = record.model_dump_json() + "\n"
        self.pending.append(line)
        self.records.append(record)
        self.bytes += len(line)

    def flush(self) -> None:
        if self.pending:
            lines, self.pending = self.pending, []
            self.appender.write_lines(lines)

    def close(self) -> None:
        """Its summary written, complete; a folder that holds no record is removed instead (opened when the last
        one filled, or at the start, and no mirrored request came after): nothing to judge, and not a run to list."""
        self.flush()
        self.appender.close()
        if not self.records:
            shutil.rmtree(self.path, ignore_errors=True)  # what cannot be removed stays, unsealed: never judged
            return
        arms = dict.fromkeys(r.arm for r in self.records)
        summary = Summary(run_id=self.config.run_id, interrupted=self.incomplete,
                          arms=tuple(summarize_arm(arm, [r for r in self.records if r.arm == arm]) for arm in arms),
                          records_sha256=file_sha256(self.path / "requests.jsonl"),
                          config_sha256=file_sha256(self.path / "config.json")).sealed()
        write_model(self.path / "summary.json", summary)


@dataclass
class _Request:
    """One request's records so far, by arm: (`mirror`, record, the time zero it was timed from). `arms` and
    `primary` are known once its primary's exchange, which names its mirrors, has come."""

    records: dict[str, tuple[bool, RequestRecord, float]] = field(default_factory=dict)
    arms: frozenset[str] | None = None
    primary: str | None = None
    task: RequestTask | None = None
    """Read from the first exchange's body; every arm was sent the same."""

    @property
    def complete(self) -> bool:
        return self.arms is not None and self.arms <= self.records.keys()


class ShadowRecorder:
    """A gateway observer (`observe`, `flush`, `close`) writing shadow record folders under `policy.dir`."""

    def __init__(self, policy: ShadowPolicy, primary: str, arms: Mapping[str, str] | None = None,
                 deciding: tuple[SequentialDesign, str] | None = None) -> None:
        """`arms`: each arm's first replica, asked for its `/server_info` as each folder is opened. `deciding`: the
        live decision's design and candidate, written into the first folder's config.json (the one decided live)."""
        self.policy = policy
        self.arms = dict(arms or {})
        self.deciding = deciding
        self.on_record: Callable[[RequestRecord, Path, str], None] | None = None
        """Told of each record written, with its folder and the folder's primary (`shadow.monitor`)."""
        self.folders = 0
        self._folder: _Folder | None = self._open(primary)
        self.first_folder = self._folder.path if self._folder is not None else None
        """The first folder, which carries the live decision's design (`deciding`)."""
        self._waiting: OrderedDict[int, _Request] = OrderedDict()
        self._let_go: OrderedDict[int, None] = OrderedDict()
        """Requests written without all their records: an exchange of theirs that comes after is not recorded."""

    @property
    def stopped(self) -> bool:
        """Recording has stopped (`max_folders`, or closed)."""
        return self._folder is None

    @property
    def folder(self) -> tuple[ShadowRunConfig, bool] | None:
        """The open folder's config.json, and whether it is incomplete already (`_Folder.incomplete`)."""
        return (self._folder.config, self._folder.incomplete) if self._folder is not None else None

    def _open(self, primary: str) -> _Folder | None:
        if self.folders >= self.policy.max_folders:
            log.error("shadow.max_folders: %d record folders written under %s; recording stops",
                      self.policy.max_folders, self.policy.dir)
            return None
        self.folders += 1
        # the live decision is the first folder's (`shadow.monitor`): later ones are judged after the fact
        return _Folder(self.policy, primary, self.folders - 1, self.arms, self.deciding if self.folders == 1 else None)

    def observe(self, exchanged: Exchanged) -> None:
        rid, arm = exchanged.request_id, exchanged.outcome.arm
        if not exchanged.mirror and not exchanged.mirrors and not exchanged.skipped:
            return  # not mirrored (pinned to an arm, mirroring stopped): no pair
        if not exchanged.mirror and self._folder is not None and arm != self._folder.config.primary:
            self._rotate(arm)  # the routing changed: a folder has one baseline
        folder = self._folder
        if folder is None or rid in self._let_go:
            return  # recording has stopped, or the request was written without this exchange
        request = self._waiting.get(rid)
        if request is None:
            request = self._waiting[rid] = _Request()
        task = request.task = request.task or RequestTask.of(exchanged)
        if arm not in request.records:  # an arm's second exchange for one request is not a record
            # the record, not the exchange, waits: a native stream's answer is its whole output
            request.records[arm] = (exchanged.mirror, shadow_record(exchanged, folder.t0_perf_s, task,
                                                                    folder.simulated.get(arm, False)),
                                    folder.t0_perf_s)
        if not exchanged.mirror and request.primary is None:
            request.arms, request.primary = frozenset((arm, *exchanged.mirrors, *exchanged.skipped)), arm
            for down in exchanged.skipped:  # its failure, not a hole: a down arm's hours are part of its record
                request.records[down] = (True, skipped_record(exchanged, down, folder.t0_perf_s, task,
                                                              folder.simulated.get(down, False)), folder.t0_perf_s)
        if request.complete:
            del self._waiting[rid]
            self._write_request(request)
        self._let_go_before(rid - self.policy.max_pending)

    def _let_go_before(self, oldest: int) -> None:
        """Write without their missing records the requests that wait behind `max_pending` later ones, or past
        `max_pending` waiting: the exchanges they wait for were lost (or are that slow)."""
        while self._waiting:
            rid = next(iter(self._waiting))
            if rid >= oldest and len(self._waiting) <= self.policy.max_pending:
                return
            request = self._waiting.pop(rid)
            self._let_go[rid] = None
            while len(self._let_go) > self.policy.max_pending:
                self._let_go.popitem(last=False)
            folder = self._folder
            if folder is None or request.primary not in (None, folder.config.primary):
                continue
            if not folder.unpaired:
                log.error("shadow.max_pending: request %d's records never all came (an exchange lost behind the "
                          "recorder's queue, or slower than %d later requests); it is written without them, and "
                          "record folder %s is incomplete", rid, self.policy.max_pending, folder.path)
            folder.unpaired += 1
            self._write_request(request)

    def _write_request(self, request: _Request) -> None:
        """A request's records, its primary's first, into the open folder; the folder rotates only after them. One
        whose primary is not the folder's (the routing changed while it waited) belongs to no folder."""
        folder = self._folder
        if folder is None or request.primary not in (None, folder.config.primary):
            return
        bound = any(record.client_bound for _, record, _ in request.records.values())
        for _, record, t0_perf_s in sorted(request.records.values(), key=lambda made: made[0]):
            # a pair is timed on both sides or neither: the mirror's times beside the slow client's would flatter it
            self._write(record.model_copy(update={"client_bound": True}) if bound else record, t0_perf_s)
        if len(folder.records) >= self.policy.records_per_folder or folder.bytes >= self.policy.folder_bytes:
            self._rotate(folder.config.primary)

    def _write(self, record: RequestRecord, t0_perf_s: float) -> None:
        """`record`, its times from `t0_perf_s`, into the open folder (from its time zero, if another opened since)."""
        folder = self._folder
        if folder is None:
            return
        if t0_perf_s != folder.t0_perf_s:
            record = rebased(record, folder.t0_perf_s - t0_perf_s)
        folder.write(record)
        if self.on_record is not None:
            self.on_record(record, folder.path, folder.config.primary)

    def _rotate(self, primary: str) -> None:
        if self._folder is not None:
            self._folder.close()
            self._folder = self._open(primary)

    def flush(self) -> None:
        """Write the records of the batch just observed (the gateway's observer thread calls it after each)."""
        if self._folder is not None:
            self._folder.flush()

    def close(self) -> None:
        if self._folder is not None:
            self._folder.close()
            self._folder = None


def complete(path: Path) -> bool:
    """A record folder whose summary is written: closed, nothing more will be added."""
    return (path / "summary.json").exists()

