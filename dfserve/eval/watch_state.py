"""watch.json: what the watch did with each checkpoint, written atomically after every change, so a watch killed at
any point and started again scores no checkpoint twice and resumes where it stopped.

A checkpoint is `started` (its run folder named) before it is scored and `scored` once its run finished; a
restarted watch adopts a started run that finished (the kill came between the two writes) and scores again under
a new name one that did not, leaving the partial run folder as it was. `corrupt` ones are tried again only when
their bytes change; `skipped` ones never.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dfserve.errors import FieldError, describe_invalid
from dfserve.eval.trend import TrendBaseline, TrendPoint
from dfserve.runs import utc_now_iso

STATE = "watch.json"
Status = Literal["started", "scored", "corrupt", "skipped"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CheckpointEntry(_Model):
    key: str = Field(description="path relative to the checkpoint folder")
    step: int | None
    status: Status
    run_id: str | None = Field(description="the eval run scoring it (started, scored)")
    attempt: int = Field(1, ge=1, description="runs started for it; more than 1 after a watch was killed mid-run")
    size: int
    mtime_ns: int
    detail: str | None = Field(None, description="why it is corrupt, or what it was skipped for")
    point: TrendPoint | None = Field(None, description="its place in the trend, once scored")
    at: str


class WatchState(_Model):
    schema_version: Literal[1] = 1
    kind: Literal["eval-watch-state"] = "eval-watch-state"
    settings: dict[str, str] = Field(default_factory=dict, description="what every run of this watch shares")
    checkpoints: dict[str, CheckpointEntry] = Field(default_factory=dict)
    baseline: TrendBaseline | None = Field(None, description="the baseline, scored once for the whole watch")

    def with_entry(self, entry: CheckpointEntry) -> WatchState:
        return self.model_copy(update={"checkpoints": {**self.checkpoints, entry.key: entry}})

    def of(self, status: Status) -> list[CheckpointEntry]:
        return [e for e in self.checkpoints.values() if e.status == status]


def entry(key: str, step: int | None, status: Status, fingerprint: tuple[int, int], run_id: str | None = None,
          attempt: int = 1, detail: str | None = None) -> CheckpointEntry:
    size, mtime_ns = fingerprint
    return CheckpointEntry(key=key, step=step, status=status, run_id=run_id, attempt=attempt, size=size,
                           mtime_ns=mtime_ns, detail=detail, at=utc_now_iso())


def read_state(folder: Path) -> WatchState:
    path = folder / STATE
    try:
        return WatchState.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return WatchState()
    except ValidationError as exc:
        raise FieldError("out", describe_invalid(exc, str(path))) from None


def write_state(folder: Path, state: WatchState) -> None:
    replace_atomic(folder / STATE, state.model_dump_json(indent=2) + "\n")


def replace_atomic(path: Path, data: str) -> None:
    """The watch's own files (watch.json, trend.json, report.html) change with every checkpoint: each version is
    written whole beside the last and renamed over it, so a reader or a kill never sees half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
