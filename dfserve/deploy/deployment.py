"""DeploymentSpec: one typed description of a deployment, as built by `deploy.spec.build_spec` and recorded with
every start. Its engine kind (``deploy.engines``) renders it as a command (started by ``deploy.supervise``) or as a
Kubernetes container (placed in a pod by ``deploy.k8s``), so the forms cannot drift apart."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dfserve.deploy.drafters import DrafterKind
from dfserve.deploy.profiles import SGLangSettings


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
    time_scale: float = Field(gt=0, allow_inf_nan=False)
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

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"
