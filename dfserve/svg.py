"""Inline SVG plots for self-contained HTML reports: CDFs, lines over an index or over numeric x, side-by-side
histograms, and the bar of an interval against a limit.

Every report.html (a load test's, an evaluation's, a watch's trend and a verdict's) draws with these, so a figure
looks the same in all: a title that says what is plotted, both axes labelled with their units, the legend in rows
above the plot area (where no line can run under it), and a viewBox, so a figure shrinks to a phone's width.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")
_W, _H, _LEFT, _RIGHT, _BOTTOM = 520, 280, 56, 16, 40
Series = tuple[str, Sequence[tuple[float, float]], str]
"""A line over numeric x: its name, its (x, y) points and its dash pattern ('' for solid)."""


def nice_ticks(low: float, high: float, most: int = 6) -> list[tuple[float, str]]:
    """Ticks at round values (1, 2, 2.5 or 5 times a power of ten apart) inside [low, high], at most `most` + 1 of
    them, each labelled with the decimals its step needs: a label reads as the value its line is drawn at."""
    span = high - low
    if not (math.isfinite(span) and span > 1e-12 * max(1.0, abs(low), abs(high))):  # flat, or past a float's digits
        return [(low, f"{low:g}")]
    power = 10.0 ** math.floor(math.log10(span / most))
    step, mantissa = next((m * power, m) for m in (1.0, 2.0, 2.5, 5.0, 10.0) if span / (m * power) <= most)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9) + (1 if mantissa == 2.5 else 0))
    first = math.ceil(low / step - 1e-9)
    ticks = []
    for value in ((first + i) * step for i in range(math.floor(high / step + 1e-9) - first + 1)):
        label = f"{value:.{decimals}f}"
        ticks.append((value, label.lstrip("-") if float(label) == 0 else label))
    return ticks


@dataclass(frozen=True)
class _Plot:
    """Where data lands: the plot area between the legend and the x axis, and the data ranges it spans."""

    x_low: float
    x_high: float
    y_low: float
    y_high: float
    top: float
    width: int
    height: int

    def px(self, x: float) -> float:
        span = self.x_high - self.x_low or 1.0
        return _LEFT + (x - self.x_low) / span * (self.width - _LEFT - _RIGHT)

    def py(self, y: float) -> float:
        span = self.y_high - self.y_low or 1.0
        return self.height - _BOTTOM - (y - self.y_low) / span * (self.height - self.top - _BOTTOM)


def _open(title: str, xlabel: str, ylabel: str, legend: Sequence[tuple[str, str, str]], x_range: tuple[float, float],
          y_range: tuple[float, float], x_ticks: Sequence[tuple[float, str]] | None = None,
          size: tuple[int, int] = (_W, _H)) -> tuple[list[str], _Plot]:
    """The figure up to its data: title, legend rows (name, colour, dash), axes with their labels, ticks and grid."""
    width, height = size
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
             f'height="{height}" role="img" aria-label="{html.escape(title)}">',
             f'<text x="{width / 2}" y="16" font-size="13" text-anchor="middle">{html.escape(title)}</text>']
    x, row = float(_LEFT), 0
    for name, colour, dash in legend:
        room = 24 + 6.5 * len(name)
        if x + room > width - _RIGHT and x > _LEFT:
            x, row = float(_LEFT), row + 1
        y = 32 + 14 * row
        parts.append(f'<line x1="{x:.1f}" y1="{y - 4}" x2="{x + 14:.1f}" y2="{y - 4}" stroke="{colour}" '
                     f'stroke-width="3" stroke-dasharray="{dash}"/><text x="{x + 18:.1f}" y="{y}" font-size="11" '
                     f'fill="{colour}">{html.escape(name)}</text>')
        x += room + 12
    plot = _Plot(*x_range, *y_range, top=32 + 14 * row + 14 if legend else 30, width=width, height=height)
    bottom, middle = height - _BOTTOM, (plot.top + height - _BOTTOM) / 2
    parts += [f'<line x1="{_LEFT}" y1="{bottom}" x2="{width - _RIGHT}" y2="{bottom}" stroke="#333"/>',
              f'<line x1="{_LEFT}" y1="{plot.top}" x2="{_LEFT}" y2="{bottom}" stroke="#333"/>',
              f'<text x="{(_LEFT + width - _RIGHT) / 2}" y="{height - 6}" font-size="12" text-anchor="middle">'
              f'{html.escape(xlabel)}</text>',
              f'<text x="14" y="{middle:.1f}" font-size="12" text-anchor="middle" '
              f'transform="rotate(-90 14 {middle:.1f})">{html.escape(ylabel)}</text>']
    for value, label in nice_ticks(plot.y_low, plot.y_high):
        y_px = plot.py(value)
        parts.append(f'<line x1="{_LEFT}" y1="{y_px:.1f}" x2="{width - _RIGHT}" y2="{y_px:.1f}" stroke="#eee"/>'
                     f'<text x="{_LEFT - 5}" y="{y_px + 3:.1f}" font-size="10" text-anchor="end">{label}</text>')
    ticks = x_ticks if x_ticks is not None else nice_ticks(plot.x_low, plot.x_high)
    for value, label in ticks:
        parts.append(f'<text x="{plot.px(value):.1f}" y="{bottom + 15}" font-size="10" text-anchor="middle">'
                     f'{html.escape(label)}</text>')
    return parts, plot


def _legend(names: Sequence[str]) -> list[tuple[str, str, str]]:
    return [(name, COLOURS[i % len(COLOURS)], "") for i, name in enumerate(names)]


def _polyline(points: Sequence[tuple[float, float]], colour: str, dash: str = "") -> str:
    """A line through `points`; a single point, which a line would not show, as a dot."""
    if len(points) == 1:
        return f'<circle cx="{points[0][0]:.1f}" cy="{points[0][1]:.1f}" r="2.5" fill="{colour}"/>'
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return (f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" stroke-dasharray="{dash}" '
            f'points="{path}"/>')


def svg_cdf(title: str, series: dict[str, list[float]], xlabel: str, ylabel: str,
            unit_scale: float = 1000.0) -> str:
    """Empirical CDFs, one line per arm: x is a value times `unit_scale` (seconds to ms by default; `xlabel` names
    the unit), up to each arm's p99.5 so a tail does not flatten the rest; y the fraction of samples at or below."""
    present = {name: np.sort(np.asarray(v, dtype=float)) * unit_scale for name, v in series.items() if v}
    if not present:
        return f"<p>{html.escape(title)}: no samples</p>"
    top = max(float(np.quantile(v, 0.995)) for v in present.values()) or 1.0
    parts, plot = _open(title, xlabel, ylabel, _legend(list(present)), (0.0, top), (0.0, 1.0))
    for values, colour in zip(present.values(), COLOURS, strict=False):
        step = max(1, len(values) // 400)
        parts.append(_polyline([(plot.px(min(x, top)), plot.py((i + 1) / len(values)))
                                for i, x in list(enumerate(values))[::step]], colour))
    return "".join(parts) + "</svg>"


def svg_lines(title: str, series: dict[str, list[float | None]], xlabel: str, ylabel: str) -> str:
    """One line per series over x = 0, 1, 2, ... (the list index) on a 0..1 scale (shares); None is no point."""
    present = {name: values for name, values in series.items() if any(v is not None for v in values)}
    if not present:
        return f"<p>{html.escape(title)}: no data</p>"
    last = max(len(v) for v in present.values()) - 1
    ticks = [(float(k), str(k)) for k in range(0, last + 1, max(1, last // 8))]
    parts, plot = _open(title, xlabel, ylabel, _legend(list(present)), (0.0, float(max(1, last))), (0.0, 1.0), ticks)
    for values, colour in zip(present.values(), COLOURS, strict=False):
        parts.append(_polyline([(plot.px(i), plot.py(v)) for i, v in enumerate(values) if v is not None], colour))
    return "".join(parts) + "</svg>"


def svg_histogram(title: str, series: dict[str, list[int]], xlabel: str = "tokens accepted per verify round",
                  ylabel: str = "share of verify rounds") -> str:
    """Share of verify rounds that emitted k tokens, bars side by side per arm, one slot per k."""
    present = {name: counts for name, counts in series.items() if sum(counts)}
    if not present:
        return f"<p>{html.escape(title)}: no verify rounds recorded</p>"
    width = max(len(c) for c in present.values())
    shares = {name: [c / sum(counts) for c in counts] + [0.0] * (width - len(counts)) for name, counts in present.items()}
    top = max(max(s) for s in shares.values()) or 1.0
    ticks = [(k + 0.5, str(k)) for k in range(0, width, max(1, width // 12))]
    parts, plot = _open(title, xlabel, ylabel, _legend(list(shares)), (0.0, float(width)), (0.0, top), ticks)
    slot = plot.px(1) - plot.px(0)
    bar = slot / (len(shares) + 1)
    for a, ((name, share), colour) in enumerate(zip(shares.items(), COLOURS, strict=False)):
        for k, value in enumerate(share):
            y = plot.py(value)
            parts.append(f'<rect x="{plot.px(k) + bar / 2 + a * bar:.1f}" y="{y:.1f}" width="{bar:.1f}" '
                         f'height="{plot.py(0) - y:.1f}" fill="{colour}"><title>{html.escape(name)} k={k}: '
                         f'{value:.3f}</title></rect>')
    return "".join(parts) + "</svg>"


def svg_xy(title: str, xlabel: str, ylabel: str, series: Sequence[Series], hlines: Sequence[tuple[str, float]] = (),
           y_range: tuple[float, float] | None = None) -> str:
    """Points joined by lines over numeric x and y, and labelled dotted horizontal reference lines, the i-th in the
    i-th series' colour; the y range covers every value unless given."""
    values = [y for _, points, _ in series for _, y in points] + [y for _, y in hlines]
    xs = [x for _, points, _ in series for x, _ in points]
    if not xs:
        return f"<p>{html.escape(title)}: no data</p>"
    y_low, y_high = y_range or (min(values), max(values))
    if y_high - y_low < 1e-9:
        y_low, y_high = y_low - 0.5, y_high + 0.5
    pad = (y_high - y_low) * 0.08 if y_range is None else 0.0
    x_low = min(0.0, min(xs))
    x_high = max(xs) if max(xs) > x_low else x_low + 1
    legend = [(name, COLOURS[i % len(COLOURS)], dash) for i, (name, _, dash) in enumerate(series)]
    legend += [(name, COLOURS[i % len(COLOURS)], "2 3") for i, (name, _) in enumerate(hlines)]
    parts, plot = _open(title, xlabel, ylabel, legend, (x_low, x_high), (y_low - pad, y_high + pad), None, (640, 320))
    for i, (name, y) in enumerate(hlines):
        parts.append(f'<line x1="{_LEFT}" y1="{plot.py(y):.1f}" x2="{plot.width - _RIGHT}" y2="{plot.py(y):.1f}" '
                     f'stroke="{COLOURS[i % len(COLOURS)]}" stroke-width="1.5" stroke-dasharray="2 3">'
                     f'<title>{html.escape(name)}: {y:.3f}</title></line>')
    for i, (name, points, dash) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        parts.append(_polyline([(plot.px(x), plot.py(y)) for x, y in points], colour, dash))
        parts += [f'<circle cx="{plot.px(x):.1f}" cy="{plot.py(y):.1f}" r="3" fill="{colour}"><title>'
                  f'{html.escape(name)} step {x:.0f}: {y:.3f}</title></circle>' for x, y in points]
    return "".join(parts) + "</svg>"


def svg_interval(low: float, high: float, limit: float, colour: str, label: str, limit_text: str) -> str:
    """A small bar: the interval [low, high] in `colour` against a limit (a dashed line), on a scale that holds
    both and 0."""
    width, height, margin = 240, 34, 10
    low, high = min(low, high), max(low, high)
    left, right = min(0.0, low, limit), max(0.0, high, limit)
    pad = (right - left) * 0.1 or 1.0
    left, right = left - pad, right + pad

    def px(v: float) -> float:
        return margin + (v - left) / (right - left) * (width - 2 * margin)

    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
            f'height="{height}" role="img" aria-label="{html.escape(label)}"><title>{html.escape(label)}</title>'
            f'<line x1="{margin}" y1="14" x2="{width - margin}" y2="14" stroke="#ccc"/>'
            f'<rect x="{px(low):.1f}" y="8" width="{max(2.0, px(high) - px(low)):.1f}" height="12" fill="{colour}"/>'
            f'<line x1="{px(limit):.1f}" y1="2" x2="{px(limit):.1f}" y2="26" stroke="#333" stroke-width="1.5" '
            f'stroke-dasharray="3 2"/><text x="{px(limit):.1f}" y="33" font-size="9" text-anchor="middle">'
            f'limit {html.escape(limit_text)}</text></svg>')


def svg_forest(title: str, rows: Sequence[tuple[str, float, float, float]], xlabel: str) -> str:
    """One row per (label, estimate, low, high): a dot at the estimate and a whisker over the interval, against a
    dashed line at 0 (no change)."""
    if not rows:
        return f"<p>{html.escape(title)}: no data</p>"
    width, label_w, row_h, top = 640, 200, 22, 30
    height = top + row_h * len(rows) + 44
    low = min(0.0, *(r[2] for r in rows))
    high = max(0.0, *(r[3] for r in rows))
    pad = (high - low) * 0.08 or 1.0
    low, high = low - pad, high + pad

    def px(v: float) -> float:
        return label_w + (v - low) / (high - low) * (width - label_w - _RIGHT)

    bottom = height - _BOTTOM
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
             f'height="{height}" role="img" aria-label="{html.escape(title)}">',
             f'<text x="{width / 2}" y="16" font-size="13" text-anchor="middle">{html.escape(title)}</text>',
             f'<line x1="{label_w}" y1="{bottom}" x2="{width - _RIGHT}" y2="{bottom}" stroke="#333"/>',
             f'<line x1="{px(0):.1f}" y1="{top}" x2="{px(0):.1f}" y2="{bottom}" stroke="#333" stroke-dasharray="3 2"/>',
             f'<text x="{(label_w + width - _RIGHT) / 2}" y="{height - 6}" font-size="12" text-anchor="middle">'
             f'{html.escape(xlabel)}</text>']
    for value, label in nice_ticks(low, high):
        parts.append(f'<text x="{px(value):.1f}" y="{bottom + 15}" font-size="10" text-anchor="middle">{label}</text>')
    for i, (name, estimate, lo, hi) in enumerate(rows):
        y = top + row_h * i + row_h / 2
        parts.append(f'<text x="{label_w - 8}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{html.escape(name)}'
                     f'</text><line x1="{px(lo):.1f}" y1="{y:.1f}" x2="{px(hi):.1f}" y2="{y:.1f}" stroke="{COLOURS[0]}" '
                     f'stroke-width="2"/><circle cx="{px(estimate):.1f}" cy="{y:.1f}" r="4" fill="{COLOURS[0]}">'
                     f'<title>{html.escape(name)}: {estimate:+.2f} [{lo:+.2f}, {hi:+.2f}]</title></circle>')
    return "".join(parts) + "</svg>"


PAGE_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1em auto;max-width:1100px;padding:0 1em;color:#222}"
    "td,th{padding:3px 8px;text-align:left;vertical-align:top}th{background:#f0f0f0}"
    "table{border-collapse:collapse;margin:0.5em 0}tr:nth-child(even) td{background:#f7f7f7}"
    ".scroll{overflow-x:auto;max-width:100%}.scroll td,.scroll th{white-space:nowrap}"
    "h1,h2,h3,p,li{overflow-wrap:anywhere}svg{max-width:100%;height:auto}td svg{max-width:none}"
    ".plots svg{margin:0 0.5em 1em 0}.plots{overflow-x:auto}@media (max-width:600px){.plots svg{min-width:520px}}"
)
"""The style every report.html shares: readable on a phone (tables scroll sideways in their `.scroll` wrapper,
figures shrink to the page's width, but on a phone no narrower than 520 px, where their words are still read, and
scroll sideways past it) and on a laptop."""


def page(title: str, body: str, style: str = "") -> str:
    """A self-contained HTML page: the shared style (and `style`), sized for the device's width."""
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><meta name='viewport' "
            f"content='width=device-width, initial-scale=1'><title>{html.escape(title)}</title>"
            f"<style>{PAGE_STYLE}{style}</style></head><body>{body}</body></html>")


def table(rows: Sequence[str]) -> str:
    """Table rows in a wrapper that scrolls sideways when the table is wider than the page (cells keep to one
    line: a figure broken over lines is harder to read than one scrolled to)."""
    return f"<div class='scroll'><table>{''.join(rows)}</table></div>"
