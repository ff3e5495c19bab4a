"""What an evaluation writes: config.json (every setting and hash), one anchor record per scored anchor
(anchors.jsonl), summary.json, and the offline verdict of one drafter against another.

A method is how a round is drafted: `vanilla` (the block's greedy drafts) or `ddtreeN` (a DDTree of N nodes). An
anchor record holds what each method accepts at that anchor and, for the methods whose online trajectory makes a
round there, that round's τ; so every figure of the summary can be recomputed from the records alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dfserve.runs import Provenance, SealedSummary
from dfserve.verdict.results import Figure, Judgement
from dfserve.verdict.wording import differences, shown

Finish = Literal["eos", "length"]
VANILLA = "vanilla"


def ddtree_method(budget: int) -> str:
    return f"ddtree{budget}"


def metric_of(method: str) -> str:
    """The gate metric of a method's τ: `tau_vanilla`, `tau_ddtree8`."""
    return f"tau_{method}"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetInfo(_Model):
    model: str = Field(description="the target as given: a Hugging Face id or a local folder")
    folder: str
    sha256: str = Field(description="content hash of the folder's config, tokenizer and weight files")
    family: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int


class PromptSettings(_Model):
    format: Literal["chat", "raw"] = Field(description="chat: the target's chat template; raw: the text as is")
    thinking: bool = Field(description="enable_thinking passed to the chat template")
    template_sha256: str | None = Field(description="hash of the chat template used; None for raw prompts")


class TaskInfo(_Model):
    id: str
    prompt_tokens: int
    output_tokens: int
    finish: Finish


class TaskSetInfo(_Model):
    name: str
    sha256: str
    tasks: tuple[TaskInfo, ...]


class ReferenceInfo(_Model):
    """Where the greedy completions came from and the cache file holding them."""

    source: str = Field(description="'local' (the target here) or the SGLang server's URL")
    server_model: str | None = Field(None, description="/server_info model_path of the SGLang server")
    key: str
    path: str
    reused: bool
    created_at: str


class Health(_Model):
    """The target's own teacher-forced argmax against the reference: about 1.0 when features and tokens line up."""

    agree: int
    positions: int
    fraction: float
    warning: str | None


class FeatureInfo(_Model):
    key: str
    path: str
    taps: tuple[int, ...]
    reused: bool = Field(description="True when a cache built earlier served this run: no target forward ran")
    built_at: str
    built_by: str = Field(description="the run that built the cache")
    build_s: float
    health: Health


SAME_WEIGHTS_RTOL = 2.0**-7
"""Twice bfloat16's rounding error: one checkpoint in float32, float16 and bfloat16 agrees within it everywhere, and
two checkpoints a training step apart do not (an optimizer step moves weights near zero by far more)."""
SAME_WEIGHTS_ATOL = 2.0**-24
"""float16's smallest step: below 2^-14 it keeps less than its 11 bits (a 1024x1024 tensor of std 0.02 holds about
150 values that small)."""


def same_values(one: Sequence[float], other: Sequence[float]) -> bool:
    """Equal within `SAME_WEIGHTS_RTOL` and `SAME_WEIGHTS_ATOL`, place by place (`torch.allclose`'s rule)."""
    return len(one) == len(other) and all(
        abs(a - b) <= SAME_WEIGHTS_ATOL + SAME_WEIGHTS_RTOL * abs(b) for a, b in zip(one, other, strict=True))


class DrafterInfo(_Model):
    label: str
    kind: Literal["zlab", "folder", "checkpoint"]
    identity: str = Field(description="the name the baseline registry and `dfserve compare` know it by")
    source: str = Field(description="what was given: zlab, a checkpoint, a folder")
    folder: str = Field(description="the Hugging Face DFlash folder evaluated")
    sha256: str | None = Field(description="hash of the checkpoint's content and the config it is converted with, "
                               "or of the folder's files")
    converted: bool
    staged: str | None = Field(description="hard link of the checkpoint inside the run folder")
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    layers: tuple[str, ...] = Field(description="each layer's attention: causal/bidirectional and its window")
    mask_embedding: bool = Field(description="a trained mask_embedding.pt sidecar replaced the mask token's row")
    weights_sha256: str | None = Field(None, description="hash of the weight bytes however given: the checkpoint "
                                       "file (or the one a dfserve-converted folder was made from), else the "
                                       "folder's .safetensors files; None: recorded before this field")
    tensors_sha256: str | None = Field(None, description="hash of the weights as loaded for scoring (each tensor's "
                                       "name, dtype, shape and values, rounded to bfloat16 as deployed): one model "
                                       "however its files were laid out; None: recorded before this field")
    weights_sample: tuple[float, ...] | None = Field(None, description="the weights as loaded at fixed places (evenly "
                                                     "spaced in each tensor, by name): one checkpoint saved in "
                                                     "another precision, whose hashes differ, agrees within "
                                                     "bfloat16's rounding; None: recorded before this field")

    def checkpoint_shared_with(self, other: DrafterInfo) -> str | None:
        """What proves two drafters one checkpoint: one `sha256` (weights and config), or, scored as the same
        architecture, the same weight bytes or loaded tensors (z-lab's folder and its weights given as a checkpoint
        file, a `module.`-prefixed copy) or weights that agree within bfloat16's rounding (a copy saved in float16).
        None when they differ or a hash is missing: nothing proves them one."""
        if self.sha256 is not None and self.sha256 == other.sha256:
            return f"sha256 {shown(self.sha256)}"
        if self._architecture() != other._architecture():
            return None
        for mine, theirs in ((self.weights_sha256, other.weights_sha256), (self.tensors_sha256, other.tensors_sha256)):
            if mine is not None and mine == theirs:
                return f"sha256 {shown(mine)}"
        if self.weights_sample is not None and other.weights_sample is not None and same_values(
                self.weights_sample, other.weights_sample):
            return "its weights in other precisions"
        return None

    def _architecture(self) -> tuple[object, ...]:
        return self.block_size, self.target_layer_ids, self.mask_token_id, self.layers, self.mask_embedding


class EvalConfig(_Model):
    schema_version: Literal[1] = 1
    kind: Literal["eval-run"] = "eval-run"
    run_id: str
    target: TargetInfo
    prompt: PromptSettings
    tasks: TaskSetInfo
    max_new_tokens: int
    block_size: int | None = Field(description="the block size every drafter was scored with; None: each its own")
    ddtree_budgets: tuple[int, ...]
    dtype: str
    anchors_per_forward: int
    threads: int | None = Field(None, description="CPU threads torch computed with (None: recorded before this field)")
    drafters: tuple[DrafterInfo, ...]
    references: ReferenceInfo
    features: FeatureInfo
    versions: dict[str, str]
    provenance: Provenance

    def methods(self) -> list[str]:
        return [VANILLA, *(ddtree_method(b) for b in self.ddtree_budgets)]

    def comparable_with(self, other: EvalConfig) -> list[str]:
        """What differs between two runs beyond their drafters; empty when they may be paired by task."""
        problems = [f"{line} (target, tasks, prompts, references or taps differ)"
                    for line in differences("feature cache", self.features.key, other.features.key)]
        return problems + [line for field in ("block_size", "max_new_tokens", "dtype")
                           for line in differences(field, getattr(self, field), getattr(other, field))]


class AnchorRecord(_Model):
    drafter: str
    task: str
    anchor: int
    matches: str = Field(description="'1'/'0' per block position 1, 2, ... that has a reference token")
    accepted: dict[str, int] = Field(description="drafts each method accepts here (before the end-of-reference cap)")
    rounds: dict[str, int] = Field(description="τ of the round each method's online trajectory makes here")


class MethodSummary(_Model):
    method: str
    tau: Figure = Field(description="Σ tokens / Σ rounds along the online trajectory, 95% bootstrap over tasks; n rounds")
    accepted_drafts: float = Field(description="τ - 1: drafts accepted per round, the older 'streak' figure")
    tau_task_mean: float = Field(description="mean over tasks of each task's τ (z-lab's benchmark average)")
    tau_as_sglang: float = Field(description="(Σ tokens + the first token of each task) / Σ rounds, as SGLang's "
                                 "spec_accept_length counts; compare this one with online τ")
    tokens: int
    rounds: int
    capped_rounds: int = Field(description="rounds cut by the end of the reference (EOS or max_new_tokens)")
    per_task: dict[str, float]
    histogram: list[int] = Field(description="rounds by τ: index k counts rounds that committed k tokens")


class PositionCurve(_Model):
    """Accuracy of each block position's draft over every scored anchor (position 1 first)."""

    accuracy: list[float | None]
    n: list[int]
    accuracy_after_hits: list[float | None] = Field(description="given every earlier position matched")
    n_after_hits: list[int]


class DrafterSummary(_Model):
    drafter: str
    anchors: int
    methods: tuple[MethodSummary, ...]
    positions: PositionCurve

    def method(self, name: str) -> MethodSummary:
        return next(m for m in self.methods if m.method == name)


class EvalSummary(SealedSummary):
    schema_version: Literal[1] = 1
    kind: Literal["eval-summary"] = "eval-summary"
    run_id: str
    interrupted: bool
    drafters: tuple[DrafterSummary, ...]
    judgements: tuple[Judgement, ...] = Field(description="each later drafter against the first, paired by task")
    records_sha256: str | None = Field(None, description="sha256 of anchors.jsonl as written (`runs.unsealed`): a "
                                       "record edited since shows, whatever figures are kept")
    config_sha256: str | None = Field(None, description="sha256 of config.json as written: the drafters, cache and "
                                      "settings a verdict pairs two runs on; None in a summary older than this seal")
