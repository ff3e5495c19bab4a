"""An out-of-tree SGLang platform: the in-tree CPU platform, plus permission to run DFLASH with a torch_native drafter.

SGLang refuses DFLASH on CPU in `_handle_dflash` (`arg_groups/speculative_hook.py`): only cuda, npu and xpu pass,
unless the platform is out of tree, in which case `supports_speculative_algorithm("DFLASH")` decides. Its draft
attention backends (`arg_groups/choices.py`) are GPU kernels only; for an out-of-tree platform
`supports_speculative_draft_attention_backend` may add `torch_native`, the one that runs on CPU. Everything else is
SGLang's own CPU platform (`platforms/cpu.py`): its device, memory and distributed answers.

SGLang finds it through the `sglang.srt.platforms` entry point; `activate` claims the process only when SGLang's
CPU engine is asked for (`SGLANG_USE_CPU_ENGINE=1`), so the same venv still reports no platform otherwise.
"""

from __future__ import annotations

import os

from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum

ALGORITHMS = frozenset({"DFLASH"})
"""The speculative algorithms this platform serves: DFLASH's chain verification needs only the stand-in ops."""
DRAFT_ATTENTION_BACKENDS = frozenset({"torch_native"})
ATTENTION_BACKEND = "torch_native"
"""SGLang's x86 default, intel_amx, needs the real CPU kernels; torch_native is SDPA in torch."""


class DflashCpuPlatform(CpuSRTPlatform):
    """SGLang's CPU platform, out of tree so that its speculative hooks are consulted."""

    _enum = PlatformEnum.OOT

    def get_default_attention_backend(self) -> str:
        return ATTENTION_BACKEND

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return ATTENTION_BACKEND

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm.upper() in ALGORITHMS

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return algorithm.upper() in ALGORITHMS and backend in DRAFT_ATTENTION_BACKENDS


def activate() -> str | None:
    """The entry point SGLang calls: the platform's qualified name, or None when the CPU engine is not asked for."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1":
        return None
    return f"{DflashCpuPlatform.__module__}.{DflashCpuPlatform.__qualname__}"
