"""Terminal output that reads at 80 columns: compact tables whose numbers never wrap, lines broken between words
on a terminal and kept whole in a pipe or log, durations as a person says them."""

from __future__ import annotations

import os
import sys
import textwrap

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text


def compact_table(title: str, columns: dict[str, bool]) -> Table:
    """A table for 80 columns: a rule under the header only, columns a space apart; `columns` maps each header (plain
    text, no markup) to whether it is a number (right-aligned, never wrapped). The first column, a name, is never
    wrapped either."""
    table = Table(title=Text(title), box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0), min_width=len(title))
    for position, (name, number) in enumerate(columns.items()):
        table.add_column(Text(name), justify="right" if number else "left", no_wrap=number or position == 0)
    return table


class Output(Console):
    """The console of a command's results on stdout. A reader that stops early (`| head`) silences the rest rather
    than ending the command: rich exits 1 there, which is a verdict's FAIL, and a command's status is its outcome's
    whatever was read of it."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def terminal_width(stderr: bool = False) -> int | None:
    """The width of the terminal on stdout (or stderr); None when it is a pipe or a file, whose lines stay whole."""
    console = Console(stderr=stderr)
    return console.width if console.is_terminal else None


def wrapped(text: str, width: int | None, indent: int = 0) -> str:
    """`text` broken between words to lines of at most `width` columns (a terminal would break them anywhere),
    continuation lines indented by `indent`; unchanged for no width."""
    if width is None:
        return text
    return textwrap.fill(text, width=max(width, indent + 20), subsequent_indent=" " * indent,
                         break_long_words=False, break_on_hyphens=False)


def duration(seconds: float) -> str:
    """42 s, 3 min 05 s, 1 h 20 min."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole // 60 % 60:02d} min"
