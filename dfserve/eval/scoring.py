"""A drafter's drafts at many anchors of one sequence in one forward pass, with z-lab's `DFlashDraftModel` layers.

Online, the drafter sees the target's projected features of every token before the anchor as extra keys and
values, and a block `[z[a], MASK × (B-1)]` at positions `a .. a+B-1`. Those context keys do not depend on the
anchor, so many blocks share one context: keys and values are `[context | block_0 | block_1 | ...]` and each block
attends to the context strictly before its anchor and to itself, through a mask per layer kind that honours each
layer's causality and sliding window exactly as z-lab's `_attention_mask` does for one block (sliding layers
causal inside the block, full layers bidirectional, a config `is_causal` overriding both). RoPE positions are
absolute (`a + offset`). `anchors_per_forward=1` runs z-lab's own forward once per anchor instead: the reference
the batched path is tested against.

    scores = score_anchors(model, head, features, tokens, anchors, top_k=8, anchors_per_forward=32)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from dflash.model import DFlashDraftModel
from numpy.typing import NDArray
from torch import Tensor
from torch.nn import functional as F

LayerKind = tuple[bool, int | None]
"""A drafter attention layer's (is_causal, sliding_window)."""


@dataclass(frozen=True)
class TargetHead:
    """The target's input embedding and output head: a DFlash drafter has neither of its own."""

    embed: Tensor
    lm_head: Tensor

    def logits(self, hidden: Tensor) -> Tensor:
        """Through one 2-D matrix product: a strided 3-D input (block rows 1..B-1) would broadcast the head into a
        batched product at about half the speed."""
        return F.linear(hidden.reshape(-1, hidden.shape[-1]), self.lm_head).reshape(*hidden.shape[:-1], -1)


@dataclass(frozen=True)
class AnchorScores:
    """Per scored anchor: the greedy draft of block positions 1..B-1 and each position's top-k tokens with their
    log-probabilities (temperature 1, for DDTree)."""

    anchors: NDArray[np.int64]
    drafts: NDArray[np.int64]
    top_ids: NDArray[np.int64]
    top_logprobs: NDArray[np.float32]


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """torch computes with `threads` CPU threads inside (None: as it was), and as before after; yields the count.
    On a machine others share, fewer threads than cores keep their pace: torch's default (one per core) waits at
    every parallel step for the thread that lost its core, several times slower than one thread alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def layer_kinds(model: DFlashDraftModel) -> list[LayerKind]:
    """Each drafter layer's attention rule, as z-lab's attention module decided it from the config."""
    return [(bool(layer.self_attn.is_causal), layer.self_attn.sliding_window) for layer in model.layers]


def block_mask(anchors: Tensor, block_size: int, context: int, kind: LayerKind) -> Tensor:
    """Which keys `[context (positions 0..context-1) | block per anchor]` each block row sees: bool, [1, 1, Q, K]."""
    causal, window = kind
    n = anchors.shape[0]
    offsets = torch.arange(block_size)
    query_pos = (anchors[:, None] + offsets[None, :]).reshape(-1, 1)
    query_block = torch.arange(n).repeat_interleave(block_size)[:, None]
    ctx_pos = torch.arange(context)[None, :]
    sees_ctx = ctx_pos < anchors.repeat_interleave(block_size)[:, None]
    if window is not None:
        sees_ctx &= query_pos - ctx_pos < window
    key_pos = query_pos.reshape(1, -1)
    sees_block = query_block == query_block.reshape(1, -1)
    if causal:
        sees_block &= key_pos <= query_pos
    if window is not None:
        sees_block &= query_pos - key_pos < window
        if not causal:
            sees_block &= key_pos - query_pos < window
    return torch.cat([sees_ctx, sees_block], dim=1)[None, None]


def block_embeddings(head: TargetHead, tokens: Tensor, anchors: Tensor, block_size: int, mask_token_id: int,
                     scale: float, mask_embedding: Tensor | None) -> Tensor:
    """`[z[a], MASK × (B-1)]` per anchor through the target's embedding (and a trained mask row, if the drafter
    ships one), flattened to [1, n·B, hidden]."""
    ids = torch.full((anchors.shape[0], block_size), mask_token_id, dtype=torch.long)
    ids[:, 0] = tokens[anchors]
    embedded = F.embedding(ids, head.embed) * scale
    if mask_embedding is not None:
        embedded[:, 1:] = mask_embedding.to(embedded.dtype)
    return embedded.reshape(1, -1, embedded.shape[-1])


def project_context(model: DFlashDraftModel, features: Tensor) -> Tensor:
    """z-lab's `hidden_norm(fc(features))`: the context every drafter layer reads its extra keys and values from. It
    depends on no anchor, so one projection of a whole sequence serves every block (the drafter's largest matrix)."""
    return model.hidden_norm(model.fc(features))


def draft_hidden(model: DFlashDraftModel, context: Tensor, blocks: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """The drafter's final hidden states of every block row, [n, B, hidden]: z-lab's `DFlashDraftModel.forward`
    with one mask per layer kind instead of one for all layers. `context` is the projected target features of
    positions 0..T-1 ([1, T, hidden], `project_context`); gradients flow (training uses it too)."""
    positions = torch.cat([torch.arange(context.shape[1]),
                           (anchors[:, None] + torch.arange(block_size)[None, :]).reshape(-1)])[None]
    position_embeddings = model.rotary_emb(blocks, positions)
    masks: dict[LayerKind, Tensor] = {}
    hidden = blocks
    for layer, kind in zip(model.layers, layer_kinds(model), strict=True):
        if kind not in masks:
            masks[kind] = block_mask(anchors, block_size, context.shape[1], kind)
        hidden = layer(hidden_states=hidden, target_hidden=context, attention_mask=masks[kind],
                       position_embeddings=position_embeddings)
    return model.norm(hidden).reshape(anchors.shape[0], block_size, -1)


def _one_by_one(model: DFlashDraftModel, context: Tensor, blocks: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    rows = []
    for index, anchor in enumerate(anchors.tolist()):
        block = blocks[:, index * block_size:(index + 1) * block_size]
        rows.append(model(position_ids=torch.arange(anchor + block_size)[None], noise_embedding=block,
                          target_hidden=context[:, :anchor])[0])
    return torch.stack(rows)


@torch.inference_mode()
def score_anchors(
    model: DFlashDraftModel, head: TargetHead, features: Tensor, tokens: Tensor, anchors: Tensor, *, top_k: int,
    anchors_per_forward: int, block_size: int | None = None, mask_embedding: Tensor | None = None,
    on_forward: Callable[[int], None] | None = None,
) -> AnchorScores:
    """Drafts and top-k log-probabilities at `anchors` of one sequence (`tokens`, with its target `features` in the
    drafter's tap order), in blocks of the drafter's size unless `block_size` says otherwise. `on_forward(n)` is
    told after each forward how many anchors it scored."""
    block_size = block_size or int(model.block_size)
    config = model.config
    scale = float(getattr(config, "dflash_config", {}).get("input_embedding_scale",
                                                           getattr(config, "input_embedding_scale", 1.0)))
    drafts, top_ids, top_logprobs = [], [], []
    context = features[None, :int(anchors.max())].to(head.embed.dtype)
    projected = project_context(model, context) if anchors_per_forward > 1 else None
    for start in range(0, anchors.shape[0], anchors_per_forward):
        chunk = anchors[start:start + anchors_per_forward]
        blocks = block_embeddings(head, tokens, chunk, block_size, int(model.mask_token_id), scale, mask_embedding)
        if projected is not None:
            hidden = draft_hidden(model, projected[:, :int(chunk.max())], blocks, chunk, block_size)
        else:
            hidden = _one_by_one(model, context, blocks, chunk, block_size)
        logits = model.compute_logits(hidden[:, 1:], head.logits).float()
        drafts.append(torch.argmax(logits, dim=-1))
        values, ids = torch.topk(logits, k=min(top_k, logits.shape[-1]), dim=-1)
        top_logprobs.append(values - torch.logsumexp(logits, dim=-1, keepdim=True))
        top_ids.append(ids)
        if on_forward is not None:
            on_forward(int(chunk.shape[0]))
    return AnchorScores(anchors.numpy().astype(np.int64), torch.cat(drafts).numpy(), torch.cat(top_ids).numpy(),
                        torch.cat(top_logprobs).numpy().astype(np.float32))
