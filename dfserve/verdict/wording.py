"""How a judgement's figures read, the same in the terminal and in report.html: a metric's values (latencies in
ms), its change with its 95% interval, its sample counts, the pairs the judgement rests on, what an undecided rule
still needs and how a sequential run was decided; and what differs between two sides a verdict would pair, one
short line each."""

from __future__ import annotations

from typing import Any

from dfserve.verdict.design import SequentialReport
from dfserve.verdict.results import Judgement, MetricResult, RuleResult


def metric_value(m: MetricResult, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.4g} ms" if m.unit == "s" else f"{value:.4g}"


def metric_change(m: MetricResult) -> str:
    """`+3.1% [+1.0, +5.2]` (points for rates), or why there is no change to show."""
    if m.baseline is None or m.candidate is None:
        return "no data"
    if m.change is None:
        return "baseline is 0"
    unit = "%" if m.relative else " pts"
    return f"{m.change * 100:+.1f}{unit} [{(m.change_low or 0) * 100:+.1f}, {(m.change_high or 0) * 100:+.1f}]"


def sample_counts(m: MetricResult) -> str:
    return str(m.n_baseline) if m.n_baseline == m.n_candidate else f"{m.n_baseline}/{m.n_candidate}"


def change_header(sequential: bool) -> str:
    """A sequential run is decided on always-valid intervals; the table's are fixed-n, for reading."""
    return "change [95% CI" + (", fixed-n]" if sequential else "]")


def pairs_in_words(j: Judgement) -> str:
    return f"{j.tasks} paired tasks" if j.pairs == j.tasks else f"{j.pairs} pairs over {j.tasks} tasks"


def greedy_subset(of_pairs: int | None) -> str:
    """Which pairs an identical-output count is of, where only some of `of_pairs` were greedy."""
    return f" (the greedy pairs of {of_pairs})" if of_pairs is not None else ""


def rule_needs(rule: RuleResult) -> str:
    """What would decide an undecided rule, as a parenthesis after its detail; empty for a decided one."""
    if rule.tasks_needed:
        return f" (about {rule.tasks_needed} distinct tasks needed)"
    return f" (about {rule.requests_needed} paired requests needed)" if rule.requests_needed else ""


def sequential_in_words(s: SequentialReport) -> str:
    where = " on live traffic (mirrored pairs in request order)" if s.live else ""
    return (f"sequential{where}: {s.method}; alpha {s.design.alpha}, a look every {s.design.look_every} pairs, decisions from "
            f"{s.design.min_tasks} tasks; stopped at look {s.looks} after {s.stopped_after_pairs} pairs ({s.stopped}, "
            f"{s.verdict_when_stopped}), judged over {s.pairs} pairs; the metrics' intervals are fixed-n, for reading "
            "only")


def shown(value: Any) -> str:
    """A setting as a person reads it: `not set` for None, a content hash cut to 12 characters."""
    if value is None:
        return "not set"
    if isinstance(value, str) and len(value) >= 32 and all(c in "0123456789abcdef" for c in value):
        return value[:12] + "…"
    return str(value)


def differences(key: str, a: Any, b: Any) -> list[str]:
    """`key: A vs B` for each setting that differs between two sides, nested mappings by their dotted keys."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [line for k in dict.fromkeys([*a, *b]) for line in differences(f"{key}.{k}", a.get(k), b.get(k))]
    if a == b:
        return []
    if isinstance(a, dict) or isinstance(b, dict):
        return [f"{key}: {'set' if a is not None else 'not set'} vs {'set' if b is not None else 'not set'}"]
    return [f"{key}: {shown(a)} vs {shown(b)}"]
