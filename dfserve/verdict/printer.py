"""The one way a judgement reaches the terminal: a table of metrics that fits 80 columns (latencies in ms), the
rules with their intervals (a long one wraps under its own text), and the verdict; a forced verdict says first
what it was forced past."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from dfserve.verdict import wording
from dfserve.verdict.design import SequentialReport
from dfserve.verdict.results import NOT_JUDGED, Judgement
from dfserve.verdict.verdict import Verdict


def metrics_table(j: Judgement, title: str, sequential: bool = False) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("metric", "baseline", "candidate", wording.change_header(sequential), "n"):
        table.add_column(column, no_wrap=True)
    for m in j.metrics:
        table.add_row(m.metric, wording.metric_value(m, m.baseline), wording.metric_value(m, m.candidate),
                      wording.metric_change(m),
                      wording.sample_counts(m) if m.baseline is not None and m.candidate is not None else "0")
    return table


def print_judgement(console: Console, j: Judgement, sequential: SequentialReport | None = None,
                    simulated: bool = False) -> None:
    console.print(metrics_table(j, f"{j.candidate} vs {j.baseline}: {j.verdict}, {wording.pairs_in_words(j)}"
                                + (" (SIMULATED)" if simulated else ""), sequential is not None))
    loss = j.lossless
    if loss is not None:
        console.print(f"lossless: {loss.identical}/{loss.pairs} identical outputs{wording.greedy_subset(loss.greedy_of)}"
                      + ("" if loss.applicable else f" ({NOT_JUDGED})")
                      + (f"; differing tasks: {', '.join(loss.differing_tasks[:20])}" if loss.differing_tasks else ""))
    rules = Table.grid(padding=(0, 1), pad_edge=True)
    rules.add_column(no_wrap=True)
    rules.add_column()
    for rule in j.rules:
        rules.add_row(rule.status, f"{rule.metric}: {rule.detail}{wording.rule_needs(rule)}")
    console.print(rules)
    if sequential:
        console.print(f"{wording.sequential_in_words(sequential)}.")
    console.print(f"[bold]verdict: {j.verdict}[/]" +
                  (f" (about {j.tasks_needed} distinct tasks would decide it)" if j.tasks_needed else ""))


def print_verdict(console: Console, verdict: Verdict) -> None:
    if verdict.mismatches:
        console.print(f"[bold red]FORCED comparison of runs that differ:[/] {'; '.join(verdict.mismatches)}")
    if verdict.incomplete:
        console.print(f"[bold red]FORCED verdict on incomplete data:[/] {'; '.join(verdict.incomplete)}")
    print_judgement(console, verdict.judgement, verdict.sequential, verdict.baseline.simulated)
