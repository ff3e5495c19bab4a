"""In-house training checkpoint -> Hugging Face DFlash folder that SGLang loads exactly like z-lab's drafter.

Trainers save `checkpoint.pt` with the drafter's state dict nested (`model`, `state_dict`, ...) and prefixed
(`module.`, `draft_model.`) beside optimizer state, or a bare safetensors file. This module finds the state dict,
strips the prefixes, checks every tensor (presence, shape, dtype, NaN/Inf) and writes `config.json` and a bf16
`model.safetensors` with z-lab's names. The output folder is named by the checkpoint's content hash and the config it
is converted with, and appears only by a final rename, so a second conversion of the same checkpoint and config does
nothing (once the folder passes a drafter folder's checks again), another config is another folder, and a failed
conversion leaves nothing::

    result = convert_checkpoint(Path("checkpoint.pt"), store, target, config, arch)
    result.folder  # store/inhouse-<key[:16]>
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dfserve.deploy.assets import (
    DrafterArch,
    Target,
    TensorInfo,
    problems_error,
    read_json,
    read_safetensors_header,
    tensor_table_problems,
)
from dfserve.deploy.drafters import RECORD_NAME, ConversionRecord, seal_problem, verify_folder
from dfserve.deploy.hashes import file_sha256, remember_sha256
from dfserve.errors import FieldError, UserError
from dfserve.runs import read_model, staged_folder, utc_now_iso

WRAPPER_KEYS = ("state_dict", "model", "model_state_dict", "module", "draft_model", "drafter")
"""Keys under which trainers nest the drafter's state dict, tried in this order."""
PREFIXES = ("module.", "draft_model.", "_orig_mod.", "model.")
"""Name prefixes added by DDP (`module.`), trainer wrappers (`draft_model.`) and torch.compile (`_orig_mod.`)."""
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}


@dataclass(frozen=True)
class ConvertResult:
    folder: Path
    sha256: str
    """The checkpoint's content hash."""
    key: str
    """The converted drafter's identity: a hash of the checkpoint's content and the config written beside it."""
    converted: bool


def _is_state_dict(obj: object) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def find_state_dict(obj: object, where: str) -> Mapping[str, torch.Tensor]:
    """The drafter's tensors inside a loaded checkpoint (`where` names it): the object itself or a dict nested under
    `WRAPPER_KEYS`."""
    if _is_state_dict(obj):
        return obj  # type: ignore[return-value]
    if isinstance(obj, Mapping):
        nested: FieldError | None = None
        for key in WRAPPER_KEYS:  # the first that holds one: `model` may be the trainer's config beside it
            if isinstance(obj.get(key), Mapping):
                try:
                    return find_state_dict(obj[key], f"{where}[{key!r}]")
                except FieldError as exc:
                    nested = nested or exc
        if nested is not None:
            raise nested  # what the first wrapper held, named
        others = sorted(str(k) for k, v in obj.items() if not isinstance(v, torch.Tensor))
        if len(others) < len(obj):
            raise FieldError("drafter", f"{where}: {len(obj) - len(others)} tensors beside entries that are not "
                             f"tensors ({', '.join(others[:10])}): not a state dict, nor one under "
                             f"{list(WRAPPER_KEYS)}")
        keys = ", ".join(sorted(map(str, obj))[:10])
        raise FieldError("drafter", f"{where}: no drafter state dict (a dict of tensors) found; keys: {keys}; "
                         f"looked under {list(WRAPPER_KEYS)}")
    raise FieldError("drafter", f"{where}: holds a {type(obj).__name__}, not a state dict")


def strip_prefixes(names: list[str]) -> dict[str, str]:
    """Map each stored name to its z-lab name by removing wrapper prefixes; two names colliding is an error."""
    mapping: dict[str, str] = {}
    for name in names:
        short = name
        while stripped := next((short[len(p):] for p in PREFIXES if short.startswith(p)), None):
            short = stripped
        mapping[name] = short
    collisions = sorted(short for short, count in Counter(mapping.values()).items() if count > 1)
    if collisions:
        raise FieldError("drafter", f"checkpoint tensors {collisions[:5]} appear under more than one prefix")
    return mapping


def load_checkpoint(path: Path) -> Mapping[str, torch.Tensor]:
    """Tensors of a `.safetensors` file, or the state dict inside a torch checkpoint (loaded with weights_only)."""
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except Exception as exc:
            raise FieldError("drafter", f"{path} is not a readable safetensors file ({exc.__class__.__name__}: {exc})") from None
    try:  # mapped, not read whole, where the file allows it: the zip format torch writes since 1.6
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as exc:
        raise FieldError("drafter", f"{path} is not a torch checkpoint that loads with weights_only "
                         f"({exc.__class__.__name__}: {str(exc)[:200]})") from None
    return find_state_dict(obj, str(path))


def nonfinite_problems(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    problems = []
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            nan = int(torch.isnan(tensor).sum())
            inf = int(torch.isinf(tensor).sum())
            if nan or inf:
                problems.append(f"{name} has {nan} NaN and {inf} Inf values")
    return problems


def verify_checkpoint(tensors: Mapping[str, torch.Tensor], arch: DrafterArch) -> list[str]:
    table = {
        name: TensorInfo(DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch.")), tuple(t.shape))
        for name, t in tensors.items()
    }
    return tensor_table_problems(table, arch) + nonfinite_problems(tensors)


def _canonical(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def _check_reused(folder: Path, checkpoint: Path, config: Mapping[str, Any], target: Target,
                  hash_cache: Path | None) -> None:
    """A folder converted before is used again only as it was written: a damaged or edited one is refused, never
    rewritten, since a running engine may load it."""
    try:
        if _canonical(read_json(folder / "config.json", "drafter")) != _canonical(config):
            raise FieldError("drafter", "its config.json is not the one this conversion writes")
        verify_folder(folder, target)
        record = read_model(folder / RECORD_NAME, ConversionRecord, f"no {RECORD_NAME}")
        if (problem := seal_problem(folder, record, hash_cache)) is not None:
            raise FieldError("drafter", problem)
    except UserError as exc:
        said = exc.message if isinstance(exc, FieldError) else str(exc)
        raise FieldError("drafter", f"{folder}, converted earlier from {checkpoint}: {said}; "
                         "remove it to convert again") from None


def _write_folder(folder: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], record: ConversionRecord) -> None:
    bf16 = {name: tensor.to(torch.bfloat16).contiguous() for name, tensor in sorted(tensors.items())}
    save_file(bf16, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    sealed = record.model_copy(update={"weights_sha256": file_sha256(folder / "model.safetensors", remember=False)})
    (folder / RECORD_NAME).write_text(sealed.model_dump_json(indent=2) + "\n", encoding="utf-8")
    written = read_safetensors_header(folder / "model.safetensors")
    if sorted(written) != sorted(bf16) or any(info.dtype != "BF16" for info in written.values()):
        raise UserError(f"conversion: {folder / 'model.safetensors'} does not read back as written")


def _identity(path: Path) -> tuple[int, int, int, int]:
    stat = path.stat()
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def convert_checkpoint(
    checkpoint: Path, store: Path, target: Target, config: Mapping[str, Any], arch: DrafterArch,
    hash_cache: Path | None = None,
) -> ConvertResult:
    """Convert once per checkpoint content and config; a folder converted from both before is reused after the
    checks a drafter folder gets."""
    if not checkpoint.is_file():
        raise FieldError("drafter", f"{checkpoint} is not a file")
    before = _identity(checkpoint)
    digest = file_sha256(checkpoint, hash_cache, remember=False)
    written = {**config, "dtype": "bfloat16"}
    key = hashlib.sha256(f"{digest}\0{_canonical(written)}".encode()).hexdigest()
    folder = store / f"inhouse-{key[:16]}"
    if folder.is_dir():
        _check_reused(folder, checkpoint, written, target, hash_cache)
        remember_sha256(checkpoint, hash_cache, digest)
        return ConvertResult(folder, digest, key, converted=False)
    stored = load_checkpoint(checkpoint)
    renamed = strip_prefixes(list(stored))
    tensors = {renamed[name]: tensor for name, tensor in stored.items()}
    problems = verify_checkpoint(tensors, arch)
    if problems:
        raise problems_error(f"{checkpoint} (against target {target.model_path})", problems, field="drafter")
    record = ConversionRecord(
        source=str(checkpoint.resolve()), sha256=digest, tensors=len(tensors),
        renamed={old: new for old, new in renamed.items() if old != new}, created_at=utc_now_iso(),
        torch_version=torch.__version__,
    )
    with staged_folder(folder) as tmp:  # another conversion of the same bytes may win the race: its folder stays
        _write_folder(tmp, tensors, written, record)
        if _identity(checkpoint) != before:  # its tensors are read as they are written: from the file as it is now
            raise FieldError("drafter", f"{checkpoint} changed while it was converted (a trainer saved over it): its "
                             "weights would be stored under the hash of other bytes; convert it again")
    remember_sha256(checkpoint, hash_cache, digest)
    return ConvertResult(folder, digest, key, converted=True)
