"""The target-feature cache: the tap layers' outputs of one teacher-forced forward per task, stored once and reused by
every later drafter, keyed by everything they depend on.

A cache is a folder named by the hash of its key (the target's content, the reference tokens and their key, the
taps, the dtype, the torch and transformers versions), holding `build.json` (the key, the health figure, who built
it and when, the sha256 of each task file) and one safetensors file per task (`tap.<layer>` tensors, [tokens,
hidden]). It appears whole or not at all. A cache named explicitly (`features` field) whose key differs from this
run's is refused, naming what differs; it is never reused silently. The key says what the features were computed
from, not that the files still hold them: a file whose content no longer matches its recorded hash (a disk error,
an edit, a truncation) would be scored as if it were the target's, so every file is hashed again when the cache
is opened, once per run and before the run's folder exists, and a mismatch is refused::

    store = open_features(folder, key)            # refused when built under other settings
    context = store.context(task_index, taps=(1, 16, 31, 46, 61))
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import Tensor

from dfserve.deploy.hashes import file_sha256
from dfserve.errors import FieldError, describe_invalid
from dfserve.eval.records import Health
from dfserve.runs import staged_folder, write_model

BUILD = "build.json"
HEALTHY = 0.99
"""Below this share of agreeing positions the target does not reproduce its own reference: something is off."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FeatureKey(_Model):
    target_sha256: str
    target: str = Field(description="the target as given (informative; its content hash decides)")
    references_key: str = Field(description="hash of the reference key: tasks, prompts, template, limits, source")
    references_sha256: str = Field(description="hash of the reference token ids the target read")
    taps: tuple[int, ...]
    dtype: str
    versions: dict[str, str] = Field(description="torch and transformers: their numerics shape the features")

    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json(exclude={"target"}).encode()).hexdigest()


class FeatureBuild(_Model):
    schema_version: Literal[2] = Field(2, description="version 1 caches hold no content hashes: refused")
    kind: Literal["eval-features"] = "eval-features"
    key: FeatureKey
    tasks: tuple[str, ...]
    built_at: str
    built_by: str
    build_s: float
    health: Health
    files: dict[str, str] = Field(description="sha256 of each task file by name, checked whenever the cache is opened")


def health(agree: int, positions: int) -> Health:
    fraction = agree / positions if positions else 1.0
    warning = None
    if fraction < HEALTHY:
        warning = (f"the target's own greedy choice matches its reference at only {agree}/{positions} positions "
                   f"({fraction:.3f}, expected about 1.0): tokens, chat template, dtype or the reference's source "
                   "disagree with this target, so τ measured on these features is not what online decoding sees")
    return Health(agree=agree, positions=positions, fraction=fraction, warning=warning)


def features_path(cache: Path, key: FeatureKey) -> Path:
    return cache / "features" / f"features-{key.digest()[:16]}"


def _other_target(found: FeatureKey, target_sha256: str, target: str) -> str:
    return (f"it was built for target {found.target} (sha256 {found.target_sha256[:12]}), this run's target is "
            f"{target} (sha256 {target_sha256[:12]})")


def _refused(folder: Path, differences: list[str]) -> FieldError:
    return FieldError("features", f"{folder} was built under other settings: {'; '.join(differences)}; it is never "
                      "reused for this run")


def _differences(found: FeatureKey, wanted: FeatureKey) -> list[str]:
    if found.target_sha256 != wanted.target_sha256:
        return [_other_target(found, wanted.target_sha256, wanted.target)]
    mine, theirs = found.model_dump(), wanted.model_dump()
    return [f"{field} {mine[field]!r} vs this run's {theirs[field]!r}" for field in mine
            if field != "target" and mine[field] != theirs[field]]


@dataclass(frozen=True)
class FeatureStore:
    folder: Path
    build: FeatureBuild

    def context(self, task_index: int, taps: Sequence[int]) -> Tensor:
        """A task's features in a drafter's tap order, concatenated ([tokens, taps · hidden]), as z-lab's
        `extract_context_feature` builds them."""
        path = self.folder / _task_file(task_index)
        try:
            with safe_open(str(path), framework="pt") as handle:
                return torch.cat([handle.get_tensor(f"tap.{tap}") for tap in taps], dim=-1)
        except (SafetensorError, OSError) as exc:
            raise _damaged(path, f"it no longer reads as safetensors ({exc})") from None


def _damaged(path: Path, why: str) -> FieldError:
    return FieldError("features", f"{path}: {why}; a damaged or altered feature cache is never used (remove "
                      f"{path.parent} and a run rebuilds it)")


def _read_build(folder: Path) -> FeatureBuild:
    path = folder / BUILD
    try:
        data = path.read_bytes()
        return FeatureBuild.model_validate_json(data)
    except FileNotFoundError:
        raise FieldError("features", f"{folder} is not a feature cache (no {BUILD})") from None
    except ValidationError as exc:
        if _schema_version(data) == 1:
            raise _damaged(path, "built by an earlier dfserve that recorded no content hashes, so what it holds "
                           "cannot be verified") from None
        raise FieldError("features", describe_invalid(exc, str(path))) from None


def _schema_version(data: bytes) -> object:
    try:
        document = json.loads(data)
    except ValueError:
        return None
    return document.get("schema_version") if isinstance(document, dict) else None


def verify(folder: Path, build: FeatureBuild) -> None:
    """Every task file's content against the hash `build` recorded, and its header naming every tap: a `FieldError`
    naming the first file that differs."""
    names = [_task_file(i) for i in range(len(build.tasks))]
    if sorted(build.files) != names:
        raise _damaged(folder / BUILD, f"it records hashes of {len(build.files)} files for {len(names)} tasks")
    for name in names:
        path = folder / name
        try:
            digest = file_sha256(path)
        except OSError as exc:
            raise _damaged(path, f"cannot be read ({exc.strerror})") from None
        if digest != build.files[name]:
            raise _damaged(path, f"its content does not match the sha256 recorded in {BUILD} when the cache was "
                           "built")
        try:
            with safe_open(str(path), framework="pt") as handle:
                found = set(handle.keys())
        except SafetensorError as exc:
            raise _damaged(path, f"it does not read as safetensors ({exc})") from None
        if missing := [tap for tap in build.key.taps if f"tap.{tap}" not in found]:
            raise _damaged(path, f"it holds no features of taps {missing}")


def check_built_for(folder: Path, target_sha256: str, target: str) -> None:
    """Refuse a cache of another target before anything is computed for this one."""
    found = _read_build(folder).key
    if found.target_sha256 != target_sha256:
        raise _refused(folder, [_other_target(found, target_sha256, target)])


def open_features(folder: Path, key: FeatureKey) -> FeatureStore:
    """A cache folder built under exactly `key` whose files still hold what was written; any other is refused with
    what differs."""
    build = _read_build(folder)
    if differences := _differences(build.key, key):  # the same target's content at another path is the same target
        raise _refused(folder, differences)
    verify(folder, build)
    return FeatureStore(folder, build)


def _task_file(index: int) -> str:
    return f"task-{index:05d}.safetensors"


@contextmanager
def write_features(final: Path) -> Iterator[FeatureWriter]:
    """A cache folder written task by task and published by one rename when the block ends without error."""
    with staged_folder(final) as tmp:
        yield FeatureWriter(tmp)


@dataclass(frozen=True)
class FeatureWriter:
    folder: Path
    files: dict[str, str] = field(default_factory=dict)
    """sha256 of each task file written, by name: `FeatureBuild.files`."""

    def task(self, index: int, taps: dict[int, Tensor]) -> None:
        data = save({f"tap.{tap}": tensor.contiguous() for tap, tensor in sorted(taps.items())})
        name = _task_file(index)
        (self.folder / name).write_bytes(data)
        self.files[name] = hashlib.sha256(data).hexdigest()

    def finish(self, build: FeatureBuild) -> None:
        write_model(self.folder / BUILD, build)


def task_path(folder: Path, index: int) -> Path:
    """Where a cache folder holds task `index`'s features (a merge of caches built in parts links them)."""
    return folder / _task_file(index)
