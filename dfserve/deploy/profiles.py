"""Host profiles: the SGLang settings that fit one kind of host, each value documented with its source in its YAML.

A profile is a name shipped in ``dfserve/deploy/profiles/NAME.yaml`` (``pro6000``) or a path to such a file, so other hosts
are added as data, not code::

    profile = load_profile("pro6000")
    profile.sglang.max_running_requests  # 32
"""

from __future__ import annotations

import re
import string
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dfserve.errors import FieldError, UserError, describe_invalid
from dfserve.yamlfile import parse_yaml

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
INT32_MAX = 2**31 - 1
"""The most requests or tokens a setting may size: SGLang allocates its request and token pools by them."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelFacts(_Strict):
    """A model as SGLang names it, with the config.json facts used when its own file is not on this machine."""

    model_path: str = Field(description="Hugging Face id (or path) passed to SGLang.")
    config: dict[str, Any] = Field(description="config.json content, verbatim in Hugging Face's layout.")


class SGLangSettings(_Strict):
    """Server arguments a profile fixes; each maps to one SGLang flag (see ``deploy.engines.sglang``)."""

    tp_size: int = Field(ge=1, le=8, description="GPUs of one host: SGLang and the Kubernetes pod take them on one node.")
    mem_fraction_static: float = Field(gt=0, lt=1)
    context_length: int = Field(ge=1, le=INT32_MAX)
    max_running_requests: int = Field(ge=1, le=INT32_MAX)
    attention_backend: str
    draft_attention_backend: Literal["flashinfer", "fa3", "fa4", "triton", "torch_native"] = Field(
        description="torch_native only where the host's SGLang platform accepts it for DFLASH (the cpu profile).")
    mamba_radix_cache_strategy: Literal["auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"] | None = None
    enable_metrics: bool = True
    served_model_name: str = Field(min_length=1, description="Template; `{drafter}` becomes the drafter's label, "
                                   "and braces name nothing else.")

    @field_validator("served_model_name")
    @classmethod
    def _template(cls, template: str) -> str:
        try:
            fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(template)
                      if name is not None]
        except ValueError as exc:  # a brace left open or alone
            raise ValueError(f"{template!r}: only {{drafter}} may stand in braces ({exc})") from None
        for name, spec, conversion in fields:
            if (name, spec, conversion) != ("drafter", "", None):
                shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
                raise ValueError(f"{template!r}: only {{drafter}} may stand in braces, not {shown}")
        return template
    device: str | None = Field(default=None, description="--device; SGLang detects the GPU when unset.")
    dtype: str | None = Field(default=None, description="--dtype; the checkpoint's when unset.")
    max_total_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX,
                                         description="--max-total-tokens, a fixed KV pool.")
    disable_overlap_schedule: bool = False
    disable_cuda_graph: bool = False
    grammar_backend: str | None = Field(default=None, description="--grammar-backend; SGLang's default when unset.")


class HostProfile(_Strict):
    schema_version: Literal[1]
    name: str
    gpu: str
    target: ModelFacts | None = Field(default=None, description="None: the host serves what --target names.")
    target_families: list[str] = Field(min_length=1)
    zlab: ModelFacts | None = Field(default=None, description="None: no z-lab release fits the host's targets.")
    sglang: SGLangSettings
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _variable_names(cls, env: dict[str, str]) -> dict[str, str]:
        """A name a shell, `env` and Kubernetes all take (no '=', space or empty name: a process cannot be given
        one)."""
        if (bad := next((name for name in env if not ENV_NAME.fullmatch(name)), None)) is not None:
            raise ValueError(f"{bad!r} is not an environment variable name (letters, digits and _, not first a digit)")
        return env


def profile_names() -> list[str]:
    folder = resources.files(__package__) / "profiles"
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> HostProfile:
    """A shipped profile by name, or a YAML file by path; a bad one is a `FieldError` on `profile_name` naming the
    file's field."""
    if name_or_path in profile_names():
        text = (resources.files(__package__) / "profiles" / f"{name_or_path}.yaml").read_text(encoding="utf-8")
        where = f"profile {name_or_path}"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise FieldError("profile_name", f"{name_or_path!r} is neither a known profile "
                             f"({', '.join(profile_names())}) nor a file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise FieldError("profile_name", f"cannot read {path} as UTF-8 text ({exc})") from None
        where = str(path)
    try:
        return HostProfile.model_validate(parse_yaml(text, where))
    except UserError as exc:
        raise FieldError("profile_name", str(exc)) from None
    except ValidationError as exc:
        raise FieldError("profile_name", describe_invalid(exc, where)) from None
