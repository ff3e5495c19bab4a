"""What a target and a DFlash drafter are, read from their files and checked against each other: config facts,
z-lab's tensor table, safetensors headers and a NaN/Inf scan of their raw bits (numpy, no torch).

Every problem is collected and named in one error before anything loads weights; deploy (before SGLang starts) and
eval (before the first forward) run the same checks::

    target = target_from_config("Qwen/Qwen3.6-27B", config, "config.json", ["qwen3_5"])
    arch = verify_drafter_config(drafter_config, target)
    problems = tensor_table_problems(read_safetensors_header(path), arch)
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dfserve.errors import FieldError, UserError
from dfserve.regular_files import open_regular, read_regular

DRAFTER_ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
MAX_PROBLEMS_SHOWN = 8


def problems_error(what: str, problems: list[str], field: str | None = None) -> UserError:
    """One line naming every problem (the first few, then how many more), about `field` when an input is to blame."""
    shown = "; ".join(problems[:MAX_PROBLEMS_SHOWN])
    more = f"; and {len(problems) - MAX_PROBLEMS_SHOWN} more" if len(problems) > MAX_PROBLEMS_SHOWN else ""
    message = f"{what}: {len(problems)} problem(s): {shown}{more}"
    return UserError(message) if field is None else FieldError(field, message)


def read_json(path: Path, field: str) -> dict[str, Any]:
    """A JSON object from a file the input `field` named; any problem is a `FieldError` about that field."""
    try:
        data = json.loads(read_regular(path).decode("utf-8"))
    except FileNotFoundError:
        raise FieldError(field, f"{path} not found") from None
    except (OSError, ValueError) as exc:  # ValueError: also not UTF-8, or an integer of over 4300 digits
        raise FieldError(field, f"{path} is not a readable JSON file ({exc})") from None
    except RecursionError:
        raise FieldError(field, f"{path} is not a readable JSON file (nested too deeply)") from None
    if not isinstance(data, dict):
        raise FieldError(field, f"{path} must hold a JSON object")
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


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def _positive_int(config: Mapping[str, Any], key: str, where: str, problems: list[str]) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        problems.append(f"{where}{key} must be a positive integer, got {value!r}")
        return 0
    return value


def target_from_config(model_path: str, config: Mapping[str, Any], source: str, families: Sequence[str]) -> Target:
    """Check the target's config is of one of `families` and read the shapes a drafter must match."""
    problems: list[str] = []
    text = text_config(config)
    family = str(text.get("model_type") or config.get("model_type") or "")
    if not {str(config.get("model_type")), family} & set(families):
        problems.append(f"model_type {family or None!r} is not one of {list(families)}")
    prefix = "text_config." if text is not config else ""
    hidden = _positive_int(text, "hidden_size", prefix, problems)
    layers = _positive_int(text, "num_hidden_layers", prefix, problems)
    vocab = _positive_int(text, "vocab_size", prefix, problems)
    if problems:
        raise problems_error(f"target config ({source})", problems)
    return Target(model_path, source, family, hidden, layers, vocab)


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
    head_dim_given: bool = True
    """config.json names its `head_dim` (else transformers' default was taken: tensors that do not fit say so)."""


MAX_BLOCK_SIZE = 1024
"""Past any DFlash block (z-lab's are 16): a larger one is a broken config, whose masks would not fit in memory."""
MAX_LAYERS = 1024
"""Past any drafter's depth (z-lab's have a few layers): a larger count is a broken config."""


QWEN3_HEAD_DIM = 128
QWEN3_SLIDING_WINDOW = 4096
QWEN3_MAX_WINDOW_LAYERS = 28
"""What transformers' `Qwen3Config` (which z-lab's code and SGLang both load a drafter's config.json into) gives a
`model_type: qwen3` config without `head_dim`, a sliding window without `sliding_window`, and the first layer it
makes sliding without `max_window_layers`."""


def sliding_window(config: Mapping[str, Any]) -> object:
    """The window of a drafter's `sliding_attention` layers as `Qwen3Config` resolves it: None unless
    `use_sliding_window` is true (transformers refuses anything but a bool there), whatever `sliding_window` says."""
    return config.get("sliding_window", QWEN3_SLIDING_WINDOW) if config.get("use_sliding_window") is True else None


def drafter_layer_types(config: Mapping[str, Any], num_hidden_layers: int) -> list[str]:
    """Each layer's attention type as `Qwen3Config` resolves it, so that deploy checks and eval describes the layers
    z-lab's code and SGLang build: `layer_types` as given, else sliding from `max_window_layers` on when there is a
    window. For a config `verify_drafter_config` passed."""
    given = config.get("layer_types")
    if given is not None:
        return list(given)
    first_sliding = config.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
    windowed = sliding_window(config) is not None
    return ["sliding_attention" if windowed and layer >= first_sliding else "full_attention"
            for layer in range(num_hidden_layers)]


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def verify_drafter_config(config: Mapping[str, Any], target: Target, source: str = "drafter config",
                          field: str | None = None) -> DrafterArch:
    """Check a DFlash config.json (read from `source`) against its target; every problem is named in one
    `UserError`, a `FieldError` on `field` when an input given is to blame."""
    problems: list[str] = []
    if DRAFTER_ARCHITECTURE not in (config.get("architectures") or []):
        problems.append(f"architectures must include {DRAFTER_ARCHITECTURE!r}, got {config.get('architectures')!r}")
    ints = {
        key: _positive_int(config, key, "", problems)
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size", "num_target_layers")
    }
    head_dim_given = "head_dim" in config
    if head_dim_given:
        head_dim = config["head_dim"]
    elif config.get("model_type") == "qwen3":
        head_dim = QWEN3_HEAD_DIM
    else:
        head_dim = ints["hidden_size"] // ints["num_attention_heads"] if ints["num_attention_heads"] else None
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        problems.append(f"head_dim must be a positive integer, got {head_dim!r}")
        head_dim = 0
    dflash = config.get("dflash_config")
    if not isinstance(dflash, Mapping):
        problems.append("dflash_config is missing")
        dflash = {}
    block_size = dflash.get("block_size", config.get("block_size", 16))
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= MAX_BLOCK_SIZE:
        problems.append(f"block_size must be an integer from 2 to {MAX_BLOCK_SIZE}, got {block_size!r}")
        block_size = 0
    if ints["num_hidden_layers"] > MAX_LAYERS:
        problems.append(f"num_hidden_layers must be at most {MAX_LAYERS}, got {ints['num_hidden_layers']}")
        ints["num_hidden_layers"] = 0
    if ints["num_key_value_heads"] and ints["num_attention_heads"] % ints["num_key_value_heads"]:
        problems.append(f"num_attention_heads {ints['num_attention_heads']} is not a multiple of num_key_value_heads "
                        f"{ints['num_key_value_heads']}")
    layer_ids = dflash.get("target_layer_ids")
    if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids):
        problems.append(f"dflash_config.target_layer_ids must be a non-empty list of integers, got {layer_ids!r}")
        layer_ids = []
    elif bad := [i for i in layer_ids if not 0 <= i < target.num_hidden_layers]:
        problems.append(f"dflash_config.target_layer_ids {bad} outside the target's {target.num_hidden_layers} layers")
    elif target.num_hidden_layers - 1 in layer_ids:
        problems.append(f"dflash_config.target_layer_ids include the target's last layer ({target.num_hidden_layers - 1}), "
                        "whose output Hugging Face and SGLang expose only after the final norm")
    mask = dflash.get("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        problems.append(f"dflash_config.mask_token_id must be a token id below {target.vocab_size}, got {mask!r}")
    for key, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size),
                      ("num_target_layers", target.num_hidden_layers)):
        if ints[key] and ints[key] != want:
            problems.append(f"{key} {ints[key]} does not match the target's {want}")
    use_window = config.get("use_sliding_window", False)
    if not isinstance(use_window, bool):
        problems.append(f"use_sliding_window must be true or false, got {use_window!r}")
    first_sliding = config.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
    if type(first_sliding) is not int:
        problems.append(f"max_window_layers must be an integer, got {first_sliding!r}")
    layer_types = config.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != ints["num_hidden_layers"]):
        problems.append(f"layer_types must list one type per layer ({ints['num_hidden_layers']}), got {layer_types!r}")
    elif layer_types is not None and (unknown := sorted({t for t in layer_types if t not in LAYER_TYPES})):
        problems.append(f"layer_types {unknown} not in {list(LAYER_TYPES)}")
    elif (isinstance(use_window, bool) and type(first_sliding) is int
          and "sliding_attention" in drafter_layer_types(config, ints["num_hidden_layers"])):
        if not use_window:
            problems.append("sliding_attention layers without use_sliding_window: true get no window (transformers' "
                            "config, which z-lab's code and SGLang read, drops sliding_window then, and SGLang "
                            "refuses to start)")
        elif not _count(window := sliding_window(config)):
            problems.append(f"sliding_attention layers need a sliding_window of 1 token at least, got {window!r}")
    if problems:
        raise problems_error(source, problems, field)
    return DrafterArch(
        ints["hidden_size"], ints["intermediate_size"], ints["num_hidden_layers"], ints["num_attention_heads"],
        ints["num_key_value_heads"], head_dim, ints["vocab_size"], block_size, len(layer_ids),
        head_dim_given=head_dim_given,
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


def tensor_table_problems(found: Mapping[str, TensorInfo], arch: DrafterArch) -> list[str]:
    """Missing, unexpected, mis-shaped and non-float tensors against `arch`'s, each named."""
    expected = expected_tensors(arch)
    problems = [f"missing tensor {name}" for name in expected if name not in found]
    problems += [f"unexpected tensor {name}" for name in found if name not in expected]
    for name, info in found.items():
        if name in expected and info.shape != expected[name]:
            problems.append(f"{name} has shape {list(info.shape)}, expected {list(expected[name])}")
        if info.dtype not in FLOAT_DTYPES:
            problems.append(f"{name} has dtype {info.dtype}, expected a floating-point type")
    if not arch.head_dim_given and any(name in found and found[name].shape != shape for name, shape in expected.items()):
        problems.insert(0, f"config.json has no head_dim, which transformers (and so z-lab's code and SGLang) then "
                        f"take as {arch.head_dim}: set it")
    return problems


def read_safetensors_header(path: Path, field: str = "drafter") -> dict[str, TensorInfo]:
    """Tensor names, dtypes, shapes and byte ranges from a safetensors header, without reading the data; a header
    that is not one (torn, not JSON, entries of the wrong shape), or data past the file's end (a truncated copy), is
    a `FieldError` about `field` naming the file."""
    try:
        with open_regular(path) as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100_000_000:
                raise ValueError("header length implausible")
            header = json.loads(handle.read(length))
            size = os.fstat(handle.fileno()).st_size
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        start = 8 + length
        table = {name: _tensor_info(name, entry, start) for name, entry in header.items() if name != "__metadata__"}
        if (end := max((info.data_offsets[1] for info in table.values() if info.data_offsets), default=0)) > size:
            raise ValueError(f"its tensors end at byte {end}, the file at {size}: truncated")
        return table
    except (OSError, struct.error, ValueError, RecursionError) as exc:
        raise FieldError(field, f"{path} is not a safetensors file ({exc.__class__.__name__}: {exc})") from None


def _tensor_info(name: str, entry: object, start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise ValueError(f"{name}: not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise ValueError(f"{name}: dtype is not a string")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"{name}: shape is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"{name}: data_offsets is not [begin, end]")
    size = _DTYPE_BYTES.get(dtype)
    if size is not None and offsets[1] - offsets[0] != math.prod(shape) * size:
        raise ValueError(f"{name}: data_offsets span {offsets[1] - offsets[0]} bytes, its {dtype} shape {shape} "
                         f"needs {math.prod(shape) * size}")
    return TensorInfo(dtype, tuple(shape), (start + offsets[0], start + offsets[1]))


_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
"""Bytes per element of safetensors' dtypes."""


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
