"""Building a `DeploymentSpec` (``deploy.deployment``): profile values, then flag overrides, then pass-through
arguments, checked against the engine kind it names::

    spec = build_spec(profile, target, drafter, engine="sglang", port=30000)
    engine_kind(spec.engine).argv(spec, "python3")  # [..., "--speculative-algorithm", "DFLASH", ...]
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from dfserve.deploy.deployment import DeploymentSpec, DrafterRef, SimSettings
from dfserve.deploy.drafters import SIMULATED_PREFIX, Drafter, Target
from dfserve.deploy.engines import engine_kind
from dfserve.deploy.profiles import HostProfile, SGLangSettings
from dfserve.errors import FieldError, invalid_field

NAME_RE = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")


def check_name(name: str) -> str:
    """A deployment's name: a folder under the deploy root and a Kubernetes object's name alike."""
    if not NAME_RE.match(name):
        raise FieldError("name", f"{name!r} must be lowercase letters, digits and '-', start with a letter, end with "
                         "a letter or digit, at most 63 characters (it names the Kubernetes Deployment and Service)")
    return name
"""Deployment names double as Kubernetes object names; a Service's must be a DNS-1035 label (starts with a letter)."""
SPEC_FLAGS = (
    "--model-path", "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-dflash-block-size",
    "--speculative-num-draft-tokens", "--speculative-draft-attention-backend", "--tp-size", "--tensor-parallel-size",
    "--mem-fraction-static", "--context-length", "--max-running-requests", "--attention-backend",
    "--mamba-radix-cache-strategy", "--mamba-scheduler-strategy", "--served-model-name", "--enable-metrics",
    "--host", "--port", "--device", "--dtype", "--max-total-tokens", "--disable-overlap-schedule",
    "--disable-cuda-graph", "--grammar-backend",
)
"""Flags the spec sets itself; passing one through `--sglang-arg` would silently fight it (argparse: last wins)."""
SPEC_FLAG_ALIASES = {"--model": "--model-path", "--speculative-draft-model": "--speculative-draft-model-path"}
"""SGLang's other spellings of flags the spec sets: its parser stores both in the same field."""


def check_passthrough(args: list[str]) -> None:
    """Refuse an argument SGLang's parser would read as a flag the spec sets: the flag, an alias, or a prefix of
    either (the parser has allow_abbrev, so a unique prefix is that flag and a shared one is an error)."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--") or flag == "--":
            continue
        if flag in SPEC_FLAGS:
            raise FieldError("sglang_args", f"{flag}: set by the deployment spec; use dfserve's own flag or the profile")
        if flag in SPEC_FLAG_ALIASES:
            raise FieldError("sglang_args", f"{flag}: SGLang's alias of {SPEC_FLAG_ALIASES[flag]}, set by the deployment "
                             "spec; use dfserve's own flag or the profile")
        if prefixed := [name for name in SPEC_FLAGS if name.startswith(flag)]:
            raise FieldError("sglang_args", f"{flag}: SGLang expands a prefix to the flag it begins: {' or '.join(prefixed)}, "
                             "set by the deployment spec; use dfserve's own flag or the profile")


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
    kind = engine_kind(engine)
    if drafter.kind == "simulated" and not kind.simulated:
        raise FieldError("drafter", f"{SIMULATED_PREFIX}{drafter.source}: exists only as a simulator profile, so it runs "
                         f"only on a simulated engine, not {{other}} {engine}", other="engine")
    if name is None:
        name = default_name(profile, drafter, engine)
        if not NAME_RE.match(name):
            raise FieldError("name", f"the name made of profile {profile.name!r} and the drafter, {name!r}, is no "
                             f"deployment name; give one with {{other}}", other="name")
    check_name(name)
    given = {key: value for key, value in (overrides or {}).items() if value is not None}
    try:
        settings = SGLangSettings.model_validate({**profile.sglang.model_dump(), **given})
    except ValidationError as exc:
        raise invalid_field(exc) from None
    extra = list(sglang_args or ())
    if extra and kind.simulated:
        raise FieldError("sglang_args", f"the simulated engine takes no SGLang arguments ({{other}} {engine})",
                         other="engine")
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
    except ValidationError as exc:  # the port, the time scale and the like
        raise invalid_field(exc) from None
