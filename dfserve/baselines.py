"""The baseline registry: which drafter is the current baseline for each target, with every change kept.

One small JSON file beside the runs (`baselines.json`), rewritten atomically (temp file, fsync, rename) under an
exclusive lock, so readers never see half a file and two promotions cannot interleave. Entries are only appended:
the current baseline of a target is its latest entry, and the history is the list. `dfserve promote` appends;
`dfserve baseline show|history` and `dfserve deploy --drafter baseline` read. What may be promoted is decided
here (`promote_verdict`), not by a command. The same file keeps each drafter's
offline τ (`dfserve eval` appends), so `dfserve compare` can show it beside the online τ of the same drafter.

    registry = BaselineRegistry(Path("runs"))
    current = registry.current("Qwen/Qwen3.6-27B")
    offline = registry.offline(current.drafter)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import posixpath
import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dfserve.errors import FieldError, Untrusted, UserError
from dfserve.runs import read_model, utc_now_iso
from dfserve.verdict.verdict import Verdict

FILENAME = "baselines.json"
CONVERTED_DRAFTER = re.compile(r"inhouse-[0-9a-f]{16}")
"""How deploy names a converted drafter's folder: by a hash of its checkpoint's content and the config it was
converted with (deploy.convert)."""


def drafter_identity(drafter: str) -> str:
    """What names one drafter on every machine: a converted in-house drafter by its content-hash folder name, any
    other drafter (a Hugging Face id, a folder) as given, in one spelling of its path (`/models/d/`, `/models//d`
    and `/models/./d` are `/models/d`: two engines given one folder in two spellings serve one drafter)."""
    path = posixpath.normpath(drafter) if drafter else drafter
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    name = PurePath(path).name
    return name if CONVERTED_DRAFTER.fullmatch(name) else path


def one_drafter(base: str, candidate: str) -> list[str]:
    """One line when both sides serve one drafter (as their engines name it): a verdict on them judges the
    baseline's drafter against itself, and says nothing of a candidate."""
    if drafter_identity(base) != drafter_identity(candidate):
        return []
    return [f"both sides serve drafter {base!r}: the candidate would be judged against the baseline's own drafter"]


class BaselineEntry(BaseModel):
    """One change of a target's baseline."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(description="the target model the drafter serves")
    drafter: str = Field(description="drafter identity: HF id or checkpoint path, as the engine reported it")
    run_id: str
    arm: str
    verdict: str | None = Field(None, description="path of the verdict.json that justified it; None for the first")
    verdict_sha256: str | None = Field(None, description="content hash of that verdict.json: a verdict promotes once")
    recorded_at: str
    forced: bool = False
    reason: str | None = None


class OfflineScore(BaseModel):
    """A drafter's offline τ from one `dfserve eval` run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str
    drafter: str = Field(description="the drafter's identity (see drafter_identity)")
    label: str
    run_id: str
    run_dir: str
    features: str = Field(description="key of the feature cache: scores on the same key are comparable")
    tasks: int
    rounds: int
    tau: float = Field(description="Σ tokens / Σ rounds along the online trajectory (z-lab's counting)")
    tau_low: float
    tau_high: float
    tau_as_sglang: float = Field(description="with each task's first token counted, as SGLang's accept length is")
    ddtree: dict[str, float] = Field(default_factory=dict, description="τ per DDTree method (ddtree8: budget 8)")
    recorded_at: str


class Registry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    entries: list[BaselineEntry] = Field(default_factory=list)
    offline: list[OfflineScore] = Field(default_factory=list)


class BaselineRegistry:
    def __init__(self, directory: Path) -> None:
        self.path = directory / FILENAME
        self._held = False

    def read(self) -> Registry:
        if not self.path.exists():
            return Registry()
        return read_model(self.path, Registry, f"{self.path} vanished")

    def current(self, target: str) -> BaselineEntry | None:
        return next((e for e in reversed(self.read().entries) if e.target == target), None)

    def history(self, target: str | None = None) -> list[BaselineEntry]:
        return [e for e in self.read().entries if target is None or e.target == target]

    def append(self, *entries: BaselineEntry) -> None:
        with self.locked():
            registry = self.read()
            registry.entries.extend(entries)
            self._write(registry)

    def record_offline(self, *scores: OfflineScore) -> None:
        with self.locked():
            registry = self.read()
            registry.offline.extend(scores)
            self._write(registry)

    def offline(self, drafter: str) -> OfflineScore | None:
        """The latest offline score of a drafter, found by its identity (a path or the name of its folder)."""
        wanted = drafter_identity(drafter)
        return next((s for s in reversed(self.read().offline) if s.drafter == wanted), None)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The registry held against every other process for a read, a check and a write that must be one step:
        two promotions at once must not both pass their checks. Reentrant within this object."""
        if self._held:
            yield
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._held = True
            try:
                yield
            finally:
                self._held = False

    def _write(self, registry: Registry) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{FILENAME}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(registry.model_dump_json(indent=2) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def entry(target: str, drafter: str, run_id: str, arm: str, verdict: str | None = None, *, forced: bool = False,
          reason: str | None = None, verdict_sha256: str | None = None) -> BaselineEntry:
    return BaselineEntry(target=target, drafter=drafter, run_id=run_id, arm=arm, verdict=verdict,
                         verdict_sha256=verdict_sha256, recorded_at=utc_now_iso(), forced=forced, reason=reason)


@dataclass(frozen=True)
class Promotion:
    candidate: BaselineEntry
    refusals: list[str]
    """What `force` overrode; empty for a promotion on its own merits."""


def refusals(registry: BaselineRegistry, verdict: Verdict, unfounded: Sequence[str] = ()) -> list[str]:
    """Why this verdict may not promote its candidate unless forced; empty when it may. `unfounded`: why it is not
    what its runs give (`loadtest.verdict.unfounded`)."""
    found = list(unfounded)
    if verdict.verdict != "PASS":
        found.append(f"the verdict is {verdict.verdict}, only PASS promotes")
    if verdict.baseline.simulated or verdict.candidate.simulated:
        found.append("the verdict is of simulated engines: its figures rehearse the workflow, they judge no drafter")
    if verdict.forced:
        past = verdict.mismatches + verdict.incomplete
        found.append("the verdict was forced past " + "; ".join(past) if past else
                     "the verdict says it was forced, past nothing it names")
    current = registry.current(verdict.baseline.target)
    if current is not None and drafter_identity(current.drafter) != drafter_identity(verdict.baseline.drafter):
        found.append(f"the verdict's baseline {verdict.baseline.drafter!r} is not the current baseline "
                     f"{current.drafter!r}")
    return found


def promote_verdict(registry: BaselineRegistry, verdict: Verdict, file: Path, *, force: bool = False,
                    reason: str | None = None, unfounded: Sequence[str] = ()) -> Promotion:
    """Record the candidate of an online verdict as its target's baseline (the first promotion of a target
    records its baseline first). Refused always: an offline verdict, one that judged a run or a drafter against
    itself, and one promoted before; unless `force` with a `reason` (recorded, and more than blanks): anything `refusals` names."""
    if force and not (reason and reason.strip()):
        raise FieldError("force", "give {other} TEXT; it is recorded with the promotion", other="reason")
    if verdict.source != "loadtest":
        raise UserError(f"{file}: an offline verdict screens drafters and promotes none; an online one "
                        "(dfserve compare) does")
    base, cand = verdict.baseline, verdict.candidate
    if base.run_id == cand.run_id and (base.name == cand.name or base.run_dir != cand.run_dir):
        raise UserError(f"{file}: the verdict judged run {base.run_id} against itself; it promotes nothing")
    if same := one_drafter(base.drafter, cand.drafter):
        raise UserError(f"{file}: {same[0]}; it promotes nothing")
    digest = hashlib.sha256(verdict.model_dump_json().encode()).hexdigest()  # of its content, however laid out
    raw = hashlib.sha256(file.read_bytes()).hexdigest()  # what promotions recorded before the content's hash
    with registry.locked():
        history = registry.history()
        before = next((e for e in history if e.verdict == str(file) or e.verdict_sha256 in (digest, raw)), None)
        if before is not None:
            raise UserError(f"{file}: this verdict was promoted on {before.recorded_at}; a verdict promotes once")
        promoted = next((e for e in history if e.verdict is not None and (e.run_id, e.arm) == (cand.run_id, cand.name)),
                        None)
        if promoted is not None:
            raise UserError(f"{file}: arm {cand.name} of run {cand.run_id} was promoted on {promoted.recorded_at} "
                            f"(by {promoted.verdict}); a run's arm promotes once, whatever verdict names it")
        refused = refusals(registry, verdict, unfounded)
        if refused and not force:
            raise Untrusted("promote: " + "; ".join(refused))
        new = []
        if registry.current(base.target) is None:
            new.append(entry(base.target, base.drafter, base.run_id, base.name,
                             reason="baseline of the first promotion"))
        new.append(entry(cand.target, cand.drafter, cand.run_id, cand.name, str(file), forced=bool(refused),
                         reason=reason if refused else None, verdict_sha256=digest))
        registry.append(*new)
    return Promotion(new[-1], refused)
