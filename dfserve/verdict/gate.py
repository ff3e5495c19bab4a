"""Gates: the rules a candidate must meet, read from a YAML file, checked against the metrics a source defines.

    rules:
      - {metric: accept_length, max_worse: 0.02}
      - {metric: lossless_fraction, at_least: 0.99}

`max_worse` is how much worse the candidate may be (relative for ratios and quantiles, absolute for rates);
`at_least` is the smallest fraction of identical outputs. A gate with no rule, or a limit that is not a finite
number, is refused when it is read: it would pass anything, or decide nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dfserve.errors import FieldError, UserError, describe_invalid
from dfserve.verdict.kinds import kind_of
from dfserve.verdict.pairs import MetricSpec
from dfserve.yamlfile import read_yaml

G = TypeVar("G", bound="Gate")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Rule(_Model):
    metric: str
    max_worse: float | None = Field(None, ge=0, allow_inf_nan=False, strict=True)
    at_least: float | None = Field(None, ge=0, le=1, allow_inf_nan=False, strict=True)

    @field_validator("max_worse", "at_least", mode="before")
    @classmethod
    def _number_read_as_text(cls, value: Any) -> Any:
        """YAML 1.1 reads `2e-2` (no decimal point) as text: say so, rather than that it is no number."""
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                return value
            if not math.isfinite(number):
                return value
            raise ValueError(f"{value!r} is text, not a number (YAML reads an exponent without a decimal point, as in "
                             f"2e-2, as text): write {number:g}")
        return value

    @model_validator(mode="after")
    def _one_limit(self) -> Rule:
        if (self.max_worse is None) == (self.at_least is None):
            raise ValueError(f"{self.metric}: give one of 'max_worse' or 'at_least'")
        return self

    @property
    def limit(self) -> float:
        limit = self.max_worse if self.max_worse is not None else self.at_least
        assert limit is not None
        return limit


MAX_BOOTSTRAP_DRAWS = 100_000
"""The most draws a gate may ask for: the bootstrap holds a weight per draw and task in memory (100,000 draws of
1,000 tasks are 800 MB)."""


class Gate(_Model):
    schema_version: Literal[1] = 1
    rules: tuple[Rule, ...]
    bootstrap_draws: int = Field(2000, ge=200, le=MAX_BOOTSTRAP_DRAWS, strict=True)
    seed: int = Field(0, ge=0, strict=True)

    @field_validator("rules")
    @classmethod
    def _some_rule(cls, rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
        if not rules:
            raise ValueError("a gate needs at least one rule (with none, any candidate would pass)")
        metrics = [rule.metric for rule in rules]
        if twice := sorted({metric for metric in metrics if metrics.count(metric) > 1}):
            raise ValueError(f"{twice[0]}: one rule per metric (which of two limits would hold is unclear)")
        return rules


def read_gate(path: Path | None, default: G) -> G:
    """The gate in a YAML file, or `default` without one; a bad file is a `FieldError` on `gate`."""
    if path is None:
        return default
    try:
        raw: Any = read_yaml(path)
    except UserError as exc:
        raise FieldError("gate", str(exc)) from None
    try:
        return type(default).model_validate(raw)
    except ValidationError as exc:
        raise FieldError("gate", describe_invalid(exc, str(path))) from None


def check_rules(gate: Gate, metrics: Mapping[str, MetricSpec[Any]], source: Path | None = None) -> None:
    """Every rule names one of `metrics` with the limit its kind takes; checked before anything is computed. A gate
    read from a file (`source`) is named in what is refused."""
    where = f"{source}: " if source is not None else ""
    for number, rule in enumerate(gate.rules):
        spec = metrics.get(rule.metric)
        if spec is None:
            raise FieldError("gate", f"{where}rules.{number}.metric: unknown metric {rule.metric!r} "
                             f"(known: {', '.join(metrics)})")
        kind = kind_of(spec)
        if getattr(rule, kind.limit) is None:
            raise FieldError("gate", f"{where}rules.{number}: {rule.metric} takes '{kind.limit}' only")
        if kind.vacuous(spec, rule.limit):
            raise FieldError("gate", f"{where}rules.{number}.{kind.limit}: {rule.limit:g} passes any candidate on "
                             f"{rule.metric}; a rule that judges nothing would stand for one that does")
