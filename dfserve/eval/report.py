"""report.html of an evaluation: settings, the health figure, τ per drafter and method with intervals, the paired
judgements, the per-position accuracy curves and the τ histograms; self-contained (inline SVG)."""

from __future__ import annotations

import html

from dfserve.eval.records import EvalConfig, EvalSummary
from dfserve.svg import page, svg_histogram, svg_lines, table
from dfserve.verdict.report import VERDICT_STYLE, status_html, verdict_html
from dfserve.verdict.results import Judgement
from dfserve.verdict.wording import change_header, metric_change, metric_value, pairs_in_words, rule_needs


def _row(label: str, values: list[str]) -> str:
    return f"<tr><th>{html.escape(label)}</th>" + "".join(f"<td>{html.escape(v)}</td>" for v in values) + "</tr>"


def _verdict(j: Judgement) -> str:
    """A paired judgement as the page opens with it: the verdict, then each rule's status and why."""
    rules = "".join(f"<li>{status_html(r.status)} {html.escape(r.metric)}: {html.escape(r.detail + rule_needs(r))}"
                    "</li>" for r in j.rules)
    return (f"<h2>{html.escape(j.candidate)} against {html.escape(j.baseline)}</h2>{verdict_html(j.verdict)}"
            f"<p>{html.escape(pairs_in_words(j))}.</p><ul>{rules}</ul>")


def _changes(j: Judgement) -> str:
    rows = "".join(_row(m.label, [metric_value(m, m.baseline), metric_value(m, m.candidate), metric_change(m)])
                   for m in j.metrics)
    return (f"<h3>{html.escape(j.candidate)} against {html.escape(j.baseline)}</h3>"
            + table([_row('', ['baseline', 'candidate', change_header(False)]), rows]))


def render_html(config: EvalConfig, summary: EvalSummary) -> str:
    names = [d.drafter for d in summary.drafters]
    methods = config.methods()
    rows = [_row("", names)]
    for method in methods:
        figures = [d.method(method) for d in summary.drafters]
        rows.append(_row(f"τ {method} [95% CI]", [
            f"{m.tau.estimate:.3f} [{m.tau.low:.3f}, {m.tau.high:.3f}], {m.rounds} rounds" for m in figures]))
        rows.append(_row(f"accepted drafts {method}", [f"{m.accepted_drafts:.3f}" for m in figures]))
    rows.append(_row("τ vanilla as SGLang counts", [f"{d.method('vanilla').tau_as_sglang:.3f}" for d in summary.drafters]))
    rows.append(_row("anchors scored", [str(d.anchors) for d in summary.drafters]))
    health = config.features.health
    warning = f"<p><strong>Warning: {html.escape(health.warning)}</strong></p>" if health.warning else ""
    curves = svg_lines("draft accuracy per block position", {
        **{d.drafter: [None, *d.positions.accuracy] for d in summary.drafters},
        **{f"{d.drafter} | earlier matched": [None, *d.positions.accuracy_after_hits] for d in summary.drafters},
    }, "block position (1: first drafted token)", "accuracy (share of anchors)")
    histograms = [svg_histogram(f"tokens accepted per verify round, {m}",
                                {d.drafter: d.method(m).histogram for d in summary.drafters}) for m in methods]
    settings = (
        f"target {config.target.model} (sha256 {config.target.sha256[:12]}), {len(config.tasks.tasks)} tasks of "
        f"{config.tasks.name}, max_new_tokens {config.max_new_tokens}, prompts {config.prompt.format}"
        f"{' (thinking)' if config.prompt.thinking else ''}, references from {config.references.source}, features "
        f"{config.features.key}{' (reused)' if config.features.reused else ''}, dtype {config.dtype}. Intervals are 95%, "
        "resampling tasks."
    )
    body = (
        f"<h1>Offline evaluation {html.escape(config.run_id)}</h1>"
        + ("<p><strong>Interrupted: partial run.</strong></p>" if summary.interrupted else "")
        + "".join(_verdict(j) for j in summary.judgements)
        + f"<h2>Settings and scores</h2><p>{html.escape(settings)}</p>{warning}<p>Health: the target's own greedy "
        f"choice matches the reference at {health.agree}/{health.positions} positions ({health.fraction:.4f}).</p>"
        + table(rows) + "".join(_changes(j) for j in summary.judgements)
        + "<div class='plots'>" + curves + "".join(histograms) + "</div>"
    )
    return page(config.run_id, body, VERDICT_STYLE)
