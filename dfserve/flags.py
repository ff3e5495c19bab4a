"""Click types shared by the commands' flags."""

from __future__ import annotations

import math
from typing import Any

import click

from dfserve.errors import UserError


class FiniteFloat(click.FloatRange):
    """A number flag within optional bounds that refuses `nan` and `inf`, which float() reads from text: `nan`
    passes every comparison with a bound, and an alert at `> inf` can never fire."""

    name = "finite number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            flag = param.opts[0] if param is not None and param.opts else "a number"
            raise UserError(f"{flag}: {value!r} is not a finite number")
        return number

    def _describe_range(self) -> str:
        """No bounds, nothing to say in the help (click would print `x<=None`)."""
        return super()._describe_range() if self.min is not None or self.max is not None else ""


FINITE = FiniteFloat()
