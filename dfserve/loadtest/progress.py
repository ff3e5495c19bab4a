"""Live view of a run: per arm, requests done, errors, output tokens/s and acceptance so far (rich)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table

from dfserve.loadtest import records as rec
from dfserve.loadtest.records import RequestRecord


@dataclass
class ArmTally:
    done: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    rounds: int = 0
    accepted_tokens: int = 0


class Progress:
    """An observer of records; rich redraws the table twice a second from its own thread, only on a terminal."""

    def __init__(self, arms: list[str], total: int, console: Console | None = None) -> None:
        self.tallies = {arm: ArmTally() for arm in arms}
        self.total = total
        self.started = time.perf_counter()
        self.console = console or Console(stderr=True)
        self._live = Live(console=self.console, refresh_per_second=2, get_renderable=self._table)

    def observe(self, r: RequestRecord) -> None:
        tally = self.tallies[r.arm]
        tally.done += 1
        if r.error_kind is not None:
            tally.errors[r.error_kind] += 1
            return
        tally.tokens += r.completion_tokens or 0
        rounds = rec.verify_rounds(r)
        if rounds:
            tally.rounds += rounds
            tally.accepted_tokens += r.completion_tokens or 0

    def _table(self) -> Table:
        elapsed = max(1e-9, time.perf_counter() - self.started)
        table = Table(title=f"load test, {elapsed:.0f} s")
        for column in ("arm", "done", "errors", "output tok/s", "τ so far"):
            table.add_column(column, justify="right" if column != "arm" else "left")
        for arm, t in self.tallies.items():
            errors = ", ".join(f"{k}={v}" for k, v in sorted(t.errors.items())) or "0"
            tau = f"{t.accepted_tokens / t.rounds:.2f}" if t.rounds else "-"
            table.add_row(arm, f"{t.done}/{self.total}", errors, f"{t.tokens / elapsed:.0f}", tau)
        return table

    def __enter__(self) -> Progress:
        if self.console.is_terminal:
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live.is_started:
            self._live.stop()
