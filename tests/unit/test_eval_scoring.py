"""Many anchors in one drafter forward equal z-lab's own forward run once per anchor, for every kind of layer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from dflash.model import DFlashDraftModel
from transformers import Qwen3Config

from dfserve.eval.drafters import _layers
from dfserve.eval.scoring import TargetHead, block_mask, layer_kinds, score_anchors
from tests.fixtures.eval.models import one_thread

VOCAB, HIDDEN = 96, 32


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


def drafter(**changes: Any) -> DFlashDraftModel:
    torch.manual_seed(0)
    config = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512,
              "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "sliding_window": 6,
              "use_sliding_window": True, "block_size": 5, "num_target_layers": 6,
              "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3]}, **changes}
    model = DFlashDraftModel(Qwen3Config(**config)).eval()
    with torch.no_grad():  # post_init leaves norms at 1 and projections small: spread them so every mask matters
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    return model


@pytest.mark.parametrize("changes", [{}, {"is_causal": True}, {"is_causal": False}, {"sliding_window": 64}],
                         ids=["zlab-layout", "all-causal", "all-bidirectional", "window-wider-than-context"])
def test_batched_anchors_equal_zlab_forward_per_anchor(changes: dict[str, Any]) -> None:
    model = drafter(**changes)
    generator = torch.Generator().manual_seed(1)
    head = TargetHead(torch.randn(VOCAB, HIDDEN, generator=generator), torch.randn(VOCAB, HIDDEN, generator=generator))
    tokens = torch.randint(0, VOCAB - 1, (40,), generator=generator)
    features = torch.randn(40, 2 * HIDDEN, generator=generator)
    anchors = torch.arange(3, 39)
    batched = score_anchors(model, head, features, tokens, anchors, top_k=4, anchors_per_forward=16)
    reference = score_anchors(model, head, features, tokens, anchors, top_k=4, anchors_per_forward=1)
    assert (batched.drafts == reference.drafts).all()
    assert (batched.top_ids == reference.top_ids).all()
    assert abs(batched.top_logprobs - reference.top_logprobs).max() < 1e-4
    other_tail = tokens.clone()
    other_tail[30:] = (other_tail[30:] + 1) % (VOCAB - 1)
    moved = score_anchors(model, head, features, other_tail, anchors[:20], top_k=1, anchors_per_forward=8)
    assert (moved.drafts == batched.drafts[:20]).all()  # anchors before 23 never see tokens from 30 on


def test_the_mask_of_two_blocks() -> None:
    """Anchors 2 and 4, blocks of 3, 5 context positions: context strictly before each anchor; inside a block causal
    with a window of 3 (sliding layer) or everything (full layer); never the other block."""
    sliding = block_mask(torch.tensor([2, 4]), 3, 5, (True, 3))[0, 0].int().tolist()
    assert sliding == [
        # ctx 0..4     block@2    block@4
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0],   # position 3: window 3 keeps positions 1..3
        [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],   # position 4: positions 2..4, all in its block
        [0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0],   # anchor 4: context 2..3 within the window, never 4 itself
        [0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]
    full = block_mask(torch.tensor([2, 4]), 3, 5, (False, None))[0, 0].int().tolist()
    assert full[0] == [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0] and full[5] == [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]


def test_layer_kinds_follow_zlab_and_sglang_for_the_qwen36_layout() -> None:
    """z-lab's dflash 0.1.0 and SGLang 0.5.23 (`_get_dflash_layer_attention_params`) agree: sliding layers are causal
    with their window, the full layer is bidirectional, a config `is_causal` overrides both. If dflash changes,
    this test says so before any figure does."""
    assert layer_kinds(drafter()) == [(True, 6), (True, 6), (False, None)]
    assert layer_kinds(drafter(is_causal=False)) == [(False, 6), (False, 6), (False, None)]


def test_a_run_describes_the_layers_zlab_builds_when_the_config_lists_none() -> None:
    """Without `layer_types`, transformers' `Qwen3Config` makes layers from `max_window_layers` on sliding: the
    layers a run's record names are those z-lab's model then has."""
    config = {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1,
              "layer_types": None}
    built = tuple(("causal" if causal else "bidirectional") + ("" if window is None else f", window {window}")
                  for causal, window in layer_kinds(drafter(**config)))
    assert _layers(config) == built
    assert _layers(config) == ("bidirectional", "causal, window 6", "causal, window 6")


def test_a_trained_mask_embedding_replaces_the_mask_rows() -> None:
    model = drafter()
    generator = torch.Generator().manual_seed(2)
    head = TargetHead(torch.randn(VOCAB, HIDDEN, generator=generator), torch.randn(VOCAB, HIDDEN, generator=generator))
    tokens = torch.randint(0, VOCAB - 1, (20,), generator=generator)
    features = torch.randn(20, 2 * HIDDEN, generator=generator)
    anchors = torch.arange(4, 19)
    plain = score_anchors(model, head, features, tokens, anchors, top_k=1, anchors_per_forward=8)
    same = score_anchors(model, head, features, tokens, anchors, top_k=1, anchors_per_forward=8,
                         mask_embedding=head.embed[VOCAB - 1])
    trained = score_anchors(model, head, features, tokens, anchors, top_k=1, anchors_per_forward=8,
                            mask_embedding=torch.randn(HIDDEN, generator=generator) * 5)
    assert (plain.drafts == same.drafts).all() and not (plain.drafts == trained.drafts).all()
