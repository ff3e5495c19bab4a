"""The gateway's `shadow:` block: where shadow records go and how much of a disk they may take."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ShadowPolicy(BaseModel):
    """The gateway's `shadow:` block (`--record DIR`). Strict, as the rest of the gateway's file: `until_decided:
    "no"` is a mistake, not a truth value to guess at; paths still come as YAML strings."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    dir: Path = Field(strict=False, description="where record folders are created, one after another")
    secondary: str | None = Field(None, description="an arm running the baseline's drafter: the noise floor")
    records_per_folder: int = Field(10_000, ge=2, description="records in a folder before the next is opened")
    folder_bytes: int = Field(64 << 20, ge=4096, description="bytes of requests.jsonl before the next is opened")
    max_folders: int = Field(16, ge=1, description="folders at most; then recording stops (logged once)")
    max_pending: int = Field(10_000, ge=1, description="requests whose records wait for their other arms' "
                             "exchanges; past it the oldest is written without them and its folder is incomplete")
    queue_size: int = Field(4096, ge=1, description="exchanges waiting for the recorder's thread")
    until_decided: bool = Field(False, description="decide the gate on the mirrored pairs as they are recorded "
                                "(sequential design) and stop mirroring once it is decided (`shadow.monitor`)")
    gate: Path | None = Field(None, strict=False, description="with until_decided: the gate's YAML file (default: "
                              "the shadow gate)")
    look_every: int | None = Field(None, ge=1, description="with until_decided: mirrored pairs between looks [16]")

    @model_validator(mode="after")
    def _deciding(self) -> ShadowPolicy:
        if not self.until_decided and (self.gate is not None or self.look_every is not None):
            raise ValueError("shadow.gate, shadow.look_every: only with shadow.until_decided")
        return self
