"""Each stand-in op against the SGLang Triton kernel it replaces, run by Triton's interpreter on the same inputs,
for batches of several requests with uneven lengths (the packed offsets are where a stand-in would go wrong)."""

from __future__ import annotations

import sgl_kernel
import torch
from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled
from sglang.kernels.ops.speculative.cache_locs import (
    assign_draft_cache_locs_contiguous,
    assign_extend_cache_locs,
)
from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc, fill_bonus_tokens
from sglang.srt.mem_cache.allocation import assign_req_to_token_pool

POOL_LEN = 24
REQ_POOL_INDICES = torch.tensor([3, 0, 5, 1])
START = torch.tensor([2, 0, 7, 11])
END = torch.tensor([9, 5, 8, 20])


def pool() -> torch.Tensor:
    return torch.arange(6 * POOL_LEN, dtype=torch.int32).view(6, POOL_LEN) * 7 % 1000


def test_assign_req_to_token_pool_writes_each_requests_slice_of_the_packed_locations() -> None:
    locs = torch.arange(1000, 1000 + int((END - START).sum()), dtype=torch.int64)
    expected, got = pool(), pool()
    assign_req_to_token_pool[(4,)](REQ_POOL_INDICES, expected, START, END, locs, POOL_LEN, 4)
    sgl_kernel.assign_req_to_token_pool_cpu(REQ_POOL_INDICES, got, START, END, locs, POOL_LEN)
    assert torch.equal(got, expected)
    assert not torch.equal(got, pool())


def test_assign_extend_cache_locs_packs_each_requests_slice() -> None:
    size = int((END - START).sum())
    expected = torch.full((size + 3,), -1, dtype=torch.int64)
    got = expected.clone()
    assign_extend_cache_locs[(4,)](REQ_POOL_INDICES, pool(), START, END, expected, POOL_LEN, 4)
    sgl_kernel.assign_extend_cache_locs_cpu(REQ_POOL_INDICES, pool(), START, END, got, POOL_LEN)
    assert torch.equal(got, expected)
    assert (got[:size] != -1).all() and (got[size:] == -1).all()


def test_assign_draft_cache_locs_contiguous_copies_topk_times_steps_slots_per_request() -> None:
    seq_lens = torch.tensor([4, 0, 10, 2])
    topk, steps = 2, 3
    expected = torch.full((4 * topk * steps,), -1, dtype=torch.int64)
    got = expected.clone()
    assign_draft_cache_locs_contiguous[(4,)](REQ_POOL_INDICES, pool(), seq_lens, expected, POOL_LEN, topk, steps)
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(REQ_POOL_INDICES, pool(), seq_lens, got, POOL_LEN, topk, steps)
    assert torch.equal(got, expected)


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer_as_the_tiled_kernel_does() -> None:
    """Three layer buffers given by address and byte stride; row 2 is both read and written (the kernel loads its
    whole tile before storing it, so moves may overlap)."""
    def buffers() -> list[torch.Tensor]:
        return [torch.randn(16, 4, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) for i in range(3)]

    def table(bs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([b.data_ptr() for b in bs], dtype=torch.uint64),
                torch.tensor([b.stride(0) * b.element_size() for b in bs]))

    tgt, src = torch.tensor([1, 2, 3, 9]), torch.tensor([2, 3, 4, 1])
    expected, got = buffers(), buffers()
    copy_all_layer_kv_cache_tiled[(3, 2)](*table(expected), tgt, src, 4, 4, BYTES_PER_TILE=32)
    sgl_kernel.copy_all_layer_kv_cache_cpu(*table(got), tgt, src)
    for e, g, before in zip(expected, got, buffers(), strict=True):
        assert torch.equal(g, e)
        assert torch.equal(g[1], before[2]) and torch.equal(g[2], before[3]) and torch.equal(g[9], before[1])


def test_fill_accept_out_cache_loc_packs_accepted_positions_in_order() -> None:
    accept_index = torch.tensor([[0, 1, -1, -1], [4, -1, -1, -1], [8, 9, 10, 11]], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 112, dtype=torch.int64)
    expected = torch.full((12,), -5, dtype=torch.int64)
    got = expected.clone()
    fill_accept_out_cache_loc[(12,)](accept_index, out_cache_loc, expected, 16)
    sgl_kernel.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, got)
    assert torch.equal(got, expected)
    assert got[:7].tolist() == [100, 101, 104, 108, 109, 110, 111]


def test_fill_bonus_tokens_takes_each_requests_last_accepted_token() -> None:
    accept_tokens = torch.arange(3 * 5, dtype=torch.int64).view(3, 5) + 50
    accept_lens = torch.tensor([1, 5, 3], dtype=torch.int32)
    expected = torch.zeros(3, dtype=torch.int64)
    got = expected.clone()
    fill_bonus_tokens[(3,)](accept_tokens, accept_lens, expected, 5)
    sgl_kernel.fill_bonus_tokens_cpu(accept_tokens, accept_lens, got, 5)
    assert torch.equal(got, expected)
    assert got.tolist() == [50, 59, 62]
