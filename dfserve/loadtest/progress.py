"""Live view of a run: per arm, requests done, errors, output tokens/s and acceptance so far (rich); for a sequential
run also each gate rule's always-valid interval at the latest look and the requests projected to decide it.

A request the tester cancelled at its stop (Ctrl-C) is counted apart, as the summary and the verdict count it: it
was not answered, and it is no error of the arm."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from dfserve.loadtest import records as rec
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.sequential import SequentialMonitor
from dfserve.verdict.sequential import Look, RuleState, units_to_decide


@dataclass
class ArmTally:
    done: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    cancelled: int = 0
    tokens: int = 0
    rounds: int = 0
    accepted_tokens: int = 0


class Progress:
    """An observer of records; rich redraws the table twice a second from its own thread, only on a terminal."""

    def __init__(self, arms: list[str], total: int, console: Console | None = None,
                 monitor: SequentialMonitor | None = None) -> None:
        self.tallies = {arm: ArmTally() for arm in arms}
        self.total = total
        self.monitor = monitor
        self.started = time.perf_counter()
        self.console = console or Console(stderr=True)
        self._live = Live(console=self.console, refresh_per_second=2, get_renderable=self._render)
        self._rules: tuple[Look | None, Table | None] = (None, None)

    def observe(self, r: RequestRecord) -> None:
        tally = self.tallies[r.arm]
        if r.cancelled:
            tally.cancelled += 1
            return
        tally.done += 1
        if r.error_kind is not None:
            tally.errors[r.error_kind] += 1
            return
        tally.tokens += r.completion_tokens or 0
        rounds = rec.verify_rounds(r)
        if rounds:
            tally.rounds += rounds
            tally.accepted_tokens += r.completion_tokens or 0

    def _render(self) -> Group:
        return Group(self._table(), *([rules] if (rules := self._rules_table()) is not None else []))

    def _table(self) -> Table:
        elapsed = max(1e-9, time.perf_counter() - self.started)
        table = Table(title=f"load test, {elapsed:.0f} s")
        for column in ("arm", "done", "errors", "output tok/s", "τ so far"):
            table.add_column(column, justify="right" if column != "arm" else "left")
        for arm, t in self.tallies.items():
            errors = ", ".join(f"{k}={v}" for k, v in sorted(t.errors.items())) or "0"
            tau = f"{t.accepted_tokens / t.rounds:.2f}" if t.rounds else "-"
            cancelled = f" ({t.cancelled} cancelled)" if t.cancelled else ""
            table.add_row(arm, f"{t.done}/{self.total}{cancelled}", errors, f"{t.tokens / elapsed:.0f}", tau)
        return table

    def _rules_table(self) -> Table | None:
        """Built once per look (projections search over future sample sizes), in rich's thread, off the loop."""
        if self.monitor is None or self.monitor.latest is None:
            return None
        look = self.monitor.latest
        if self._rules[0] is not look:
            table = Table(title=f"gate at look {look.number}: {look.pairs} pairs over {look.tasks} tasks, "
                                f"verdict so far {look.verdict}" + (f" ({look.stop})" if look.stop else ""))
            for column in ("rule", "status", "estimate [always-valid interval]", "limit", "to a decision"):
                table.add_column(column, justify="left" if column in ("rule", "status") else "right")
            for rule in look.rules:
                table.add_row(rule.metric, rule.status, _interval(rule), f"{rule.limit:.4g}",
                              _projection(rule, look, self.monitor.task_count))
            self._rules = (look, table)
        return self._rules[1]

    def __enter__(self) -> Progress:
        if self.console.is_terminal:
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live.is_started:
            self._live.stop()


def _interval(rule: RuleState) -> str:
    if rule.estimate is None or rule.low is None or rule.high is None:
        return "-"
    return f"{rule.estimate:+.4f} [{rule.low:+.4f}, {rule.high:+.4f}]"


def _projection(rule: RuleState, look: Look, task_count: int) -> str:
    """More requests per arm at which the interval would decide if the data went on as so far; for a rule that
    repeats cannot help, distinct tasks, and whether the task set holds that many."""
    if rule.status != "INCONCLUSIVE":
        return "decided"
    needed = units_to_decide(rule)
    if needed is None:
        return "out of reach"
    if rule.per_task and needed > task_count:
        return f"~{needed} distinct tasks; the set has {task_count}"
    if rule.per_task:
        return f"~{max(0, needed - look.tasks)} more distinct tasks (of {task_count})"
    return f"~{max(0, needed - look.pairs)} more requests"
