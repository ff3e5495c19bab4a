"""report.html of a watch: τ by step per method with the baseline's τ as a line, each block position's accuracy by
step, the projection's sentence and interval, and every checkpoint with its verdict; self-contained (inline SVG
drawn to the page's width)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from dfserve.eval.trend import Trend
from dfserve.svg import svg_lines

_W, _H, _LEFT, _RIGHT, _BOTTOM = 640, 320, 52, 16, 40
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")
_POSITIONS = 4
"""Block positions plotted by step (position 1 first); later ones are in the run's own report."""

Series = tuple[str, Sequence[tuple[float, float]], str]


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    return [low + (high - low) * i / (count - 1) for i in range(count)]


def svg_xy(title: str, xlabel: str, ylabel: str, series: Sequence[Series], hlines: Sequence[tuple[str, float]] = (),
           y_range: tuple[float, float] | None = None) -> str:
    """Points joined by lines over numeric x and y (each series: name, points, dash pattern), and labelled dotted
    horizontal reference lines, the i-th in the i-th series' colour; the y range covers every value unless given."""
    values = [y for _, points, _ in series for _, y in points] + [y for _, y in hlines]
    xs = [x for _, points, _ in series for x, _ in points]
    if not xs:
        return f"<p>{html.escape(title)}: no data</p>"
    y_low, y_high = y_range or (min(values), max(values))
    if y_high - y_low < 1e-9:
        y_low, y_high = y_low - 0.5, y_high + 0.5
    pad = (y_high - y_low) * 0.08 if y_range is None else 0.0
    y_low, y_high = y_low - pad, y_high + pad
    x_low, x_high = min(0.0, min(xs)), max(xs) if max(xs) > min(0.0, min(xs)) else min(0.0, min(xs)) + 1

    legend = [(name, _COLOURS[i % len(_COLOURS)], dash) for i, (name, _, dash) in enumerate(series)]
    legend += [(name, _COLOURS[i % len(_COLOURS)], "2 3") for i, (name, _) in enumerate(hlines)]
    placed, x, row = [], float(_LEFT), 0
    for name, colour, dash in legend:
        width = 28 + 6.2 * len(name)
        if x + width > _W - _RIGHT and x > _LEFT:
            x, row = float(_LEFT), row + 1
        placed.append((x, 30 + 15 * row, name, colour, dash))
        x += width
    top = 30 + 15 * row + 16

    def px(x: float) -> float:
        return _LEFT + (x - x_low) / (x_high - x_low) * (_W - _LEFT - _RIGHT)

    def py(y: float) -> float:
        return _H - _BOTTOM - (y - y_low) / (y_high - y_low) * (_H - top - _BOTTOM)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" role="img" '
             f'aria-label="{html.escape(title)}">',
             f'<text x="{_W / 2}" y="16" font-size="14" text-anchor="middle">{html.escape(title)}</text>',
             f'<line x1="{_LEFT}" y1="{_H - _BOTTOM}" x2="{_W - _RIGHT}" y2="{_H - _BOTTOM}" stroke="#333"/>',
             f'<line x1="{_LEFT}" y1="{top}" x2="{_LEFT}" y2="{_H - _BOTTOM}" stroke="#333"/>',
             f'<text x="{(_LEFT + _W - _RIGHT) / 2}" y="{_H - 6}" font-size="12" text-anchor="middle">'
             f'{html.escape(xlabel)}</text>',
             f'<text x="14" y="{(top + _H - _BOTTOM) / 2}" font-size="12" text-anchor="middle" '
             f'transform="rotate(-90 14 {(top + _H - _BOTTOM) / 2})">{html.escape(ylabel)}</text>']
    for x in _ticks(x_low, x_high):
        parts.append(f'<text x="{px(x):.1f}" y="{_H - _BOTTOM + 15}" font-size="10" text-anchor="middle">'
                     f'{x:.0f}</text>')
    for y in _ticks(y_low, y_high):
        parts.append(f'<text x="{_LEFT - 5}" y="{py(y) + 3:.1f}" font-size="10" text-anchor="end">{y:.2f}</text>'
                     f'<line x1="{_LEFT}" y1="{py(y):.1f}" x2="{_W - _RIGHT}" y2="{py(y):.1f}" stroke="#eee"/>')
    for i, (name, y) in enumerate(hlines):
        parts.append(f'<line x1="{_LEFT}" y1="{py(y):.1f}" x2="{_W - _RIGHT}" y2="{py(y):.1f}" '
                     f'stroke="{_COLOURS[i % len(_COLOURS)]}" stroke-width="1.5" stroke-dasharray="2 3">'
                     f'<title>{html.escape(name)}: {y:.3f}</title></line>')
    for i, (name, points, dash) in enumerate(series):
        colour = _COLOURS[i % len(_COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" stroke-dasharray="{dash}" '
                     f'points="{path}"/>')
        parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"><title>{html.escape(name)} '
                  f'step {x:.0f}: {y:.3f}</title></circle>' for x, y in points]
    for x, y, name, colour, dash in placed:
        parts.append(f'<line x1="{x:.1f}" y1="{y - 4}" x2="{x + 16:.1f}" y2="{y - 4}" stroke="{colour}" '
                     f'stroke-width="2" stroke-dasharray="{dash}"/><text x="{x + 20:.1f}" y="{y}" font-size="11">'
                     f'{html.escape(name)}</text>')
    return "".join(parts) + "</svg>"


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
    }, "block position")
    projections = "".join(
        f"<li><strong>{html.escape(m)}: {html.escape(p.outcome.replace('_', ' '))}</strong>: {html.escape(p.detail)}"
        + (f" (crossing step {_bound(p.crossing_step, 'none')}, 95% interval [{_bound(p.crossing_low)}, "
           f"{_bound(p.crossing_high)}])" if p.outcome in ("will_reach", "undetermined") else "") + "</li>"
        for m, p in trend.projections.items())
    table = [_row(["step", "checkpoint", *(f"τ {m} [95% CI]" for m in trend.methods), "verdict vs baseline"], True)]
    for p in points:
        table.append(_row([str(p.step), p.checkpoint,
                           *(f"{p.tau[m].estimate:.3f} [{p.tau[m].low:.3f}, {p.tau[m].high:.3f}]" for m in trend.methods),
                           p.judgement.verdict]))
    passed = "".join(f"<li>{html.escape(kind)} {html.escape(c.checkpoint)}: {html.escape(c.detail)}</li>"
                     for kind, group in (("skipped", trend.skipped), ("corrupt", trend.corrupt)) for c in group)
    baseline = trend.baseline
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><meta name='viewport' content='width=device-width, "
        f"initial-scale=1'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:1em auto;max-width:980px;padding:0 1em}"
        "td,th{padding:2px 8px;text-align:left;white-space:nowrap}table{border-collapse:collapse}"
        "tr:nth-child(even){background:#f4f4f4}.scroll{overflow-x:auto}svg{width:100%;height:auto;max-width:980px}"
        ".fixed svg{width:auto}</style></head><body>"
        f"<h1>Checkpoint trend {html.escape(title)}</h1>"
        f"<p>{len(points)} checkpoints scored against the baseline {html.escape(baseline.drafter)} "
        f"({html.escape(baseline.identity)}, run {html.escape(baseline.run_id)}): "
        + ", ".join(f"τ {m} {baseline.tau[m].estimate:.3f}" for m in trend.methods)
        + f". Updated {html.escape(trend.updated_at)}.</p>"
        f"<h2>Projection</h2><ul>{projections}</ul>"
        f"{tau_chart}{accuracy_chart}<div class='scroll fixed'>{curves}</div>"
        f"<h2>Checkpoints</h2><div class='scroll'><table>{''.join(table)}</table></div>"
        + (f"<ul>{passed}</ul>" if passed else "") + "</body></html>"
    )
