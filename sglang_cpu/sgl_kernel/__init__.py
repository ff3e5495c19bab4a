"""Pure-torch stand-ins for the `sgl_kernel` CPU ops SGLang 0.5.23 imports when `SGLANG_USE_CPU_ENGINE=1`.

SGLang's CPU kernels (`sgl-kernel/csrc/cpu`) are not on PyPI: the `sgl-kernel` and `sglang-kernel` wheels hold CUDA
builds only. With `SGLANG_USE_CPU_ENGINE=1` SGLang imports these names at module level and calls them where a GPU
runs a Triton kernel; each function here has the semantics of that Triton kernel (named in its docstring, in
`sglang/srt/mem_cache/allocation.py` and `sglang/kernels/ops/`), written as index reads and writes on torch tensors.
Tensors are modified in place, as the kernels do. `convert_weight_packed` is deliberately absent: SGLang then finds
no AMX backend (`_is_intel_amx_backend_available`) and its layers run their `forward_native` torch paths.

The EAGLE tree ops (`build_tree_kernel_efficient_cpu`, `verify_tree_greedy_cpu`) are imported by
`kernels/ops/speculative/spec_tree.py` at module level, so they must exist; DFLASH verifies a chain, not a tree,
and never calls them. They refuse in one line rather than compute something unproven.
"""

from __future__ import annotations

import ctypes

import torch


def _row_offsets(start_offset: torch.Tensor, end_offset: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, position in the packed array) per request: the Triton kernels' `tl.sum(end - start)` over the
    rows before each program id."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = []
    packed = 0
    for start, end in zip(starts, ends, strict=True):
        rows.append((int(start), int(end), packed))
        packed += int(end) - int(start)
    return rows


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """`assign_req_to_token_pool` (mem_cache/allocation.py): request i's slots `start[i]:end[i]` in its row of
    `req_to_token` get the next `end[i] - start[i]` entries of the packed `out_cache_loc`."""
    del pool_len  # the row stride; torch indexing knows it
    for row, (start, end, packed) in zip(req_pool_indices.tolist(), _row_offsets(start_offset, end_offset), strict=True):
        req_to_token[int(row), start:end] = out_cache_loc[packed:packed + end - start].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """`assign_extend_cache_locs` (kernels/ops/speculative/cache_locs.py): the reverse copy; request i's slots
    `start[i]:end[i]` of its `req_to_token` row are packed into `out_cache_loc`, request after request."""
    del pool_len
    for row, (start, end, packed) in zip(req_pool_indices.tolist(), _row_offsets(start_offset, end_offset), strict=True):
        out_cache_loc[packed:packed + end - start] = req_to_token[int(row), start:end].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """`assign_draft_cache_locs_contiguous` (kernels/ops/speculative/cache_locs.py): each request's
    `topk * num_cols` slots from `seq_lens[i]` on, copied to `out_cache_loc[i * topk * num_cols:]`."""
    del pool_len
    width = topk * num_cols
    for i, (row, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        out_cache_loc[i * width:(i + 1) * width] = req_to_token[int(row), int(start):int(start) + width].to(out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """`copy_all_layer_kv_cache_tiled` (kernels/ops/kvcache/cache_move.py): in every buffer (one per layer and K/V,
    given by address and row stride in bytes), rows `src_loc` are copied to rows `tgt_loc`. All rows are read
    before any is written, as the kernel loads its tile before storing it, so overlapping moves are safe."""
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    rows = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(address))
        buffer = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        buffer[tgt] = buffer[src]


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """`fill_accept_out_cache_loc` (kernels/ops/speculative/eagle.py): the cache slots of accepted positions
    (`accept_index` not -1), packed in order; the rest of `accept_out_cache_loc` is left as it was."""
    index = accept_index.reshape(-1).to(torch.int64)
    kept = index[index != -1]
    accept_out_cache_loc[:kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """`fill_bonus_tokens` (kernels/ops/speculative/eagle.py): request i's last accepted token,
    `accept_tokens.flat[accept_stride * i + accept_lens[i] - 1]`."""
    flat = accept_tokens.reshape(-1)
    index = torch.arange(accept_lens.numel(), dtype=torch.int64) * accept_stride + accept_lens.to(torch.int64) - 1
    bonus_tokens.copy_(flat[index].to(bonus_tokens.dtype))


def _tree_ops_unavailable(name: str) -> RuntimeError:
    return RuntimeError(f"sgl_kernel.{name}: EAGLE's tree ops have no CPU stand-in here; this CPU stack serves DFLASH")


def build_tree_kernel_efficient_cpu(*args: object, **kwargs: object) -> None:
    """Imported by `spec_tree.py` on CPU; only EAGLE's tree drafting calls it."""
    raise _tree_ops_unavailable("build_tree_kernel_efficient_cpu")


def verify_tree_greedy_cpu(*args: object, **kwargs: object) -> None:
    """Imported by `spec_tree.py` on CPU; only EAGLE's tree verification calls it."""
    raise _tree_ops_unavailable("verify_tree_greedy_cpu")
