"""The one way a judgement reaches the terminal: a table of metrics that fits 80 columns (latencies in ms), the
rules with their intervals (a long one wraps under its own text), and the verdict; a forced verdict says first
what it was forced past."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from dfserve.verdict.design import SequentialReport
from dfserve.verdict.results import Judgement, MetricResult
from dfserve.verdict.verdict import Verdict


def _value(m: MetricResult, value: float) -> str:
    return f"{value * 1e3:.4g} ms" if m.unit == "s" else f"{value:.4g}"


def _change(m: MetricResult) -> str:
    unit = "%" if m.relative else " pts"
    return (f"{m.change * 100:+.1f}{unit} [{(m.change_low or 0) * 100:+.1f}, {(m.change_high or 0) * 100:+.1f}]"
            if m.change is not None else "")


def metrics_table(j: Judgement, title: str, sequential: bool = False) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("metric", "baseline", "candidate", "change [95% CI" + (", fixed-n]" if sequential else "]"), "n"):
        table.add_column(column, no_wrap=True)
    for m in j.metrics:
        n = str(m.n_baseline) if m.n_baseline == m.n_candidate else f"{m.n_baseline}/{m.n_candidate}"
        if m.baseline is None or m.candidate is None:
            table.add_row(m.metric, "-", "-", "no data", "0")
        elif m.change is None:
            table.add_row(m.metric, _value(m, m.baseline), _value(m, m.candidate), "baseline is 0", n)
        else:
            table.add_row(m.metric, _value(m, m.baseline), _value(m, m.candidate), _change(m), n)
    return table


def print_judgement(console: Console, j: Judgement, sequential: SequentialReport | None = None,
                    simulated: bool = False) -> None:
    units = f"{j.tasks} paired tasks" if j.pairs == j.tasks else f"{j.pairs} pairs over {j.tasks} tasks"
    console.print(metrics_table(j, f"{j.candidate} vs {j.baseline}: {j.verdict}, {units}"
                                + (" (SIMULATED)" if simulated else ""), sequential is not None))
    loss = j.lossless
    if loss is not None:
        console.print(f"lossless: {loss.identical}/{loss.pairs} identical outputs"
                      + ("" if loss.applicable else " (temperature > 0: not judged)")
                      + (f"; differing tasks: {', '.join(loss.differing_tasks[:20])}" if loss.differing_tasks else ""))
    rules = Table.grid(padding=(0, 1), pad_edge=True)
    rules.add_column(no_wrap=True)
    rules.add_column()
    for rule in j.rules:
        needed = (f" (about {rule.tasks_needed} distinct tasks needed)" if rule.tasks_needed else
                  f" (about {rule.requests_needed} paired requests needed)" if rule.requests_needed else "")
        rules.add_row(rule.status, f"{rule.metric}: {rule.detail}{needed}")
    console.print(rules)
    if sequential:
        seq = sequential
        where = " on live traffic (mirrored pairs in request order)" if seq.live else ""
        console.print(f"sequential{where}: {seq.method}; alpha {seq.design.alpha}, a look every "
                      f"{seq.design.look_every} pairs, decisions from {seq.design.min_tasks} tasks. The run stopped at "
                      f"look {seq.looks} after "
                      f"{seq.stopped_after_pairs} pairs ({seq.stopped}, {seq.verdict_when_stopped}); judged over "
                      f"{seq.pairs} pairs. The table's intervals are fixed-n, for reading only.")
    console.print(f"[bold]verdict: {j.verdict}[/]" +
                  (f" (about {j.tasks_needed} distinct tasks would decide it)" if j.tasks_needed else ""))


def print_verdict(console: Console, verdict: Verdict) -> None:
    if verdict.mismatches:
        console.print(f"[bold red]FORCED comparison of runs that differ:[/] {'; '.join(verdict.mismatches)}")
    if verdict.incomplete:
        console.print(f"[bold red]FORCED verdict on incomplete data:[/] {'; '.join(verdict.incomplete)}")
    print_judgement(console, verdict.judgement, verdict.sequential, verdict.baseline.simulated)
