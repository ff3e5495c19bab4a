"""The target-feature cache: the tap layers' outputs of one teacher-forced forward per task, stored once and reused by
every later drafter, keyed by everything they depend on.

A cache is a folder named by the hash of its key (the target's content, the reference tokens and their key, the
taps, the dtype, the torch and transformers versions), holding `build.json` (the key, the health figure, who built
it and when) and one safetensors file per task (`tap.<layer>` tensors, [tokens, hidden]). It appears whole or not at
all. A cache named explicitly (`features` field) whose key differs from this run's is refused, naming what differs;
it is never reused silently::

    store = open_features(folder, key)            # refused when built under other settings
    context = store.context(task_index, taps=(1, 16, 31, 46, 61))
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

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
    schema_version: Literal[1] = 1
    kind: Literal["eval-features"] = "eval-features"
    key: FeatureKey
    tasks: tuple[str, ...]
    built_at: str
    built_by: str
    build_s: float
    health: Health


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
        with safe_open(str(self.folder / _task_file(task_index)), framework="pt") as handle:
            return torch.cat([handle.get_tensor(f"tap.{tap}") for tap in taps], dim=-1)


def _read_build(folder: Path) -> FeatureBuild:
    try:
        return FeatureBuild.model_validate_json((folder / BUILD).read_bytes())
    except FileNotFoundError:
        raise FieldError("features", f"{folder} is not a feature cache (no {BUILD})") from None
    except ValidationError as exc:
        raise FieldError("features", describe_invalid(exc, str(folder / BUILD))) from None


def check_built_for(folder: Path, target_sha256: str, target: str) -> None:
    """Refuse a cache of another target before anything is computed for this one."""
    found = _read_build(folder).key
    if found.target_sha256 != target_sha256:
        raise _refused(folder, [_other_target(found, target_sha256, target)])


def open_features(folder: Path, key: FeatureKey) -> FeatureStore:
    """A cache folder built under exactly `key`; any other is refused with what differs."""
    build = _read_build(folder)
    if differences := _differences(build.key, key):  # the same target's content at another path is the same target
        raise _refused(folder, differences)
    if missing := [i for i in range(len(build.tasks)) if not (folder / _task_file(i)).is_file()]:
        raise FieldError("features", f"{folder}: task files {missing[:5]} are missing; the cache is damaged")
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

    def task(self, index: int, taps: dict[int, Tensor]) -> None:
        save_file({f"tap.{tap}": tensor.contiguous() for tap, tensor in sorted(taps.items())},
                  str(self.folder / _task_file(index)))

    def finish(self, build: FeatureBuild) -> None:
        write_model(self.folder / BUILD, build)
