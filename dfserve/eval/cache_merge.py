"""One feature cache from caches built in parts (`dfserve eval run --shard I/N`, one per pod of an Indexed Job):
the references and target features of all the tasks, under the very key a later `eval run` on the whole task set
computes, so every later checkpoint reuses it without a target forward.

Each part is a `--cache` folder holding one reference file and one feature folder. The merge refuses parts built
under different settings (target, taps, dtype, versions, prompts, limits, reference source), a task missing or given
twice, and tasks that are not the first `num_tasks` of the task set; the merged feature folder links the parts' task
files (no tensor is copied), with the content hashes each part recorded and was checked against when read, and
appears whole or not at all::

    merged = merge_caches([Path("shard-0"), Path("shard-1")], Path("eval-cache"), load_tasks("humaneval"), 164)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from dfserve.errors import FieldError, describe_invalid
from dfserve.eval import features as feat
from dfserve.eval import references as refs
from dfserve.runs import link_input, staged_folder, utc_now_iso, write_model
from dfserve.tasks import TaskSet

_PER_PART = ("task_ids", "prompts_sha256")
"""The reference-key fields that differ between parts; every other field must agree."""


@dataclass(frozen=True)
class Part:
    cache: Path
    references: refs.ReferenceSet
    features: Path
    build: feat.FeatureBuild


@dataclass(frozen=True)
class Merged:
    references: Path
    features: Path
    tasks: int


def _one(folder: Path, pattern: str, what: str) -> Path:
    found = sorted(p for p in folder.glob(pattern) if not p.name.startswith("."))
    if len(found) != 1:
        raise FieldError("shards", f"{folder}: {len(found)} {what} found, a part holds exactly one")
    return found[0]


def read_part(cache: Path) -> Part:
    features = _one(cache / "features", "features-*", "feature folders")
    build = feat.open_features(features, _read_build(features).key).build
    path = _one(cache / "references", "references-*.json", "reference files")
    try:
        references = refs.ReferenceSet.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise FieldError("shards", describe_invalid(exc, str(path))) from None
    if references.key.digest() != build.key.references_key or references.digest() != build.key.references_sha256:
        raise FieldError("shards", f"{features} was not built from {path}")
    if not references.of_its_tasks():
        raise FieldError("shards", f"{path}: its references are not labelled with its key's tasks in order (task "
                         "edited)")
    return Part(cache, references, features, build)


def _read_build(folder: Path) -> feat.FeatureBuild:
    try:
        return feat.FeatureBuild.model_validate_json((folder / feat.BUILD).read_bytes())
    except FileNotFoundError:
        raise FieldError("shards", f"{folder} is not a feature cache (no {feat.BUILD})") from None
    except ValidationError as exc:
        raise FieldError("shards", describe_invalid(exc, str(folder / feat.BUILD))) from None


def _same(parts: Sequence[Part]) -> None:
    first = parts[0]
    shared = first.references.key.model_dump(exclude=set(_PER_PART))
    for part in parts[1:]:
        theirs = part.references.key.model_dump(exclude=set(_PER_PART))
        if differ := [k for k in shared if shared[k] != theirs[k]]:
            raise FieldError("shards", f"{part.cache} and {first.cache} were built under other settings "
                             f"({', '.join(differ)})")
        mine, other = first.build.key, part.build.key
        if differ := [k for k in ("target_sha256", "taps", "dtype", "versions")
                      if getattr(mine, k) != getattr(other, k)]:
            raise FieldError("shards", f"{part.cache} and {first.cache} hold other features ({', '.join(differ)})")


def merge_caches(caches: Sequence[Path], out: Path, tasks: TaskSet, num_tasks: int) -> Merged:
    """The whole cache in `out` from its parts; refused in one line when the parts are not exactly the first
    `num_tasks` tasks of `tasks`, once each, under one set of settings."""
    parts = [read_part(cache) for cache in caches]
    if not parts:
        raise FieldError("shards", "no part given")
    _same(parts)
    if parts[0].references.key.tasks_sha256 != tasks.sha256:
        raise FieldError("tasks", f"the parts were built from another task set than {tasks.name}")
    wanted = [t.id for t in tasks.tasks[:num_tasks]]
    found: dict[str, tuple[Part, int]] = {}
    for part in parts:
        for index, reference in enumerate(part.references.references):
            if reference.task in found:
                raise FieldError("shards", f"task {reference.task} is in {found[reference.task][0].cache} and "
                                 f"{part.cache}; each task belongs to one part")
            found[reference.task] = (part, index)
    if missing := [t for t in wanted if t not in found]:
        raise FieldError("shards", f"{len(missing)} of {len(wanted)} tasks are in no part (first: {missing[0]}); "
                         "a part is missing")
    if extra := sorted(set(found) - set(wanted)):
        raise FieldError("shards", f"task {extra[0]} is not among the first {num_tasks} of {tasks.name}")
    first = parts[0]
    ordered = [found[t][0].references.references[found[t][1]] for t in wanted]
    key = first.references.key.model_copy(update={
        "task_ids": tuple(wanted), "prompts_sha256": refs.prompts_sha256([r.prompt_ids for r in ordered])})
    references = refs.ReferenceSet(key=key, source=first.references.source, created_at=utc_now_iso(),
                                   references=tuple(ordered))
    feature_key = first.build.key.model_copy(update={"references_key": key.digest(),
                                                     "references_sha256": references.digest()})
    folder = feat.features_path(out, feature_key)
    if folder.exists() or refs.reference_path(out, key).exists():
        raise FieldError("cache", f"{out} already holds the merged cache ({folder.name}); nothing to do")
    files: dict[str, str] = {}
    with staged_folder(folder) as tmp:
        for index, task in enumerate(wanted):
            part, at = found[task]
            source, linked = feat.task_path(part.features, at), feat.task_path(tmp, index)
            link_input(source, linked, "cache")
            files[linked.name] = part.build.files[source.name]
        agree = sum(p.build.health.agree for p in parts)
        positions = sum(p.build.health.positions for p in parts)
        write_model(tmp / feat.BUILD, feat.FeatureBuild(
            key=feature_key, tasks=tuple(wanted), built_at=utc_now_iso(),
            built_by="merge of " + ", ".join(sorted(p.build.built_by for p in parts)),
            build_s=sum(p.build.build_s for p in parts), health=feat.health(agree, positions), files=files))
    return Merged(refs.store_references(out, references), folder, len(wanted))
