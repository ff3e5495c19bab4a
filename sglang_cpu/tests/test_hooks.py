"""The platform's answers and the hooks, on the SGLang classes they change."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from dfserve_sglang_cpu import hooks
from dfserve_sglang_cpu.platform import DflashCpuPlatform
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from torch.nn.functional import scaled_dot_product_attention

HEADS, DIM, DRAFT = 2, 8, 4


def test_the_platform_is_out_of_tree_and_admits_dflash_with_a_torch_native_drafter_only() -> None:
    platform = DflashCpuPlatform()
    assert platform.is_out_of_tree() and platform.device_name == "cpu"
    assert platform.supports_speculative_algorithm("DFLASH") and not platform.supports_speculative_algorithm("EAGLE")
    assert platform.supports_speculative_draft_attention_backend("DFLASH", "torch_native")
    assert not platform.supports_speculative_draft_attention_backend("DFLASH", "flashinfer")


def test_record_stream_is_a_no_op_on_cpu_tensors_only() -> None:
    seen = []
    assert hooks.record_stream_on_cpu(lambda *a: seen.append(a), torch.zeros(2), "stream") is None
    assert seen == []
    gpu_like = SimpleNamespace(device=torch.device("meta"))
    hooks.record_stream_on_cpu(lambda *a: seen.append(a), gpu_like, "stream")
    assert seen == [(gpu_like, "stream")]


class Pool:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    def set_kv_buffer(self, layer: object, loc: object, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys[loc.loc] = k.view(-1, HEADS, DIM)  # type: ignore[attr-defined]
        self.values[loc.loc] = v.view(-1, HEADS, DIM)  # type: ignore[attr-defined]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.keys

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.values


def test_a_verify_batch_attends_causally_over_each_requests_prefix_and_block() -> None:
    """Two requests with prefixes 3 and 5 verify a block of 4 each: every block token attends to its request's
    prefix and to the block tokens up to itself, as the GPU backends do for TARGET_VERIFY."""
    generator = torch.Generator().manual_seed(0)
    prefix = torch.tensor([3, 5])
    slots = 32
    keys, values = torch.randn(slots, HEADS, DIM, generator=generator), torch.randn(slots, HEADS, DIM, generator=generator)
    req_to_token = torch.zeros(2, 16, dtype=torch.int64)
    req_to_token[0, :7] = torch.arange(0, 7)
    req_to_token[1, :9] = torch.arange(10, 19)
    out_cache_loc = torch.cat([req_to_token[0, 3:7], req_to_token[1, 5:9]])
    q, k, v = (torch.randn(2 * DRAFT, HEADS * DIM, generator=generator) for _ in range(3))
    pool = Pool(keys, values)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                             token_to_kv_pool=pool)
    backend = TorchNativeAttnBackend(runner)  # type: ignore[arg-type]
    backend.swa_out_cache_loc = None
    layer = SimpleNamespace(qk_head_dim=DIM, v_head_dim=DIM, tp_q_head_num=HEADS, tp_k_head_num=HEADS,
                            is_cross_attention=False, attn_type=None, layer_id=0, scaling=DIM ** -0.5,
                            sliding_window_size=None)
    batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, seq_lens=prefix, extend_prefix_lens=None,
                            extend_seq_lens=None, req_pool_indices=torch.tensor([0, 1]), out_cache_loc=out_cache_loc,
                            encoder_out_cache_loc=None, encoder_lens=None)
    out = hooks.forward_extend_for_verify(TorchNativeAttnBackend.forward_extend, backend, q, k, v, layer, batch)
    for i, start in enumerate(prefix.tolist()):
        rows = req_to_token[i, :start + DRAFT]
        for j in range(DRAFT):
            query = q[i * DRAFT + j].view(HEADS, 1, DIM)
            seen = rows[:start + j + 1]
            expected = scaled_dot_product_attention(query, keys[seen].transpose(0, 1), values[seen].transpose(0, 1))
            assert torch.allclose(out[i * DRAFT + j].view(HEADS, DIM), expected.view(HEADS, DIM), atol=1e-5)
    assert batch.extend_seq_lens is None and torch.equal(batch.seq_lens, prefix)  # the batch itself is untouched
