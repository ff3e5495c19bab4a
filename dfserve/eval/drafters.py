"""Drafters to evaluate, resolved and verified as `dfserve deploy` does, then loaded as z-lab's `DFlashDraftModel`.

`zlab` (its snapshot in the local Hugging Face cache), `baseline` (the registry's current drafter for the target),
a Hugging Face DFlash folder, or a trainer's checkpoint (converted once into the store deploy shares, keyed by its
content hash, so a checkpoint screened here deploys without a second conversion). Every config, tensor table and
NaN/Inf scan runs before any weight is loaded. A drafter's identity is the name the baseline registry and
`dfserve compare` know it by: z-lab's Hugging Face id, or a converted drafter's `inhouse-<sha16>` folder::

    drafter = resolve_eval_drafter("ckpt/step-4000/checkpoint.pt", None, context)
    model, mask_embedding = load_drafter(drafter, torch.float32)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dfserve.baselines import drafter_identity
from dfserve.deploy.assets import Target, drafter_layer_types, read_json, sliding_window
from dfserve.deploy.drafters import (
    baseline_drafter,
    hf_cache_dir,
    hf_cached_file,
    resolve_drafter,
    sealed_record,
)
from dfserve.deploy.hashes import file_sha256
from dfserve.deploy.profiles import HostProfile
from dfserve.errors import FieldError
from dfserve.eval.records import SAME_WEIGHTS_ATOL, SAME_WEIGHTS_RTOL, DrafterInfo

MASK_EMBEDDING = "mask_embedding.pt"


@dataclass(frozen=True)
class DrafterContext:
    """What resolving a drafter needs beyond its name: the host profile (z-lab's id and default config), the
    target, deploy's store of converted drafters, a config for checkpoints, the baseline registry."""

    profile: HostProfile
    target: Target
    store: Path
    drafter_config: Path | None
    registry: Path


@dataclass(frozen=True)
class EvalDrafter:
    info: DrafterInfo
    folder: Path
    checkpoint: Path | None
    """The trainer's checkpoint the folder was converted from, staged into the run by hard link."""


def _layers(config: dict[str, Any]) -> tuple[str, ...]:
    """Each layer's attention as z-lab's `Qwen3DFlashAttention` decides it (config `is_causal` overrides)."""
    kinds = drafter_layer_types(config, int(config.get("num_hidden_layers", 0)))
    override = config.get("is_causal")
    described = []
    for kind in kinds:
        causal = kind == "sliding_attention" if override is None else bool(override)
        window = f", window {sliding_window(config)}" if kind == "sliding_attention" else ""
        described.append(("causal" if causal else "bidirectional") + window)
    return tuple(described)


def resolve_eval_drafter(spec: str, label: str | None, context: DrafterContext) -> EvalDrafter:
    """One drafter as given on the command line, verified against the target; conversion happens here, once."""
    if spec == "baseline":
        spec = baseline_drafter(context.registry, context.target, context.profile)
    source = spec
    if spec == "zlab":
        if context.profile.zlab is None:
            raise FieldError("drafter", f"zlab: profile {context.profile.name} names no z-lab drafter")
        repo = context.profile.zlab.model_path
        cached = hf_cached_file(repo, "config.json")
        if cached is None:
            raise FieldError("drafter", f"zlab: {repo} is not in the Hugging Face cache ({hf_cache_dir()}); download "
                             f"it first (huggingface-cli download {repo})")
        spec = str(cached.parent)
    resolved = resolve_drafter(spec, context.profile, context.target, context.store, context.drafter_config,
                               context.registry)
    folder = Path(resolved.model_path)
    config = read_json(folder / "config.json", "drafter")
    dflash = config.get("dflash_config") or {}
    kind = "zlab" if source == "zlab" else "checkpoint" if resolved.kind == "checkpoint" else "folder"
    identity = context.profile.zlab.model_path if kind == "zlab" and context.profile.zlab else drafter_identity(str(folder))
    checkpoint = Path(resolved.source) if resolved.kind == "checkpoint" and resolved.source else None
    info = DrafterInfo(
        label=label or ("zlab" if kind == "zlab" else resolved.label), kind=kind, identity=identity, source=source,
        folder=str(folder), sha256=resolved.sha256, converted=resolved.converted, staged=None,
        block_size=resolved.block_size, target_layer_ids=tuple(dflash["target_layer_ids"]),
        mask_token_id=int(dflash["mask_token_id"]), layers=_layers(config),
        mask_embedding=(folder / MASK_EMBEDDING).is_file(),
        weights_sha256=weights_sha256(folder, checkpoint, context.store / ".hashes"),
    )
    return EvalDrafter(info, folder, checkpoint)


def weights_sha256(folder: Path, checkpoint: Path | None, hashes: Path) -> str:
    """The bytes a drafter's weights came from, so that one checkpoint given two ways (z-lab's folder and its
    model.safetensors as a checkpoint, a checkpoint and the folder deploy converted it into) hashes the same. Read
    from deploy's memo of file hashes: resolving the drafter hashed every one of these files already."""
    if checkpoint is not None:
        return file_sha256(checkpoint, hashes)
    if (record := sealed_record(folder, hashes)) is not None:
        return record.sha256
    weights = sorted(folder.glob("*.safetensors"))
    if len(weights) == 1:
        return file_sha256(weights[0], hashes)
    digest = hashlib.sha256()
    for path in weights:
        digest.update(f"{path.name}\0{file_sha256(path, hashes)}\n".encode())
    return digest.hexdigest()


_MASK_KEY = "\0mask_embedding"
"""The mask embedding's name among a drafter's weights: no module's (a NUL starts no parameter name), and first."""


def weights_of(model: Any, mask_embedding: Tensor | None) -> dict[str, Tensor]:
    """A loaded drafter's weights by name, the mask embedding sidecar's among them (`_MASK_KEY`)."""
    state = dict(model.state_dict())
    if mask_embedding is not None:
        state[_MASK_KEY] = mask_embedding
    return state


def tensors_sha256(model: Any, mask_embedding: Tensor | None) -> str:
    """The weights as loaded for scoring: each tensor's name, dtype, shape and values, and the mask embedding, the
    floating ones rounded to bfloat16, the dtype a drafter is deployed in. One model hashes the same however its files
    were laid out (a folder, a trainer's checkpoint, a `module.` prefix) and whatever `--dtype` it was scored in: a
    float32 folder and the same weights as a checkpoint, converted to bfloat16, are one drafter deployed."""
    state = weights_of(model, mask_embedding)
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu()
        tensor = (tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor).contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


WEIGHTS_SAMPLE_PER_TENSOR = 32
"""Values kept of each tensor in `weights_sample`: a training step moves most of a tensor's values past bfloat16's
rounding, so a few dozen places tell two checkpoints apart (about 40 KB of a run's config.json for z-lab's 58
tensors)."""


def weights_sample(model: Any, mask_embedding: Tensor | None) -> tuple[float, ...]:
    """The weights as loaded at `WEIGHTS_SAMPLE_PER_TENSOR` evenly spaced places of each tensor (by name, and the mask
    embedding), as float32: what `DrafterInfo.checkpoint_shared_with` compares within bfloat16's rounding across
    runs, where only the run's config is at hand."""
    state = weights_of(model, mask_embedding)
    sample: list[float] = []
    for name in sorted(state):
        flat = state[name].detach().reshape(-1)
        if flat.numel():
            places = torch.linspace(0, flat.numel() - 1, min(WEIGHTS_SAMPLE_PER_TENSOR, flat.numel())).long()
            sample += flat[places].float().cpu().tolist()
    return tuple(sample)


def same_weights(one: tuple[Any, Tensor | None], other: tuple[Any, Tensor | None]) -> bool:
    """Whether two loaded drafters (model, mask embedding) are one checkpoint in other precisions: every tensor of
    one name and shape, and every value equal within `SAME_WEIGHTS_RTOL` (`weights_sample` compares a few places of
    each, where the models are not at hand). Their `tensors_sha256` differ wherever a value sits on a bfloat16
    rounding boundary (6% of them after a float16 round trip)."""
    first, second = weights_of(*one), weights_of(*other)
    return first.keys() == second.keys() and all(
        a.shape == b.shape and (torch.allclose(a.float(), b.float(), rtol=SAME_WEIGHTS_RTOL, atol=SAME_WEIGHTS_ATOL)
                                if a.is_floating_point() else torch.equal(a, b))
        for a, b in ((first[name], second[name]) for name in first))


def load_drafter(drafter: EvalDrafter, dtype: torch.dtype) -> tuple[Any, Tensor | None]:
    """z-lab's `DFlashDraftModel` with the folder's weights (every tensor present, nothing left random), and the
    trained mask-token embedding SGLang would merge from a `mask_embedding.pt` beside them."""
    from dflash.model import DFlashDraftModel

    try:
        model, loading = DFlashDraftModel.from_pretrained(drafter.folder, dtype=dtype, output_loading_info=True)
    except Exception as exc:  # what transformers and torch raise for a config or weights they cannot build a model of
        said = (str(exc).splitlines() or [""])[0][:300]
        raise FieldError("drafter", f"{drafter.folder}: does not load ({type(exc).__name__}: {said})") from None
    if loading.get("missing_keys") or loading.get("mismatched_keys"):
        raise FieldError("drafter", f"{drafter.folder}: weights missing or mis-shaped when loaded "
                         f"({sorted(loading.get('missing_keys') or [])[:3]})")
    mask = _mask_embedding(drafter, dtype)
    bad = (name for name, tensor in weights_of(model, mask).items()
           if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()))
    if overflowed := next(bad, None):
        # the files were scanned, but not a mask embedding sidecar, nor values past float16's range
        named = MASK_EMBEDDING if overflowed == _MASK_KEY else overflowed
        raise FieldError("drafter", f"{drafter.folder}: {named} holds NaN or Inf values as loaded in {dtype} "
                         "(a diverged save, or values past its range); nothing is scored on them")
    return model.eval(), mask


def _mask_embedding(drafter: EvalDrafter, dtype: torch.dtype) -> Tensor | None:
    path = drafter.folder / MASK_EMBEDDING
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        embedding, token = saved["embedding"], int(saved["mask_token_id"])
    except Exception as exc:
        raise FieldError("drafter", f"{path} is not a mask embedding SGLang can merge ({exc.__class__.__name__}: "
                         f"{str(exc)[:200]})") from None
    if token != drafter.info.mask_token_id:
        raise FieldError("drafter", f"{path} was trained for mask token {token}, the config's is "
                         f"{drafter.info.mask_token_id}")
    if saved.get("per_position"):
        raise FieldError("drafter", f"{path}: per-position mask embeddings are not supported (SGLang refuses them too)")
    return embedding.reshape(-1).to(dtype)
