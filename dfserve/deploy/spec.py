"""DeploymentSpec: one typed description of a deployment, rendered to every form it takes.

The same spec yields the SGLang server arguments (launched locally by ``deploy.sglang_engine`` or placed in a
Kubernetes container by ``deploy.k8s``) and the simulator's argv, so the three forms cannot drift apart::

    spec = build_spec(profile, target, drafter, engine="sglang", port=30000)
    server_args(spec)  # ["--model-path", "Qwen/Qwen3.6-27B", "--speculative-algorithm", "DFLASH", ...]
"""

from __future__ import annotations

import re
import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dfserve.deploy.drafters import SIMULATED_PREFIX, Drafter, DrafterKind, Target
from dfserve.deploy.profiles import HostProfile, SGLangSettings
from dfserve.errors import UserError, describe_invalid_flag

Engine = Literal["sglang", "sim"]
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
"""Deployment names double as Kubernetes object names (RFC 1123 labels)."""
SPEC_FLAGS = (
    "--model-path", "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-dflash-block-size",
    "--speculative-num-draft-tokens", "--speculative-draft-attention-backend", "--tp-size", "--tensor-parallel-size",
    "--mem-fraction-static", "--context-length", "--max-running-requests", "--attention-backend",
    "--mamba-radix-cache-strategy", "--mamba-scheduler-strategy", "--served-model-name", "--enable-metrics",
    "--host", "--port", "--device", "--dtype", "--max-total-tokens", "--disable-overlap-schedule",
    "--disable-cuda-graph", "--grammar-backend",
)
"""Flags the spec sets itself; passing one through `--sglang-arg` would silently fight it (argparse: last wins)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DrafterRef(_Strict):
    """The resolved drafter as deployed: its label, what SGLang loads, and the content it came from."""

    label: str
    kind: DrafterKind
    model_path: str
    block_size: int = Field(ge=2)
    sha256: str | None
    source: str | None
    sim_profile: str


class SimSettings(_Strict):
    profile: str = Field(description="Simulator acceptance profile: zlab, inhouse, none or a JSON file.")
    time_scale: float = Field(gt=0)
    seed: int


class DeploymentSpec(_Strict):
    schema_version: Literal[1] = 1
    name: str
    profile: str
    engine: Engine
    host: str
    port: int = Field(ge=0, le=65535, description="0 until a simulated engine started on a free port says which.")
    target: str
    target_config_source: str
    drafter: DrafterRef
    sglang: SGLangSettings = Field(description="The profile's settings with `overrides` applied.")
    overrides: dict[str, Any] = Field(description="Settings given as flags, over the profile's.")
    served_model_name: str
    env: dict[str, str]
    extra_sglang_args: list[str]
    sim: SimSettings

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def check_passthrough(args: list[str]) -> None:
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in SPEC_FLAGS:
            raise UserError(f"--sglang-arg {flag}: set by the deployment spec; use dfserve's own flag or the profile")


def default_name(profile: HostProfile, drafter: Drafter, engine: Engine) -> str:
    raw = f"{profile.name}-{drafter.label}" + ("-sim" if engine == "sim" else "")
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", raw.lower())).strip("-")[:63].strip("-")


def build_spec(
    profile: HostProfile,
    target: Target,
    drafter: Drafter,
    *,
    engine: Engine,
    port: int,
    host: str = "127.0.0.1",
    name: str | None = None,
    overrides: dict[str, Any] | None = None,
    sglang_args: list[str] | None = None,
    sim_profile: str | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
) -> DeploymentSpec:
    """Profile values, then flag overrides (`overrides` holds only flags the user gave), then pass-through args."""
    if drafter.kind == "simulated" and engine != "sim":
        raise UserError(f"--drafter {SIMULATED_PREFIX}{drafter.source}: a simulated drafter runs only with --engine sim")
    if port == 0 and engine != "sim":
        raise UserError("--port: SGLang needs a fixed port; 0 (a free port) works only with --engine sim")
    name = name or default_name(profile, drafter, engine)
    if not NAME_RE.match(name):
        raise UserError(f"--name: {name!r} must be lowercase letters, digits and '-', at most 63 characters")
    given = {key: value for key, value in (overrides or {}).items() if value is not None}
    try:
        settings = SGLangSettings.model_validate({**profile.sglang.model_dump(), **given})
    except ValidationError as exc:
        raise UserError(describe_invalid_flag(exc)) from None
    extra = list(sglang_args or ())
    check_passthrough(extra)
    try:
        return DeploymentSpec(
            name=name,
            profile=profile.name,
            engine=engine,
            host=host,
            port=port,
            target=target.model_path,
            target_config_source=target.config_source,
            drafter=DrafterRef(
                label=drafter.label, kind=drafter.kind, model_path=drafter.model_path, block_size=drafter.block_size,
                sha256=drafter.sha256, source=drafter.source, sim_profile=drafter.sim_profile,
            ),
            sglang=settings,
            overrides=given,
            served_model_name=settings.served_model_name.format(drafter=drafter.label),
            env=dict(profile.env),
            extra_sglang_args=extra,
            sim=SimSettings(profile=sim_profile or drafter.sim_profile, time_scale=time_scale, seed=seed),
        )
    except ValidationError as exc:  # --port, --time-scale and the like
        raise UserError(describe_invalid_flag(exc)) from None


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


def sim_argv(spec: DeploymentSpec, python: str = sys.executable) -> list[str]:
    """The simulated engine serving the same target, drafter, name and limits as the SGLang form."""
    return [
        python, "-m", "dfserve", "sim",
        "--host", spec.host, "--port", str(spec.port),
        "--profile", spec.sim.profile,
        "--time-scale", str(spec.sim.time_scale),
        "--seed", str(spec.sim.seed),
        "--served-model-name", spec.served_model_name,
        "--model-path", spec.target,
        "--draft-model-path", spec.drafter.model_path,
        "--max-running-requests", str(spec.sglang.max_running_requests),
        "--context-length", str(spec.sglang.context_length),
        "--block-size", str(spec.drafter.block_size),
    ]
