"""Drafter and target identities: what a drafter (`zlab`, a checkpoint, a model folder, `baseline`, `sim:PROFILE`)
and a target (a Hugging Face id or a local folder) resolve to, verified up front.

A drafter is z-lab's Hugging Face release, a local Hugging Face DFlash folder (used as is after its config, tensor
table and values are checked against the target; NaN/Inf are read from the raw bits, so no torch), or an in-house
training checkpoint (converted first, see ``deploy.convert``). Every problem is named in one error about the input
field it came from (`drafter`, `target`, `target_config`, `drafter_config`); each command maps fields to its flags::

    target = resolve_target(None, profile, None)
    drafter = resolve_drafter("zlab", profile, target, store=Path("deployments/drafters"))
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dfserve.deploy.assets import (
    DrafterArch,
    Target,
    TensorInfo,
    problems_error,
    read_json,
    read_safetensors_header,
    safetensors_nonfinite,
    target_from_config,
    tensor_table_problems,
    verify_drafter_config,
)
from dfserve.deploy.hashes import file_sha256, folder_sha256
from dfserve.deploy.profiles import HostProfile
from dfserve.errors import FieldError
from dfserve.runs import read_model


def hf_cache_dir() -> Path:
    """Hugging Face's hub cache, as `huggingface_hub` locates it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def hf_cached_file(repo_id: str, filename: str) -> Path | None:
    """`filename` of the revision `main` points to in the local hub cache, if that model was downloaded here."""
    repo = hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    candidate = repo / "snapshots" / ref.read_text(encoding="utf-8").strip() / filename
    return candidate if candidate.is_file() else None


def resolve_target(target: str | None, profile: HostProfile, target_config: Path | None) -> Target:
    """The target's config.json: the `target_config` file, a local folder, the hub cache, or the profile's facts."""
    if target is not None and not target.strip():
        raise FieldError("target", "empty: give a local model folder or a Hugging Face id, or leave it out for the "
                         "profile's")
    if target is None and profile.target is None:
        raise FieldError("target", f"profile {profile.name} names no target; give a local model folder")
    model_path = target if target is not None else profile.target.model_path  # type: ignore[union-attr]
    local = Path(model_path).expanduser()
    if target_config is not None:
        path = str(local.resolve()) if local.is_dir() else model_path
        return target_from_config(path, read_json(target_config, "target_config"), str(target_config),
                                  profile.target_families)
    if local.is_dir():
        config_file = local / "config.json"
        if not config_file.is_file():
            raise FieldError("target", f"folder {local} has no config.json; the target config is needed to verify the drafter")
        return target_from_config(str(local.resolve()), read_json(config_file, "target"), str(config_file),
                                  profile.target_families)
    if model_path.startswith(("/", ".", "~")) or local.exists():
        raise FieldError("target", f"{model_path} is not a model folder")
    cached = hf_cached_file(model_path, "config.json")
    if cached is not None:
        return target_from_config(model_path, read_json(cached, "target"), str(cached), profile.target_families)
    if profile.target is not None and model_path == profile.target.model_path:
        source = f"profile {profile.name} (facts of {model_path}'s config.json)"
        return target_from_config(model_path, profile.target.config, source, profile.target_families)
    raise FieldError(
        "target", f"no config.json for {model_path}: not a local folder, not in the Hugging Face cache "
        f"({hf_cache_dir()}), not profile {profile.name}'s target; pass {{other}} FILE", other="target_config",
    )


# ---------------------------------------------------------------------------------------------------------------
# Drafter resolution

DrafterKind = Literal["zlab", "folder", "checkpoint", "simulated"]
SIMULATED_PREFIX = "sim:"


@dataclass(frozen=True)
class Drafter:
    """A resolved drafter: what SGLang loads, its verified config, and where it came from."""

    label: str
    kind: DrafterKind
    model_path: str
    block_size: int
    sha256: str | None
    source: str | None
    sim_profile: str
    converted: bool = False


def _config_of(path: Path, field: str) -> tuple[str, str]:
    """Where a drafter config was read (`verify_drafter_config`'s source), and the input it came from."""
    return f"drafter config {path}", field


def _profiles_config(profile: HostProfile) -> tuple[str, str]:
    """The same for the z-lab config a host profile holds."""
    return f"profile {profile.name}'s zlab.config", "profile_name"


RECORD_NAME = "dfserve-conversion.json"


class ConversionRecord(BaseModel):
    """Written beside the converted weights: which checkpoint they came from and how."""

    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = 1
    source: str
    sha256: str
    tensors: int
    renamed: dict[str, str]
    created_at: str
    torch_version: str
    weights_sha256: str | None = Field(None, description="model.safetensors as written: a folder whose weights no "
                                       "longer hash to it is refused (None: converted by an earlier dfserve)")


def sealed_record(folder: Path, hashes: Path | None) -> ConversionRecord | None:
    """A converted folder's record, once its weights still hash to what was written (`seal_problem`); None for a
    folder no conversion wrote. A folder whose weights were edited since (zeroed weights read well-formed and finite,
    and scored τ 1.0) would claim its checkpoint's identity: refused, wherever the folder is named."""
    path = folder / RECORD_NAME
    if not path.exists():
        return None
    record = read_model(path, ConversionRecord, f"{path}: missing")
    if (problem := seal_problem(folder, record, hashes)) is not None:
        raise FieldError("drafter", f"{folder}: {problem}; remove it to convert again")
    return record


def seal_problem(folder: Path, record: ConversionRecord, hashes: Path | None) -> str | None:
    if record.weights_sha256 is None:
        return f"its {RECORD_NAME} holds no hash of its weights (converted by an earlier dfserve)"
    if file_sha256(folder / "model.safetensors", hashes) != record.weights_sha256:
        return (f"its model.safetensors no longer hashes to the weights_sha256 of {RECORD_NAME}: edited or damaged "
                "since it was written")
    return None


def verify_folder(folder: Path, target: Target) -> DrafterArch:
    """Check a Hugging Face DFlash folder's config, tensor table and values against the target. A tensor in two
    weight files is a problem: which copy a loader keeps is up to it."""
    config = read_json(folder / "config.json", "drafter")
    arch = verify_drafter_config(config, target, *_config_of(folder / "config.json", "drafter"))
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise FieldError("drafter", f"folder {folder} holds no *.safetensors weights")
    found: dict[str, TensorInfo] = {}
    file_of: dict[str, str] = {}
    duplicates: list[str] = []
    nonfinite: list[str] = []
    for path in weights:
        table = read_safetensors_header(path)
        duplicates += [f"tensor {name} is in both {file_of[name]} and {path.name}" for name in table if name in file_of]
        found = table | found
        file_of = dict.fromkeys(table, path.name) | file_of
        nonfinite += safetensors_nonfinite(path, table)
    index = folder / INDEX_NAME
    problems = duplicates + (_index_problems(read_json(index, "drafter"), [p.name for p in weights], index)
                             if index.exists() else [])
    problems += tensor_table_problems(found, arch) + nonfinite
    if problems:
        raise problems_error(f"drafter folder {folder}", problems, field="drafter")
    return arch


INDEX_NAME = "model.safetensors.index.json"


def _index_problems(index: object, files: Sequence[str], path: Path) -> list[str]:
    """Where a sharded folder's index and its files disagree: transformers opens every file the index names
    (`weight_map`), and SGLang loads only those; which tensor it says is where, neither reads. transformers also
    adds to the index's `metadata` object (whatever it holds) and fails on an index without one."""
    fields: Mapping[str, object] = index if isinstance(index, Mapping) else {}
    problems = ([] if isinstance(fields.get("metadata"), Mapping)
                else [f"{path.name} has no metadata object, which transformers needs to load the shards"])
    weight_map = fields.get("weight_map")
    if not isinstance(weight_map, Mapping) or not all(isinstance(f, str) for f in weight_map.values()):
        return [*problems, f"{path.name} has no weight_map of tensor names to file names"]
    named = set(weight_map.values())
    return (problems + [f"{path.name} names {file}, which is not in the folder" for file in sorted(named - set(files))]
            + [f"{file} is not in {path.name}: loaders skip it" for file in files if file not in named])


def baseline_drafter(registry: Path, target: Target, profile: HostProfile) -> str:
    """The drafter the baseline registry names for the target, as `resolve_drafter` takes it."""
    from dfserve.baselines import BaselineRegistry

    current = BaselineRegistry(registry).current(target.model_path)
    if current is None:
        raise FieldError("drafter", f"baseline: no baseline for {target.model_path} in {registry}; promote one or name the drafter")
    if profile.zlab is not None and current.drafter == profile.zlab.model_path:
        return "zlab"
    if not Path(current.drafter).exists():
        raise FieldError("drafter", f"baseline: the baseline drafter {current.drafter} (run {current.run_id}) is not on this machine")
    return current.drafter


def simulated_drafter(profile_name: str) -> Drafter:
    """A drafter known only by its simulator profile: named and pathed as simulated, so no record mistakes it for a
    real checkpoint. It runs only on the simulated engine."""
    from dfserve.deploy.sim.profiles import load_profile as load_sim_profile

    try:
        sim = load_sim_profile(profile_name)
    except FieldError as exc:
        raise FieldError("drafter", f"{SIMULATED_PREFIX}{profile_name}: {exc.message}") from None
    if sim is None:
        raise FieldError("drafter", f"{SIMULATED_PREFIX}{profile_name} names no drafter (that profile means no speculation)")
    label = f"sim-{Path(profile_name).stem}"
    return Drafter(label, "simulated", f"dfserve-sim/{sim.name}", sim.block_size, None, profile_name, profile_name)


def resolve_drafter(
    drafter: str, profile: HostProfile, target: Target, store: Path, drafter_config: Path | None = None,
    registry: Path = Path("runs"),
) -> Drafter:
    """`zlab`, `baseline` (from the registry), a checkpoint file (converted into `store`, keyed by its content hash
    and the config it is converted with), a Hugging Face DFlash folder, or `sim:PROFILE` (a drafter that exists only
    as a simulator profile)."""
    hashes = store / ".hashes"
    if drafter.startswith(SIMULATED_PREFIX):
        return simulated_drafter(drafter.removeprefix(SIMULATED_PREFIX))
    if drafter == "baseline":
        drafter = baseline_drafter(registry, target, profile)
    if drafter == "zlab":
        if profile.zlab is None:
            raise FieldError("drafter", f"zlab: profile {profile.name} names no z-lab drafter")
        repo = profile.zlab.model_path
        cached = hf_cached_file(repo, "config.json")
        config = read_json(cached, "drafter") if cached else dict(profile.zlab.config)
        arch = verify_drafter_config(config, target, *(_config_of(cached, "drafter") if cached else
                                                       _profiles_config(profile)))
        return Drafter("zlab", "zlab", repo, arch.block_size, None, repo, "zlab")
    path = Path(drafter).expanduser()
    if not path.exists():
        raise FieldError("drafter", f"{drafter} does not exist (nor is it 'zlab', 'baseline' or {SIMULATED_PREFIX}PROFILE)")
    if path.is_dir():
        arch = verify_folder(path, target)
        sealed_record(path, hashes)
        digest = folder_sha256(path, hashes)
        return Drafter(path.name, "folder", str(path.resolve()), arch.block_size, digest, str(path.resolve()), "inhouse")
    if drafter_config is None and profile.zlab is None:
        raise FieldError("drafter_config", f"profile {profile.name} has no z-lab config to convert {path.name} with; pass the drafter's config.json")
    template = read_json(drafter_config, "drafter_config") if drafter_config else dict(profile.zlab.config)  # type: ignore[union-attr]
    arch = verify_drafter_config(template, target, *(_config_of(drafter_config, "drafter_config") if drafter_config
                                                     else _profiles_config(profile)))
    from dfserve.deploy.convert import convert_checkpoint  # torch loads only when a checkpoint is converted

    result = convert_checkpoint(path, store, target, template, arch, hashes)
    return Drafter(
        f"inhouse-{result.key[:8]}", "checkpoint", str(result.folder.resolve()), arch.block_size,
        result.key, str(path.resolve()), "inhouse", converted=result.converted,
    )
