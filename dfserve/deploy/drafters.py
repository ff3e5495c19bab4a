"""Drafter and target identities: what `--drafter zlab|PATH|baseline` and `--target` resolve to, verified up front.

A drafter is z-lab's Hugging Face release, a local Hugging Face DFlash folder (used as is after its config, tensor
table and values are checked against the target; NaN/Inf are read from the raw bits, so no torch), or an in-house
training checkpoint (converted first, see ``deploy.convert``).
Every problem is collected and named in one `UserError` before anything is started::

    target = resolve_target(None, profile, None)
    drafter = resolve_drafter("zlab", profile, target, store=Path("deployments/drafters"))
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dfserve.deploy.profiles import HostProfile
from dfserve.errors import UserError

DRAFTER_ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
MAX_PROBLEMS_SHOWN = 8


def problems_error(what: str, problems: list[str]) -> UserError:
    """One line naming every problem (the first few, then how many more)."""
    shown = "; ".join(problems[:MAX_PROBLEMS_SHOWN])
    more = f"; and {len(problems) - MAX_PROBLEMS_SHOWN} more" if len(problems) > MAX_PROBLEMS_SHOWN else ""
    return UserError(f"{what}: {len(problems)} problem(s): {shown}{more}")


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what}: {path} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{what}: {path} is not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{what}: {path} must hold a JSON object")
    return data


# ---------------------------------------------------------------------------------------------------------------
# Target


@dataclass(frozen=True)
class Target:
    """The target model: the path SGLang gets, where its config.json was found, and the shapes read from it."""

    model_path: str
    config_source: str
    family: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int


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


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def _positive_int(config: Mapping[str, Any], key: str, where: str, problems: list[str]) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        problems.append(f"{where}{key} must be a positive integer, got {value!r}")
        return 0
    return value


def target_from_config(model_path: str, config: dict[str, Any], source: str, profile: HostProfile) -> Target:
    """Check the target's config is of a family this profile serves and read the shapes a drafter must match."""
    problems: list[str] = []
    text = text_config(config)
    family = str(text.get("model_type") or config.get("model_type") or "")
    families = {str(config.get("model_type")), family}
    if not families & set(profile.target_families):
        problems.append(f"model_type {family or None!r} is not one of {profile.target_families}")
    prefix = "text_config." if text is not config else ""
    hidden = _positive_int(text, "hidden_size", prefix, problems)
    layers = _positive_int(text, "num_hidden_layers", prefix, problems)
    vocab = _positive_int(text, "vocab_size", prefix, problems)
    if problems:
        raise problems_error(f"target config ({source})", problems)
    return Target(model_path, source, family, hidden, layers, vocab)


def resolve_target(target: str | None, profile: HostProfile, target_config: Path | None) -> Target:
    """The target's config.json: `--target-config`, a local folder, the hub cache, or the profile's facts."""
    model_path = target or profile.target.model_path
    local = Path(model_path).expanduser()
    if target_config is not None:
        path = str(local.resolve()) if local.is_dir() else model_path
        return target_from_config(path, read_json(target_config, "--target-config"), str(target_config), profile)
    if local.is_dir():
        config_file = local / "config.json"
        if not config_file.is_file():
            raise UserError(f"--target: folder {local} has no config.json; the target config is needed to verify the drafter")
        return target_from_config(str(local.resolve()), read_json(config_file, "--target"), str(config_file), profile)
    if model_path.startswith(("/", ".", "~")) or local.exists():
        raise UserError(f"--target: {model_path} is not a model folder")
    cached = hf_cached_file(model_path, "config.json")
    if cached is not None:
        return target_from_config(model_path, read_json(cached, "--target"), str(cached), profile)
    if model_path == profile.target.model_path:
        source = f"profile {profile.name} (facts of {model_path}'s config.json)"
        return target_from_config(model_path, dict(profile.target.config), source, profile)
    raise UserError(
        f"--target: no config.json for {model_path}: not a local folder, not in the Hugging Face cache "
        f"({hf_cache_dir()}), not profile {profile.name}'s target; pass --target-config FILE"
    )


# ---------------------------------------------------------------------------------------------------------------
# Drafter config and tensors


@dataclass(frozen=True)
class DrafterArch:
    """The shapes a DFlash drafter's config.json fixes."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    num_context_layers: int


def verify_drafter_config(config: Mapping[str, Any], target: Target) -> DrafterArch:
    """Check a DFlash config.json against its target; every problem is named in one `UserError`."""
    problems: list[str] = []
    if DRAFTER_ARCHITECTURE not in (config.get("architectures") or []):
        problems.append(f"architectures must include {DRAFTER_ARCHITECTURE!r}, got {config.get('architectures')!r}")
    ints = {
        key: _positive_int(config, key, "", problems)
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size", "num_target_layers")
    }
    head_dim = config.get("head_dim")
    if head_dim is None and ints["num_attention_heads"]:
        head_dim = ints["hidden_size"] // ints["num_attention_heads"]
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        problems.append(f"head_dim must be a positive integer, got {head_dim!r}")
        head_dim = 0
    dflash = config.get("dflash_config")
    if not isinstance(dflash, Mapping):
        problems.append("dflash_config is missing")
        dflash = {}
    block_size = dflash.get("block_size", config.get("block_size", 16))
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        problems.append(f"block_size must be an integer >= 2, got {block_size!r}")
        block_size = 0
    layer_ids = dflash.get("target_layer_ids")
    if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids):
        problems.append(f"dflash_config.target_layer_ids must be a non-empty list of integers, got {layer_ids!r}")
        layer_ids = []
    elif bad := [i for i in layer_ids if not 0 <= i < target.num_hidden_layers]:
        problems.append(f"dflash_config.target_layer_ids {bad} outside the target's {target.num_hidden_layers} layers")
    mask = dflash.get("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        problems.append(f"dflash_config.mask_token_id must be a token id below {target.vocab_size}, got {mask!r}")
    for key, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size),
                      ("num_target_layers", target.num_hidden_layers)):
        if ints[key] and ints[key] != want:
            problems.append(f"{key} {ints[key]} does not match the target's {want}")
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != ints["num_hidden_layers"]:
            problems.append(f"layer_types must list one type per layer ({ints['num_hidden_layers']}), got {layer_types!r}")
        elif unknown := sorted({t for t in layer_types if t not in LAYER_TYPES}):
            problems.append(f"layer_types {unknown} not in {list(LAYER_TYPES)}")
        elif "sliding_attention" in layer_types and not isinstance(config.get("sliding_window"), int):
            problems.append("sliding_attention layers need an integer sliding_window")
    if problems:
        raise problems_error("drafter config", problems)
    return DrafterArch(
        ints["hidden_size"], ints["intermediate_size"], ints["num_hidden_layers"], ints["num_attention_heads"],
        ints["num_key_value_heads"], head_dim, ints["vocab_size"], block_size, len(layer_ids),
    )


def expected_tensors(arch: DrafterArch) -> dict[str, tuple[int, ...]]:
    """z-lab's tensor names and shapes for a drafter (no biases, no embedding or LM head: it uses the target's)."""
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, arch.num_context_layers * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for n in range(arch.num_hidden_layers):
        layer = f"layers.{n}."
        shapes |= {
            layer + "input_layernorm.weight": (h,),
            layer + "post_attention_layernorm.weight": (h,),
            layer + "self_attn.q_proj.weight": (q, h),
            layer + "self_attn.k_proj.weight": (kv, h),
            layer + "self_attn.v_proj.weight": (kv, h),
            layer + "self_attn.o_proj.weight": (h, q),
            layer + "self_attn.q_norm.weight": (d,),
            layer + "self_attn.k_norm.weight": (d,),
            layer + "mlp.gate_proj.weight": (i, h),
            layer + "mlp.up_proj.weight": (i, h),
            layer + "mlp.down_proj.weight": (h, i),
        }
    return shapes


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int] | None = None
    """Byte range in a safetensors file's data section, when read from one."""


def tensor_table_problems(found: Mapping[str, TensorInfo], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Missing, unexpected, mis-shaped and non-float tensors, each named."""
    problems = [f"missing tensor {name}" for name in expected if name not in found]
    problems += [f"unexpected tensor {name}" for name in found if name not in expected]
    for name, info in found.items():
        if name in expected and info.shape != expected[name]:
            problems.append(f"{name} has shape {list(info.shape)}, expected {list(expected[name])}")
        if info.dtype not in FLOAT_DTYPES:
            problems.append(f"{name} has dtype {info.dtype}, expected a floating-point type")
    return problems


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes, shapes and byte ranges from a safetensors header, without reading the data."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100_000_000:
                raise ValueError("header length implausible")
            header = json.loads(handle.read(length))
        start = 8 + length
        return {
            name: TensorInfo(
                str(entry["dtype"]), tuple(entry["shape"]),
                (start + entry["data_offsets"][0], start + entry["data_offsets"][1]),
            )
            for name, entry in header.items()
            if name != "__metadata__"
        }
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise UserError(f"drafter: {path} is not a safetensors file ({exc.__class__.__name__}: {exc})") from None


# Exponent and mantissa bits by safetensors dtype: a value is NaN or Inf when its exponent bits are all set.
_FLOAT_BITS = {"BF16": (np.uint16, 0x7F80, 0x007F), "F16": (np.uint16, 0x7C00, 0x03FF),
               "F32": (np.uint32, 0x7F800000, 0x007FFFFF), "F64": (np.uint64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF)}


def safetensors_nonfinite(path: Path, table: Mapping[str, TensorInfo]) -> list[str]:
    """NaN and Inf counts per tensor of a safetensors file, read from the raw bits (no torch; bf16 included)."""
    problems = []
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in table.items():
        if info.dtype not in _FLOAT_BITS or info.data_offsets is None:
            continue
        kind, exponent, mantissa = _FLOAT_BITS[info.dtype]
        begin, end = info.data_offsets
        bits = data[begin:end].view(kind)
        special = (bits & kind(exponent)) == kind(exponent)
        nan = int(np.count_nonzero(special & ((bits & kind(mantissa)) != 0)))
        inf = int(np.count_nonzero(special)) - nan
        if nan or inf:
            problems.append(f"{name} has {nan} NaN and {inf} Inf values")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# Content hashes


def file_sha256(path: Path, cache: Path | None = None, remember: bool = True) -> str:
    """SHA-256 of a file's content; remembered under `cache` per (device, inode, size, mtime) so 15 GB is read once."""
    key = _hash_key(path, cache)
    if key is not None and key.is_file():
        return key.read_text(encoding="utf-8").strip()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    value = digest.hexdigest()
    if remember:
        remember_sha256(path, cache, value)
    return value


def _hash_key(path: Path, cache: Path | None) -> Path | None:
    stat = path.stat()
    return cache / f"{stat.st_dev}-{stat.st_ino}-{stat.st_size}-{stat.st_mtime_ns}.sha256" if cache else None


def remember_sha256(path: Path, cache: Path | None, value: str) -> None:
    key = _hash_key(path, cache)
    if key is None or key.is_file():
        return
    key.parent.mkdir(parents=True, exist_ok=True)
    tmp = key.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(value + "\n", encoding="utf-8")
    os.replace(tmp, key)


def folder_sha256(folder: Path, cache: Path | None = None) -> str:
    """One hash over a model folder: each config and weight file's name and content hash, in name order."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.suffix in (".json", ".safetensors"):
            digest.update(f"{path.name}\0{file_sha256(path, cache)}\n".encode())
    return digest.hexdigest()


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


def _verify_folder(folder: Path, target: Target) -> DrafterArch:
    config = read_json(folder / "config.json", f"drafter folder {folder}")
    arch = verify_drafter_config(config, target)
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise UserError(f"drafter folder {folder}: no *.safetensors weights")
    found: dict[str, TensorInfo] = {}
    problems: list[str] = []
    for path in weights:
        table = read_safetensors_header(path)
        found |= table
        problems += safetensors_nonfinite(path, table)
    problems = tensor_table_problems(found, expected_tensors(arch)) + problems
    if problems:
        raise problems_error(f"drafter folder {folder}", problems)
    return arch


def baseline_drafter(registry: Path, target: Target, profile: HostProfile) -> str:
    """The drafter the baseline registry names for the target, as `--drafter` would take it."""
    from dfserve.baselines import BaselineRegistry

    current = BaselineRegistry(registry).current(target.model_path)
    if current is None:
        raise UserError(f"--drafter baseline: no baseline for {target.model_path} in {registry}; promote one or name the drafter")
    if current.drafter == profile.zlab.model_path:
        return "zlab"
    if not Path(current.drafter).exists():
        raise UserError(f"--drafter baseline: the baseline drafter {current.drafter} (run {current.run_id}) is not on this machine")
    return current.drafter


def simulated_drafter(profile_name: str) -> Drafter:
    """A drafter known only by its simulator profile: named and pathed as simulated, so no record mistakes it for a
    real checkpoint. It runs only on the simulated engine."""
    from dfserve.deploy.sim.profiles import load_profile as load_sim_profile

    try:
        sim = load_sim_profile(profile_name)
    except UserError as exc:
        raise UserError(f"--drafter {SIMULATED_PREFIX}{profile_name}: {exc}") from None
    if sim is None:
        raise UserError(f"--drafter: {SIMULATED_PREFIX}{profile_name} names no drafter (that profile means no speculation)")
    label = f"sim-{Path(profile_name).stem}"
    return Drafter(label, "simulated", f"dfserve-sim/{sim.name}", sim.block_size, None, profile_name, profile_name)


def resolve_drafter(
    drafter: str, profile: HostProfile, target: Target, store: Path, drafter_config: Path | None = None,
    registry: Path = Path("runs"),
) -> Drafter:
    """`zlab`, `baseline` (from the registry), a checkpoint file (converted into `store`, keyed by content hash),
    a Hugging Face DFlash folder, or `sim:PROFILE` (a drafter that exists only as a simulator profile)."""
    hashes = store / ".hashes"
    if drafter.startswith(SIMULATED_PREFIX):
        return simulated_drafter(drafter.removeprefix(SIMULATED_PREFIX))
    if drafter == "baseline":
        drafter = baseline_drafter(registry, target, profile)
    if drafter == "zlab":
        repo = profile.zlab.model_path
        cached = hf_cached_file(repo, "config.json")
        config = read_json(cached, "--drafter zlab") if cached else dict(profile.zlab.config)
        arch = verify_drafter_config(config, target)
        return Drafter("zlab", "zlab", repo, arch.block_size, None, repo, "zlab")
    path = Path(drafter).expanduser()
    if not path.exists():
        raise UserError(f"--drafter: {drafter} is not 'zlab', 'baseline', a checkpoint file or a model folder")
    if path.is_dir():
        arch = _verify_folder(path, target)
        digest = folder_sha256(path, hashes)
        return Drafter(path.name, "folder", str(path.resolve()), arch.block_size, digest, str(path.resolve()), "inhouse")
    template = read_json(drafter_config, "--drafter-config") if drafter_config else dict(profile.zlab.config)
    arch = verify_drafter_config(template, target)
    from dfserve.deploy.convert import convert_checkpoint  # torch loads only when a checkpoint is converted

    result = convert_checkpoint(path, store, target, template, arch, hashes)
    return Drafter(
        f"inhouse-{result.sha256[:8]}", "checkpoint", str(result.folder.resolve()), arch.block_size,
        result.sha256, str(path.resolve()), "inhouse", converted=result.converted,
    )
