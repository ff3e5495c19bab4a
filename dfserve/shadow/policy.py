"""The gateway's `shadow:` block: where shadow records go and how much of a disk they may take."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShadowPolicy(_Model):
    """The gateway's `shadow:` block (`--record DIR`)."""

    dir: Path = Field(description="where record folders are created, one after another")
    secondary: str | None = Field(None, description="an arm running the baseline's drafter: the noise floor")
    records_per_folder: int = Field(10_000, ge=2, description="records in a folder before the next is opened")
    folder_bytes: int = Field(64 << 20, ge=4096, description="bytes of requests.jsonl before the next is opened")
    max_folders: int = Field(16, ge=1, description="folders at most; then recording stops (logged once)")
    max_pending: int = Field(10_000, ge=1, description="primaries' records held waiting for a mirror's")
    queue_size: int = Field(4096, ge=1, description="exchanges waiting for the recorder's thread")
