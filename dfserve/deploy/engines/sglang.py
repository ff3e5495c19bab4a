"""SGLang as an engine kind: `python -m sglang.launch_server` with the spec's server arguments, validated by SGLang's
own parser under its interpreter, and the same arguments in a Kubernetes container.

    server_args(spec)  # ["--model-path", "Qwen/Qwen3.6-27B", "--speculative-algorithm", "DFLASH", ...]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from dfserve.deploy.engines.base import Container, EngineKind
from dfserve.errors import FieldError

if TYPE_CHECKING:
    from dfserve.deploy.deployment import DeploymentSpec

CHECK_SCRIPT = Path(__file__).parents[1] / "sglang_check.py"
"""Run by path under SGLang's interpreter, which need not have dfserve installed."""
CHECK_TIMEOUT_S = 300.0
"""Importing SGLang takes seconds on an idle host, minutes beside engines whose schedulers poll without pause."""


class CheckResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ok: bool
    version: str
    problems: list[str]
    resolved: dict[str, Any]


def server_args(spec: DeploymentSpec, host: str | None = None) -> list[str]:
    """SGLang's server arguments for the spec (what follows `python -m sglang.launch_server`)."""
    s = spec.sglang
    args = [
        "--model-path", spec.target,
        "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", spec.drafter.model_path,
        "--speculative-dflash-block-size", str(spec.drafter.block_size),
        "--speculative-draft-attention-backend", s.draft_attention_backend,
        "--tp-size", str(s.tp_size),
        "--mem-fraction-static", str(s.mem_fraction_static),
        "--context-length", str(s.context_length),
        "--max-running-requests", str(s.max_running_requests),
        "--attention-backend", s.attention_backend,
    ]
    if s.mamba_radix_cache_strategy:
        args += ["--mamba-radix-cache-strategy", s.mamba_radix_cache_strategy]
    args += ["--served-model-name", spec.served_model_name]
    if s.enable_metrics:
        args.append("--enable-metrics")
    for flag, value in (("--device", s.device), ("--dtype", s.dtype), ("--max-total-tokens", s.max_total_tokens),
                        ("--grammar-backend", s.grammar_backend)):
        if value is not None:
            args += [flag, str(value)]
    args += [flag for flag, on in (("--disable-overlap-schedule", s.disable_overlap_schedule),
                                   ("--disable-cuda-graph", s.disable_cuda_graph)) if on]
    args += ["--host", host or spec.host, "--port", str(spec.port), *spec.extra_sglang_args]
    return args


def check_with_sglang(spec: DeploymentSpec, python: str, timeout_s: float = CHECK_TIMEOUT_S) -> CheckResult:
    """Run `dfserve/deploy/sglang_check.py` under SGLang's interpreter on the spec's server arguments."""
    if shutil.which(python) is None:
        raise FieldError("sglang_python", f"{python} not found; {{other}} needs the interpreter SGLang is installed in",
                         other="check")
    request = json.dumps({"argv": server_args(spec)})
    try:
        done = subprocess.run(
            [python, str(CHECK_SCRIPT)], input=request, capture_output=True, text=True, timeout=timeout_s, check=False,
            env={**os.environ, **spec.env},  # the profile's variables decide SGLang's platform (cpu.yaml)
        )
    except subprocess.TimeoutExpired:
        raise FieldError("check", f"SGLang's parser did not answer within {timeout_s:.0f} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("DFSERVE-SGLANG-CHECK ")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise FieldError("check", f"SGLang's parser could not run under {python} (exit {done.returncode}): {last}")
    return CheckResult.model_validate_json(lines[-1].removeprefix("DFSERVE-SGLANG-CHECK "))


@EngineKind.register("sglang")
class SGLang(EngineKind):
    def argv(self, spec: DeploymentSpec, python: str) -> list[str]:
        return [python, "-m", "sglang.launch_server", *server_args(spec)]

    def env(self, spec: DeploymentSpec) -> dict[str, str]:
        return dict(spec.env)

    def check(self, spec: DeploymentSpec, python: str) -> str:
        result = check_with_sglang(spec, python)
        if not result.ok:
            raise FieldError("check", f"SGLang {result.version} rejects the argv: " + "; ".join(result.problems))
        return (f"SGLang {result.version} accepts it: DFLASH, block {result.resolved['speculative_num_draft_tokens']}, "
                f"draft attention {result.resolved['speculative_draft_attention_backend']}")

    def container(self, spec: DeploymentSpec, host: str) -> Container:
        return Container("sglang", ["python3", "-m", "sglang.launch_server"], server_args(spec, host=host))
