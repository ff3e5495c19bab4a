"""`SimConfig`: everything one simulated engine is built from, checked when built."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dfserve.deploy.sim.faults import FaultConfig

DEFAULT_MODEL = "Qwen/Qwen3.6-27B"
DEFAULT_DRAFTERS = {"zlab": "z-lab/Qwen3.6-27B-DFlash", "inhouse": "inhouse/Qwen3.6-27B-DFlash"}


class LatencyConfig(BaseModel):
    """Seconds at time scale 1; the defaults are documented in `deploy.sim.latency`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    round_fixed_s: float = Field(0.027, ge=0)
    round_per_token_s: float = Field(0.00018, ge=0)
    prefill_fixed_s: float = Field(0.027, ge=0)
    prefill_per_token_s: float = Field(0.00018, ge=0)
    jitter: float = Field(0.03, ge=0, le=1)


class SimConfig(BaseModel):
    """One simulated SGLang engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    profile: str = Field("zlab", description="zlab, inhouse, none, or a profile JSON file.")
    time_scale: float = Field(1.0, gt=0, le=1000, description="Multiplies every modelled duration; < 1 for fast "
                              "tests. Past 1000 a modelled millisecond is a second: a mistyped flag, whose every "
                              "request would seem to hang.")
    seed: int = 0
    max_running_requests: int = Field(48, ge=1)
    max_prefill_tokens: int = Field(16384, ge=1)
    context_length: int = Field(262144, ge=1)
    served_model_name: str | None = Field(None, min_length=1)
    model_path: str = DEFAULT_MODEL
    draft_model_path: str | None = None
    block_size: int | None = Field(None, ge=2)
    incremental_streaming_output: bool = False
    record_chunk_times: bool = False
    spec_details: bool = Field(True, description="Answer return_spec_tokens_details as SGLang 0.5.23 does; off: "
                                                 "ignore it, as earlier SGLang does.")
    lossy_fraction: float = Field(0.0, ge=0.0, le=1.0)
    api_key: str | None = Field(None, description="Like SGLang's --api-key: requests need Authorization: Bearer KEY.")
    faults: FaultConfig = FaultConfig()
    latency: LatencyConfig = LatencyConfig()

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    def resolved_draft_model_path(self) -> str | None:
        if self.profile == "none":
            return None
        return self.draft_model_path or DEFAULT_DRAFTERS.get(self.profile, self.profile)
