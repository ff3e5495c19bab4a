"""report.html of a verdict, beside its verdict.json: the verdict first (with what it was forced past), each rule
with its interval against its limit, the metrics with the change of the candidate against the baseline, the
identical outputs, where both sides come from, and the changes drawn with their intervals.

Pure: a `Verdict` in, one self-contained HTML page out (every string from the runs is escaped); the same page for
a load test's verdict and an offline evaluation's.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from dfserve.runs import write_atomic
from dfserve.svg import page, svg_forest, svg_interval, table
from dfserve.verdict import wording
from dfserve.verdict.gate import Rule
from dfserve.verdict.results import NOT_JUDGED, Judgement, Lossless, MetricResult, RuleResult
from dfserve.verdict.verdict import Side, Verdict

_COLOUR = {"PASS": "#1e7b34", "FAIL": "#b3261e", "INCONCLUSIVE": "#8a5a00", "NOT_APPLICABLE": "#666"}
VERDICT_STYLE = (".verdict{font-size:clamp(1.5em,8vw,3em);font-weight:700;margin:0.2em 0;overflow-wrap:normal}"
          ".stamp{display:inline-block;border:3px solid #b3261e;color:#b3261e;font-weight:700;padding:0 0.4em;"
          "margin-right:0.5em;font-size:1.2em}"
          ".status{font-weight:700}.why{color:#b3261e}.note{color:#5f6368}")
REPORT = "report.html"


def _e(text: object) -> str:
    return html.escape(str(text))


def _row(cells: list[str], head: bool = False) -> str:
    """Cells already escaped (some hold markup)."""
    tag = "th" if head else "td"
    return "<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>"


def status_html(status: str) -> str:
    """A verdict's or a rule's status, in its colour (with `VERDICT_STYLE`)."""
    return f"<span class='status' style='color:{_COLOUR[status]}'>{_e(status)}</span>"


def verdict_html(verdict: str) -> str:
    """The verdict as a page opens with it: large, in its colour (with `VERDICT_STYLE`)."""
    return f"<p class='verdict' style='color:{_COLOUR[verdict]}'>{_e(verdict)}</p>"


def _change(m: MetricResult) -> str:
    """The change, with which way is better where there is one."""
    if m.change is None:
        return wording.metric_change(m)
    return wording.metric_change(m) + (" (higher is better)" if m.higher_is_better else " (lower is better)")


def rule_interval(rule: RuleResult, gate_rule: Rule | None, judgement: Judgement) -> tuple[float, float] | None:
    """The interval a rule was decided on, on the limit's own scale: how much worse the candidate is for
    `max_worse`, the identical fraction for `at_least`. A sequential judgement records it in the rule; a fixed-n
    one in the metric (its change, turned so that worse is positive) or in the identical outputs."""
    if rule.low is not None and rule.high is not None:
        return rule.low, rule.high
    if gate_rule is not None and gate_rule.at_least is not None:
        loss = judgement.lossless
        return (loss.low, loss.high) if loss is not None and loss.low is not None and loss.high is not None else None
    m = next((m for m in judgement.metrics if m.metric == rule.metric), None)
    if m is None or m.change_low is None or m.change_high is None:
        return None
    sign = -1.0 if m.higher_is_better else 1.0
    low, high = sorted((sign * m.change_low, sign * m.change_high))
    return low, high


def _limit_and_interval(rule: RuleResult, at_least: bool, relative: bool,
                        interval: tuple[float, float] | None) -> tuple[str, str, str]:
    """The limit as the table says it, as its bar marks it, and the interval on the limit's scale."""
    if at_least:
        return (f"identical fraction ≥ {rule.limit:.4g}", f"{rule.limit:.4g}",
                f"[{interval[0]:.4f}, {interval[1]:.4f}]" if interval is not None else "-")
    unit, kind = ("%", "relative") if relative else (" pts", "absolute")  # of the baseline's value; for rates
    mark = f"{rule.limit * 100:.4g}{unit}"
    shown = f"[{interval[0] * 100:+.2f}, {interval[1] * 100:+.2f}]{unit}" if interval is not None else "-"
    return f"worse by ≤ {mark} ({kind})", mark, shown


def _rules(verdict: Verdict) -> str:
    j = verdict.judgement
    gate = {r.metric: r for r in verdict.gate.rules}
    rows = [_row(["status", "rule", "limit", "interval", "interval against the limit"], head=True)]
    details = []
    for rule in j.rules:
        gate_rule = gate.get(rule.metric)
        at_least = gate_rule is not None and gate_rule.at_least is not None
        relative = any(m.relative for m in j.metrics if m.metric == rule.metric)
        interval = rule_interval(rule, gate_rule, j)
        limit, mark, shown = _limit_and_interval(rule, at_least, relative, interval)
        bar = (svg_interval(interval[0], interval[1], rule.limit, _COLOUR[rule.status],
                            f"{rule.metric}: interval {shown}, limit {limit}", mark) if interval is not None else "")
        rows.append(_row([status_html(rule.status), _e(rule.metric), _e(limit), _e(shown), bar]))
        details.append(f"<li>{status_html(rule.status)} {_e(rule.metric)}: "
                       f"{_e(rule.detail + wording.rule_needs(rule))}</li>")
    return ("<h2>Rules</h2><p>Each rule's 95% interval against its limit (the dashed line), coloured by the rule's "
            "status: how much worse the candidate may be, or the fraction of identical outputs it must reach. How each "
            "was decided is listed below the table.</p>"
            + table(rows) + f"<ul>{''.join(details)}</ul>")


def _metrics(verdict: Verdict) -> str:
    j = verdict.judgement
    header = wording.change_header(verdict.sequential is not None)
    rows = [_row(["metric", "baseline", "candidate", header, "n"], head=True)]
    rows += [_row([f"<span title='{_e(m.label)}'>{_e(m.metric)}</span>", _e(wording.metric_value(m, m.baseline)),
                   _e(wording.metric_value(m, m.candidate)), _e(_change(m)), _e(wording.sample_counts(m))])
             for m in j.metrics]
    return ("<h2>Metrics</h2><p>Change: the candidate against the baseline, relative (%) for ratios and quantiles, in "
            "points for rates; n is the number of samples on each side.</p>" + table(rows))


def _lossless(loss: Lossless | None) -> str:
    if loss is None:
        return ""
    interval = (f" (95% interval [{loss.low:.4f}, {loss.high:.4f}])"
                if loss.low is not None and loss.high is not None else "")
    fraction = f"{loss.fraction:.4f}" if loss.fraction is not None else "n/a"
    note = "" if loss.applicable else f" Losslessness is {NOT_JUDGED}."
    differing = ("<p>Differing tasks: " + ", ".join(f"<code>{_e(t)}</code>" for t in loss.differing_tasks) + "</p>"
                 if loss.differing_tasks else "<p>No task's outputs differ.</p>" if loss.pairs
                 else "<p>No pair's outputs could be compared.</p>")
    return (f"<h2>Losslessness</h2><p>{loss.identical} of {loss.pairs} paired outputs identical"
            f"{_e(wording.greedy_subset(loss.greedy_of))}: fraction {fraction}"
            f"{_e(interval)}.{_e(note)}</p>{differing}")


def _side_rows(verdict: Verdict) -> list[str]:
    sides: tuple[Side, Side] = (verdict.baseline, verdict.candidate)
    name = "arm" if verdict.source == "loadtest" else "drafter label"
    fields = [("run id", lambda s: s.run_id), ("run folder", lambda s: s.run_dir), (name, lambda s: s.name),
              ("target", lambda s: s.target), ("drafter", lambda s: s.drafter), ("URL", lambda s: s.url or "-"),
              ("simulated", lambda s: "yes" if s.simulated else "no")]
    return [_row(["", "baseline", "candidate"], head=True)] + [
        _row([_e(label), *(f"<code>{_e(get(s))}</code>" for s in sides)]) for label, get in fields]


def _provenance(verdict: Verdict) -> str:
    p = verdict.provenance
    gate = "; ".join(f"{r.metric} " + (f"at least {r.at_least}" if r.at_least is not None else f"max worse {r.max_worse}")
                     for r in verdict.gate.rules)
    facts = [f"gate: {gate} ({verdict.gate.bootstrap_draws} bootstrap draws, seed {verdict.gate.seed})",
             f"judged {p.created_at} on {p.host}, dfserve {p.versions.get('dfserve', '?')}, Python {p.python}",
             f"command: {' '.join(p.argv)}"]
    if verdict.features:
        facts.insert(0, f"feature cache: {verdict.features}")
    if verdict.sequential is not None:
        facts.insert(0, wording.sequential_in_words(verdict.sequential))
    return ("<h2>Provenance</h2>" + table(_side_rows(verdict)) + "<ul>"
            + "".join(f"<li>{_e(f)}</li>" for f in facts) + "</ul>")


def _plot(j: Judgement) -> str:
    rows = [(f"{m.metric} ({'%' if m.relative else 'pts'})", m.change * 100, (m.change_low or 0) * 100,
             (m.change_high or 0) * 100) for m in j.metrics if m.change is not None]
    return ("<h2>Changes</h2><div class='plots'>"
            + svg_forest("change of each metric, candidate vs baseline, with its 95% interval", rows,
                         "change, candidate vs baseline (% relative; points for rates)") + "</div>")


def render_verdict_html(verdict: Verdict, notes: Sequence[str] = (), judged: str | None = None) -> str:
    """`notes`: what the source of the pairs says beside the verdict; `judged`: what was judged, where the verdict's
    source does not say it (live traffic is judged as a load test is)."""
    j = verdict.judgement
    stamps = (["FORCED"] if verdict.forced else []) + (["INCOMPLETE DATA"] if verdict.incomplete else []) + (
        ["SIMULATED"] if verdict.baseline.simulated or verdict.candidate.simulated else [])
    why = ([f"Forced comparison of runs that differ: {'; '.join(verdict.mismatches)}"] if verdict.mismatches else []) + (
        [f"Forced verdict on incomplete data: {'; '.join(verdict.incomplete)}"] if verdict.incomplete else [])
    kind = judged or ("a load test" if verdict.source == "loadtest" else "an offline evaluation")
    needed = f" About {j.tasks_needed} distinct tasks would decide it." if j.tasks_needed else ""
    body = (
        f"<p>Verdict of {kind}</p>"
        + "".join(f"<span class='stamp'>{_e(s)}</span>" for s in stamps)
        + verdict_html(verdict.verdict)
        + f"<p>Candidate <strong>{_e(j.candidate)}</strong> against baseline <strong>{_e(j.baseline)}</strong>, "
        f"{_e(wording.pairs_in_words(j))}.{_e(needed)}</p>"
        + "".join(f"<p class='why'><strong>{_e(w)}</strong></p>" for w in why)
        + "".join(f"<p class='note'>{_e(n)}</p>" for n in notes)
        + _rules(verdict) + _metrics(verdict) + _lossless(j.lossless) + _plot(j) + _provenance(verdict)
    )
    return page(f"{verdict.verdict}: {j.candidate} vs {j.baseline}", body, VERDICT_STYLE)


def write_verdict_report(verdict: Verdict, folder: Path, notes: Sequence[str] = (), judged: str | None = None) -> Path:
    """report.html into the verdict's folder (`render_verdict_html`); returns the file."""
    path = folder / REPORT
    write_atomic(path, render_verdict_html(verdict, notes, judged))
    return path
