"""The target model on this machine: its folder verified, its weights loaded through transformers (Qwen3, and
Qwen3.5/3.6 through `Qwen3_5ForCausalLM`, which reads the vision-language checkpoint's text part), greedy decoding,
and the one teacher-forced forward per task that captures the drafter's tap layers.

Taps are read with forward hooks on the decoder layers the drafter names, so only those layers' outputs are kept
(the output of decoder layer `l` is Hugging Face's `hidden_states[l + 1]`, z-lab's `extract_context_feature`
convention); asking transformers for every hidden state would hold 65 × tokens × 5120 floats for a 27B target. The
target's last layer is never a tap: Hugging Face returns it after the final norm.

    target = load_target(folder, torch.float32)
    taps, agree = teacher_forced(target, ids, prompt_len, taps=(1, 16, 31, 46, 61))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from dfserve.deploy.assets import Target, read_json, read_safetensors_header, target_from_config
from dfserve.deploy.drafters import hf_cache_dir, hf_cached_file
from dfserve.errors import FieldError
from dfserve.eval.scoring import TargetHead

FAMILIES = ("qwen3", "qwen3_5", "qwen3_5_text")
"""Targets z-lab's drafters are made for that transformers loads as causal LMs here."""
EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
LM_HEAD_NAME = "lm_head.weight"
LOGIT_ROWS = 256
"""Positions whose logits are formed at once when checking the target's own greedy choices."""


def target_folder(model: str) -> Path:
    """A local model folder, or the snapshot of a Hugging Face id in the local hub cache: its weights must be here."""
    local = Path(model).expanduser()
    if local.is_dir():
        return local.resolve()
    cached = hf_cached_file(model, "config.json")
    if cached is not None:
        return cached.parent
    raise FieldError("target", f"{model} is neither a model folder nor in the Hugging Face cache ({hf_cache_dir()}); "
                     "the offline evaluation runs the target's weights on this machine")


def describe_target(model: str, folder: Path) -> Target:
    """The target's shapes from its config.json, refused unless it is of a family z-lab's drafters serve."""
    return target_from_config(model, read_json(folder / "config.json", "target"), str(folder / "config.json"), FAMILIES)


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FieldError("target", f"{folder} holds no *.safetensors weights")
    return files


def load_head(folder: Path, target: Target, dtype: torch.dtype) -> TargetHead:
    """The target's input embedding and output head, read from its safetensors files without loading the model
    (a tied head is the embedding)."""
    tables = {name: path for path in weight_files(folder) for name in read_safetensors_header(path, "target")}
    embed_name = next((name for name in EMBED_NAMES if name in tables), None)
    if embed_name is None:
        raise FieldError("target", f"{folder}: no input embedding among the weights (looked for {list(EMBED_NAMES)})")

    def read(name: str) -> Tensor:
        with safe_open(str(tables[name]), framework="pt") as handle:
            tensor: Tensor = handle.get_tensor(name)
        if tuple(tensor.shape) != (target.vocab_size, target.hidden_size):
            raise FieldError("target", f"{tables[name]}: {name} has shape {list(tensor.shape)}, expected "
                             f"{[target.vocab_size, target.hidden_size]}")
        return tensor.to(dtype)

    embed = read(embed_name)
    return TargetHead(embed, read(LM_HEAD_NAME) if LM_HEAD_NAME in tables else embed)


def load_target(folder: Path, dtype: torch.dtype) -> Any:
    """The causal LM in eval mode; a checkpoint missing any tensor the model needs is refused (transformers would
    initialise it at random and say so only in a log line)."""
    from transformers import AutoModelForCausalLM

    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise FieldError("target", f"{folder}: transformers cannot load it ({str(exc).splitlines()[0]})") from None
    model, info = loaded
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(entry[0]) for entry in info.get("mismatched_keys") or [])
    if missing or mismatched:
        first = (missing or mismatched)[0]
        raise FieldError("target", f"{folder}: {len(missing)} tensors missing and {len(mismatched)} mis-shaped in "
                         f"its weights (first: {first}); the checkpoint is incomplete")
    return model.eval()


@torch.inference_mode()
def greedy_step(model: Any, new_tokens: list[int], cache: Any) -> tuple[int, Any]:
    """One forward of greedy decoding with the model's own cache: the next token and the grown cache."""
    out = model(input_ids=torch.tensor([new_tokens]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax()), out.past_key_values


@torch.inference_mode()
def teacher_forced(model: Any, ids: Sequence[int], prompt_len: int, taps: Sequence[int]) -> tuple[dict[int, Tensor], int]:
    """One forward over prompt + reference: each tap layer's output per position ([tokens, hidden]), and at how many
    generated positions the target's own argmax is the reference's next token."""
    decoder = model.model
    captured: dict[int, Tensor] = {}

    def keep(layer: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            captured[layer] = (output[0] if isinstance(output, tuple) else output)[0]
        return hook

    hooks = [decoder.layers[layer].register_forward_hook(keep(layer)) for layer in taps]
    try:
        hidden = decoder(input_ids=torch.tensor([list(ids)]), use_cache=False).last_hidden_state[0]
    finally:
        for hook in hooks:
            hook.remove()
    expected = torch.tensor(list(ids[prompt_len:]))
    agree = 0
    for start in range(prompt_len - 1, len(ids) - 1, LOGIT_ROWS):
        rows = hidden[start:min(start + LOGIT_ROWS, len(ids) - 1)]
        chosen = model.lm_head(rows).argmax(dim=-1)
        agree += int((chosen == expected[start - prompt_len + 1:start - prompt_len + 1 + rows.shape[0]]).sum())
    return captured, agree
