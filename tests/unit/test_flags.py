"""Number flags: `nan` and `inf` refused naming the flag; help that says no bound where there is none."""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner

from dfserve.cli import COMMANDS, root
from dfserve.errors import UserError
from dfserve.flags import FINITE, FiniteFloat


def commands() -> Iterator[tuple[str, ...]]:
    """Every command's words, groups walked down."""
    context = click.Context(root)
    stack = [((name,), root.get_command(context, name)) for name in COMMANDS]
    while stack:
        words, command = stack.pop()
        yield words
        if isinstance(command, click.Group):
            stack += [((*words, name), command.get_command(context, name)) for name in command.list_commands(context)]


def test_no_help_shows_a_bound_of_none() -> None:
    """A number flag without bounds said `[x<=None]` after its help."""
    runner = CliRunner()
    seen = 0
    for words in commands():
        result = runner.invoke(root, [*words, "--help"])
        assert result.exit_code == 0, (words, result.output)
        assert "None]" not in result.output, words
        seen += "FINITE NUMBER" in result.output
    assert seen > 3  # the walk reached the commands that have such flags


def test_a_bounded_flag_still_says_its_bounds_and_nan_names_the_flag() -> None:
    option = click.Option(["--ratio"], type=FiniteFloat(min=0.0, max=1.0))
    assert "0<=x<=1" in (option.get_help_extra(click.Context(root)).get("range") or "")
    with pytest.raises(UserError, match=r"^--ratio: 'nan' is not a finite number$"):
        FINITE.convert("nan", option, None)
