"""report.html of a watch: τ by step per method with the baseline's τ as a line, each block position's accuracy by
step, the projection's sentence and interval, and every checkpoint with its verdict; self-contained (inline SVG),
in the style every report shares."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from dfserve.eval.trend import Trend
from dfserve.svg import Series, page, svg_lines, svg_xy, table

_POSITIONS = 4
"""Block positions plotted by step (position 1 first); later ones are in the run's own report."""


def _row(cells: Sequence[str], head: bool = False) -> str:
    tag = "th" if head else "td"
    return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>"


def _bound(value: float | None, unbounded: str = "∞") -> str:
    return unbounded if value is None or not math.isfinite(value) else f"{value:.0f}"


def render_trend_html(trend: Trend, title: str) -> str:
    points = trend.points
    tau_series: list[Series] = [(f"τ {m}", [(p.step, p.tau[m].estimate) for p in points], "" if i == 0 else "6 3")
                                for i, m in enumerate(trend.methods)]
    baselines = [(f"baseline τ {m}", trend.baseline.tau[m].estimate) for m in trend.methods]
    tau_chart = svg_xy("τ by training step", "training step", "τ (tokens per verify round)", tau_series, baselines)
    accuracy_series: list[Series] = [
        (f"position {k + 1}", [(p.step, a) for p in points if len(p.accuracy) > k and (a := p.accuracy[k]) is not None],
         "") for k in range(_POSITIONS)]
    accuracy_chart = svg_xy("draft accuracy by training step, per block position", "training step",
                            "accuracy (share of anchors)", [s for s in accuracy_series if s[1]], y_range=(0.0, 1.0))
    curves = svg_lines("accuracy per block position: baseline, first and latest checkpoint", {
        "baseline": [None, *trend.baseline.accuracy],
        **({f"step {points[0].step}": [None, *points[0].accuracy],
            f"step {points[-1].step}": [None, *points[-1].accuracy]} if points else {}),
    }, "block position (1: first drafted token)", "accuracy (share of anchors)")
    projections = "".join(
        f"<li><strong>{html.escape(m)}: {html.escape(p.outcome.replace('_', ' '))}</strong>: {html.escape(p.detail)}"
        + (f" (crossing step {_bound(p.crossing_step, 'none')}, 95% interval [{_bound(p.crossing_low)}, "
           f"{_bound(p.crossing_high)}])" if p.outcome in ("will_reach", "undetermined") else "") + "</li>"
        for m, p in trend.projections.items())
    rows = [_row(["step", "checkpoint", *(f"τ {m} [95% CI]" for m in trend.methods), "verdict vs baseline"], True)]
    for p in points:
        rows.append(_row([str(p.step), p.checkpoint,
                           *(f"{p.tau[m].estimate:.3f} [{p.tau[m].low:.3f}, {p.tau[m].high:.3f}]" for m in trend.methods),
                           p.judgement.verdict]))
    passed = "".join(f"<li>{html.escape(kind)} {html.escape(c.checkpoint)}: {html.escape(c.detail)}</li>"
                     for kind, group in (("skipped", trend.skipped), ("corrupt", trend.corrupt)) for c in group)
    baseline = trend.baseline
    return page(f"Checkpoint trend {title}", (
        f"<h1>Checkpoint trend {html.escape(title)}</h1>"
        f"<p>{len(points)} checkpoints scored against the baseline {html.escape(baseline.drafter)} "
        f"({html.escape(baseline.identity)}, run {html.escape(baseline.run_id)}): "
        + ", ".join(f"τ {m} {baseline.tau[m].estimate:.3f}" for m in trend.methods)
        + f". Updated {html.escape(trend.updated_at)}.</p>"
        f"<h2>Projection</h2><ul>{projections}</ul>"
        f"<div class='plots'>{tau_chart}{accuracy_chart}{curves}</div>"
        f"<h2>Checkpoints</h2>{table(rows)}"
        + (f"<ul>{passed}</ul>" if passed else "")))
