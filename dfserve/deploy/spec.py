"""DeploymentSpec: one typed description of a deployment, rendered to every form it takes.

The spec names its engine kind (``deploy.engines``); that entry renders it as a command (started by
``deploy.supervise``) or as a Kubernetes container (placed in a pod by ``deploy.k8s``), so the forms cannot drift
apart::

    spec = build_spec(profile, target, drafter, engine="sglang", port=30000)
    engine_kind(spec.engine).argv(spec, "python3")  # [..., "--speculative-algorithm", "DFLASH", ...]
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dfserve.deploy.drafters import SIMULATED_PREFIX, Drafter, DrafterKind, Target
from dfserve.deploy.engines import engine_kind
from dfserve.deploy.profiles import HostProfile, SGLangSettings
from dfserve.errors import FieldError, UserError, describe_invalid_flag

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
"""Deployment names double as Kubernetes object names (RFC 1123 labels)."""
SPEC_FLAGS = (
    "--model-path", "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-dflash-block-size",
    "--speculative-num-draft-tokens", "--speculative-draft-attention-backend", "--tp-size", "--tensor-parallel-size",
    "--mem-fraction-static", "--context-length", "--max-running-requests", "--attention-backend",
    "--mamba-radix-cache-strategy", "--mamba-scheduler-strategy", "--served-model-name", "--enable-metrics",
    "--host", "--port",
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

    @property
    def identity(self) -> str:
        """What identifies the deployed bytes: their content hash, or why there is none."""
        if self.sha256:
            return f"sha256 {self.sha256}"
        if self.kind == "zlab":
            return f"no content hash: z-lab's release, which SGLang loads from the Hugging Face hub as {self.model_path}"
        return "no content hash: a simulator profile, no weights"


class SimSettings(_Strict):
    profile: str = Field(description="Simulator acceptance profile: zlab, inhouse, none or a JSON file.")
    time_scale: float = Field(gt=0)
    seed: int


class DeploymentSpec(_Strict):
    schema_version: Literal[1] = 1
    name: str
    profile: str
    engine: str = Field(description="A registered engine kind (`deploy.engines`).")
    host: str
    port: int = Field(ge=0, le=65535, description="0 until a start takes a free port and says which.")
    target: str
    target_config_source: str
    drafter: DrafterRef
    sglang: SGLangSettings = Field(description="The profile's settings with `overrides` applied.")
    overrides: dict[str, Any] = Field(description="Settings given as flags, over the profile's.")
    served_model_name: str
    env: dict[str, str]
    extra_sglang_args: list[str]
    sim: SimSettings

    @field_validator("engine")
    @classmethod
    def _registered(cls, engine: str) -> str:
        engine_kind(engine)
        return engine

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def check_passthrough(args: list[str]) -> None:
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in SPEC_FLAGS:
            raise FieldError("sglang_args", f"{flag}: set by the deployment spec; use dfserve's own flag or the profile")


def default_name(profile: HostProfile, drafter: Drafter, engine: str) -> str:
    raw = f"{profile.name}-{drafter.label}" + (f"-{engine}" if engine_kind(engine).simulated else "")
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", raw.lower())).strip("-")[:63].strip("-")


def build_spec(
    profile: HostProfile,
    target: Target,
    drafter: Drafter,
    *,
    engine: str,
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
    if drafter.kind == "simulated" and not engine_kind(engine).simulated:
        raise FieldError("drafter", f"{SIMULATED_PREFIX}{drafter.source}: exists only as a simulator profile, so it runs "
                         f"only on a simulated engine, not {{other}} {engine}", other="engine")
    name = name or default_name(profile, drafter, engine)
    if not NAME_RE.match(name):
        raise FieldError("name", f"{name!r} must be lowercase letters, digits and '-', at most 63 characters")
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
