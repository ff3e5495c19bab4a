"""Progress of a long evaluation (a 27B target on CPU takes hours): a bar with the time left per stage on a
terminal, and a plain line at most every 30 seconds elsewhere (logs, CI)::

    with progress.stage("scoring zlab", total=anchors) as stage:
        stage.advance(32)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

LINE_EVERY_S = 30.0


class Stage(Protocol):
    def advance(self, n: int) -> None: ...


@dataclass
class _Lines:
    console: Console
    description: str
    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= LINE_EVERY_S or self.done >= self.total:
            self.last = now
            elapsed = now - self.started
            left = elapsed / self.done * (self.total - self.done)
            self.console.print(f"{self.description}: {self.done}/{self.total}, {elapsed:.0f} s elapsed, "
                               f"about {left:.0f} s left", highlight=False)


@dataclass
class _Bar:
    bar: Progress
    task: TaskID

    def advance(self, n: int) -> None:
        self.bar.advance(self.task, n)


class EvalProgress:
    def __init__(self, console: Console) -> None:
        self.console = console

    @contextmanager
    def stage(self, description: str, total: int) -> Iterator[Stage]:
        if not self.console.is_terminal or self.console.quiet:
            yield _Lines(self.console, description, total)
            return
        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("left"), TimeRemainingColumn(), console=self.console)
        with bar:
            yield _Bar(bar, bar.add_task(description, total=total))
