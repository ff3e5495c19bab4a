"""Drafter profiles: how likely each draft position of a block is accepted, given the one before it was.

A profile lists, for a block of B tokens, B-1 conditional probabilities: entry i is P(draft i+1 accepted | drafts
1..i accepted). Tokens emitted per verify round = accepted drafts + 1 (the target's bonus token). Built-ins ship as
JSON beside this module (`zlab`, `inhouse`); `none` means no speculation (one token per round, no spec fields).

    >>> load_profile("zlab").block_size
    16
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dfserve.errors import FieldError, describe_invalid
from dfserve.regular_files import read_regular

BUILTIN_DIR = Path(__file__).with_name("profiles")
NONE = "none"
BUILTINS = ("zlab", "inhouse", NONE)


class DrafterProfile(BaseModel):
    """One drafter's acceptance behaviour on a block; loaded from JSON, checked when built."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    name: str = Field(min_length=1, description="Shown in /server_info as the draft model's name.")
    description: str = ""
    block_size: int = Field(ge=2, le=64, description="Tokens per verify block: the last verified token + B-1 drafts.")
    conditional_accept: tuple[float, ...] = Field(
        description="B-1 probabilities; entry i is P(draft i+1 accepted | drafts 1..i accepted)."
    )

    @field_validator("conditional_accept")
    @classmethod
    def _probabilities(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        bad = [v for v in values if not 0.0 <= v <= 1.0]
        if bad:
            raise ValueError(f"probabilities must lie in [0, 1], got {bad}")
        return values

    @model_validator(mode="after")
    def _length(self) -> DrafterProfile:
        if len(self.conditional_accept) != self.block_size - 1:
            raise ValueError(
                f"conditional_accept has {len(self.conditional_accept)} entries; block_size "
                f"{self.block_size} needs {self.block_size - 1}"
            )
        return self

    def with_block_size(self, block_size: int) -> DrafterProfile:
        """The same drafter verified in a shorter block: positions past the block are never drafted."""
        if block_size == self.block_size:
            return self
        if not 2 <= block_size <= self.block_size:
            raise FieldError(
                "block_size", f"{block_size} is outside 2..{self.block_size} (profile {self.name!r} "
                f"describes {self.block_size} positions)"
            )
        return self.model_copy(
            update={"block_size": block_size, "conditional_accept": self.conditional_accept[: block_size - 1]}
        )


def load_profile(name_or_path: str) -> DrafterProfile | None:
    """A built-in name (`zlab`, `inhouse`), `none` (returns None: no speculation), or a JSON file."""
    if name_or_path == NONE:
        return None
    path = BUILTIN_DIR / f"{name_or_path}.json" if name_or_path in BUILTINS else Path(name_or_path)
    if not path.suffix == ".json":
        raise FieldError("profile", f"{name_or_path!r} is neither one of {', '.join(BUILTINS)} nor a .json file")
    try:
        raw = json.loads(read_regular(path))
    except FileNotFoundError:
        raise FieldError("profile", f"{path}: no such file") from None
    except OSError as exc:
        raise FieldError("profile", f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise FieldError("profile", f"{path}: not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise FieldError("profile", f"{path}: invalid JSON ({exc})") from None
    try:
        return DrafterProfile.model_validate(raw)
    except ValidationError as exc:
        raise FieldError("profile", describe_invalid(exc, str(path))) from None
