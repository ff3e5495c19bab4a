"""Live view of a run: per arm, measured requests done (warm-up apart), errors, output tokens/s and acceptance so
far, and the time left where the end is known (rich, on a terminal); for a sequential run also each gate rule's
always-valid interval at the latest look and the requests projected to decide it. Where the console is not a
terminal (a pipe, `| tee`, a log file), one plain line every `plain_every_s` instead. Tables fit 80 columns.

A request the tester cancelled at its stop (Ctrl-C) is counted apart, as the summary and the verdict count it: it
was not answered, and it is no error of the arm."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from dfserve.loadtest import records as rec
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.sequential import SequentialMonitor
from dfserve.terminal import compact_table, duration
from dfserve.verdict.sequential import Look, RuleState, units_to_decide


@dataclass
class ArmTally:
    warmup_done: int = 0
    done: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    cancelled: int = 0
    tokens: int = 0
    rounds: int = 0
    accepted_tokens: int = 0


class Progress:
    """An observer of records. On a terminal rich redraws the view twice a second from its own thread; elsewhere a
    thread of its own prints a plain line every `plain_every_s`. Counts are of measured requests per arm
    (`measured` each, after `warmup` warm-up requests)."""

    def __init__(self, arms: list[str], measured: int, console: Console | None = None,
                 monitor: SequentialMonitor | None = None, warmup: int = 0, duration_s: float | None = None,
                 plain_every_s: float = 10.0) -> None:
        self.tallies = {arm: ArmTally() for arm in arms}
        self.measured = measured
        self.warmup = warmup
        self.duration_s = duration_s
        self.monitor = monitor
        self.plain_every_s = plain_every_s
        self.started = time.perf_counter()
        self.console = console or Console(stderr=True)
        self._rules: tuple[Look | None, Table | None] = (None, None)
        self._live = Live(console=self.console, refresh_per_second=2, get_renderable=self._render)
        self._stop = threading.Event()
        self._plain: threading.Thread | None = None

    def observe(self, r: RequestRecord) -> None:
        tally = self.tallies[r.arm]
        if r.warmup:
            tally.warmup_done += 1
            return
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

    def seconds_left(self, now: float | None = None) -> float | None:
        """Time to the end at the pace so far, where the end is known: every request sent, or --duration. A
        sequential run may stop at any look, so its end is not known."""
        if self.monitor is not None:
            return None
        elapsed = (now if now is not None else time.perf_counter()) - self.started
        left = [self.duration_s - elapsed] if self.duration_s is not None else []
        finished = sum(t.warmup_done + t.done for t in self.tallies.values())
        if finished:
            every = len(self.tallies) * (self.warmup + self.measured)
            left.append(elapsed * (every - finished) / finished)
        return max(0.0, min(left)) if left else None

    def _heading(self) -> str:
        elapsed = time.perf_counter() - self.started
        left = self.seconds_left()
        end = (f"until decided, at most {self.measured} per arm" if self.monitor is not None
               else f"about {duration(left)} left" if left is not None else "")
        return f"load test, {duration(elapsed)}" + (f", {end}" if end else "")

    def _count(self, t: ArmTally) -> str:
        if t.warmup_done < self.warmup and not t.done:
            return f"warm-up {t.warmup_done}/{self.warmup}"
        cancelled = f" ({t.cancelled} cancelled)" if t.cancelled else ""
        return f"{t.done}/{self.measured}{cancelled}"

    def _render(self) -> Group:
        return Group(self._table(), *([rules] if (rules := self._rules_table()) is not None else []))

    def _table(self) -> Table:
        elapsed = max(1e-9, time.perf_counter() - self.started)
        table = compact_table(self._heading(), {"arm": False, "done": True, "errors": False, "out tok/s": True,
                                                "τ so far": True})
        for arm, t in self.tallies.items():
            errors = ", ".join(f"{k}={v}" for k, v in sorted(t.errors.items())) or "0"
            tau = f"{t.accepted_tokens / t.rounds:.2f}" if t.rounds else "-"
            table.add_row(arm, self._count(t), errors, f"{t.tokens / elapsed:.0f}", tau)
        return table

    def line(self) -> str:
        """The view as one plain line, for a log."""
        elapsed = max(1e-9, time.perf_counter() - self.started)
        arms = []
        for arm, t in self.tallies.items():
            errors = sum(t.errors.values())
            tau = f", τ {t.accepted_tokens / t.rounds:.2f}" if t.rounds else ""
            arms.append(f"{arm} {self._count(t)}, {errors} errors, {t.tokens / elapsed:.0f} tok/s{tau}")
        look = self.monitor.latest if self.monitor is not None else None
        gate = f"; look {look.number}: {look.verdict} so far" if look is not None else ""
        return f"{self._heading()}: " + "; ".join(arms) + gate

    def _rules_table(self) -> Table | None:
        """Built once per look (projections search over future sample sizes), in rich's thread, off the loop."""
        if self.monitor is None or self.monitor.latest is None:
            return None
        look = self.monitor.latest
        if self._rules[0] is not look:
            table = compact_table(f"gate at look {look.number}: {look.pairs} pairs over {look.tasks} tasks, "
                                  f"verdict so far {look.verdict}" + (f" ({look.stop})" if look.stop else ""),
                                  {"rule": False, "status": False, "change\n[always-valid]": True, "limit": True,
                                   "to a decision": False})
            for rule in look.rules:
                table.add_row(rule.metric, rule.status, _interval(rule), f"{rule.limit:.4g}",
                              _projection(rule, look, self.monitor.task_count))
            self._rules = (look, table)
        return self._rules[1]

    def _print_lines(self) -> None:
        while not self._stop.wait(self.plain_every_s):
            self.console.print(self.line(), soft_wrap=True, highlight=False, markup=False)

    def __enter__(self) -> Progress:
        if self.console.is_terminal:
            self._live.start()
        elif not self.console.quiet:
            self._plain = threading.Thread(target=self._print_lines, name="dfserve-progress", daemon=True)
            self._plain.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live.is_started:
            self._live.stop()
        if self._plain is not None:
            self._stop.set()
            self._plain.join()


def _interval(rule: RuleState) -> str:
    if rule.estimate is None or rule.low is None or rule.high is None:
        return "-"
    return f"{rule.estimate:+.3f} [{rule.low:+.3f}, {rule.high:+.3f}]"


def _projection(rule: RuleState, look: Look, task_count: int) -> str:
    """More requests per arm at which the interval would decide if the data went on as so far; for a rule that
    repeats cannot help, distinct tasks, and whether the task set holds that many."""
    if rule.status != "INCONCLUSIVE":
        return "decided"
    needed = units_to_decide(rule)
    if needed is None:
        return "out of reach"
    if rule.per_task and needed > task_count:
        return f"~{needed} tasks (the set has {task_count})"
    if rule.per_task:
        return f"~{max(0, needed - look.tasks)} more tasks (of {task_count})"
    return f"~{max(0, needed - look.pairs)} more requests"
