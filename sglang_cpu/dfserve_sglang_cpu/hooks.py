"""The CUDA assumptions on DFLASH's path in SGLang 0.5.23, lifted on CPU through SGLang's own hook registry.

SGLang loads general plugins (entry point group `sglang.srt.plugins`) in every process it starts and applies their
hooks before serving (`sglang/srt/plugins/__init__.py`, `load_plugins`). `register` adds four, and only when SGLang's
CPU engine is asked for (`SGLANG_USE_CPU_ENGINE=1`):

1. `torch.Tensor.record_stream` is a no-op on CPU tensors. `DFlashWorkerV2` marks `batch.seq_lens` as used by the
   current stream (`speculative/dflash_worker_v2.py`), which raises for a CPU tensor; a CPU has no streams, so there
   is nothing to record.
2. `DFlashAttention.use_table_qk_norm_rope` is turned off after `__init__` (`models/dflash.py`). SGLang disables it
   only on NPU; otherwise a bfloat16 forward launches a Triton kernel. Off, the layer takes its torch path
   (`apply_qk_norm`, then the rotary embedding), which is what the fused kernel computes.
3. `TorchNativeAttnBackend.forward_extend` is given the extend lengths of a TARGET_VERIFY batch
   (`layers/attention/torch_native_backend.py`). Its extend path reads `extend_prefix_lens` and `extend_seq_lens`,
   which a verify batch does not carry: there the prefix is `seq_lens` and each request extends by the same number
   of draft tokens, so the attended length is `seq_lens` plus that number.
4. `resolve_draft_worker_attention_backend` (`speculative/draft_worker_common.py`) keeps a draft backend the
   platform accepts. Server-argument resolution asks an out-of-tree platform which draft backends it supports
   (`arg_groups/speculative_hook.py`), but the draft worker checks only SGLang's GPU list and would fall back to
   FlashInfer.
"""

from __future__ import annotations

import copy
import os
from typing import Any

PLATFORM_ENV = "SGLANG_USE_CPU_ENGINE"
TARGETS = {
    "record_stream": "torch.Tensor.record_stream",
    "dflash_attention_init": "sglang.srt.models.dflash.DFlashAttention.__init__",
    "torch_native_extend": "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
    "draft_backend": "sglang.srt.speculative.draft_worker_common.resolve_draft_worker_attention_backend",
}


def record_stream_on_cpu(original: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
    if tensor.device.type == "cpu":
        return None
    return original(tensor, *args, **kwargs)


def without_table_qk_norm_rope(result: Any, attention: Any, *args: Any, **kwargs: Any) -> None:
    attention.use_table_qk_norm_rope = False


def verify_batch_view(forward_batch: Any, query_rows: int) -> Any:
    """A TARGET_VERIFY batch as the extend path reads one: prefix `seq_lens`, `query_rows / batch size` new tokens
    per request, attended length their sum. Other batches are returned as they are."""
    if not forward_batch.forward_mode.is_target_verify() or forward_batch.extend_seq_lens is not None:
        return forward_batch
    prefix = forward_batch.seq_lens
    batch_size = int(prefix.shape[0])
    if batch_size == 0 or query_rows % batch_size:
        raise ValueError(f"TARGET_VERIFY: {query_rows} query rows for {batch_size} requests")
    draft_tokens = query_rows // batch_size
    view = copy.copy(forward_batch)
    view.extend_prefix_lens = prefix
    view.extend_seq_lens = prefix.new_full(prefix.shape, draft_tokens)
    view.seq_lens = prefix + draft_tokens
    return view


def forward_extend_for_verify(original: Any, backend: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                              *args: Any, **kwargs: Any) -> Any:
    return original(backend, q, k, v, layer, verify_batch_view(forward_batch, q.shape[0]), *args, **kwargs)


def draft_backend_of_platform(original: Any, *args: Any, algo_label: str | None = None, **kwargs: Any) -> str:
    from sglang.srt.platforms import current_platform
    from sglang.srt.runtime_context import get_spec

    named = get_spec().speculative_draft_attention_backend
    if (algo_label and named and current_platform.is_out_of_tree()
            and current_platform.supports_speculative_draft_attention_backend(algo_label, named)):
        return str(named)
    return str(original(*args, algo_label=algo_label, **kwargs))


def register() -> None:
    """The `sglang.srt.plugins` entry point: register the three hooks when SGLang's CPU engine is in use."""
    if os.environ.get(PLATFORM_ENV, "0") != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGETS["record_stream"], record_stream_on_cpu, HookType.AROUND)
    HookRegistry.register(TARGETS["dflash_attention_init"], without_table_qk_norm_rope, HookType.AFTER)
    HookRegistry.register(TARGETS["torch_native_extend"], forward_extend_for_verify, HookType.AROUND)
    HookRegistry.register(TARGETS["draft_backend"], draft_backend_of_platform, HookType.AROUND)
