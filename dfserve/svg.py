"""Inline SVG plots for self-contained HTML reports: CDFs, lines over an index, and side-by-side histograms.

Both the load test's and the offline evaluation's report.html draw with these, so a figure looks the same in both.
"""

from __future__ import annotations

import html

import numpy as np

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
_W, _H, _PAD = 520, 260, 44


def svg_cdf(title: str, series: dict[str, list[float]], unit_scale: float = 1000.0, unit: str = "ms") -> str:
    """Empirical CDFs, one line per arm, x in `unit` (up to each arm's p99.5 so a tail does not flatten the rest)."""
    present = {name: np.sort(np.asarray(v, dtype=float)) * unit_scale for name, v in series.items() if v}
    if not present:
        return f"<p>{html.escape(title)}: no samples</p>"
    top = max(float(np.quantile(v, 0.995)) for v in present.values()) or 1.0
    parts = [_frame(title, f"{unit}", top)]
    for values, colour in zip(present.values(), _COLOURS, strict=False):
        step = max(1, len(values) // 400)
        points = [
            (_PAD + min(x, top) / top * (_W - 2 * _PAD), _H - _PAD - (i + 1) / len(values) * (_H - 2 * _PAD))
            for i, x in list(enumerate(values))[::step]
        ]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>')
    parts.append(_legend(list(present)))
    return "".join(parts) + "</svg>"


def svg_lines(title: str, series: dict[str, list[float | None]], xlabel: str) -> str:
    """One line per series over x = 0, 1, 2, ... (the list index) on a 0..1 scale (shares); None is no point."""
    present = {name: values for name, values in series.items() if any(v is not None for v in values)}
    if not present:
        return f"<p>{html.escape(title)}: no data</p>"
    width = max(len(v) for v in present.values())
    parts = [_frame(title, xlabel, float(width - 1), integer=True)]
    for values, colour in zip(present.values(), _COLOURS, strict=False):
        points = [(_PAD + i / max(1, width - 1) * (_W - 2 * _PAD), _H - _PAD - v * (_H - 2 * _PAD))
                  for i, v in enumerate(values) if v is not None]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>')
    parts.append(_legend(list(present)))
    return "".join(parts) + "</svg>"


def svg_histogram(title: str, series: dict[str, list[int]]) -> str:
    """Share of verify rounds that emitted k tokens, bars side by side per arm."""
    present = {name: counts for name, counts in series.items() if sum(counts)}
    if not present:
        return f"<p>{html.escape(title)}: no verify rounds recorded</p>"
    width = max(len(c) for c in present.values())
    shares = {name: [c / sum(counts) for c in counts] + [0.0] * (width - len(counts)) for name, counts in present.items()}
    top = max(max(s) for s in shares.values()) or 1.0
    parts = [_frame(title, "tokens per round", float(width - 1), integer=True, y_top=f"{top:.2f}")]
    slot = (_W - 2 * _PAD) / width
    bar = slot / (len(shares) + 1)
    for a, ((name, share), colour) in enumerate(zip(shares.items(), _COLOURS, strict=False)):
        for k, value in enumerate(share):
            height = value / top * (_H - 2 * _PAD)
            x = _PAD + k * slot + a * bar
            parts.append(f'<rect x="{x:.1f}" y="{_H - _PAD - height:.1f}" width="{bar:.1f}" height="{height:.1f}" '
                         f'fill="{colour}"><title>{html.escape(name)} k={k}: {value:.3f}</title></rect>')
    parts.append(_legend(list(shares)))
    return "".join(parts) + "</svg>"


def _frame(title: str, xlabel: str, top: float, integer: bool = False, y_top: str = "1") -> str:
    """Axes, title and x ticks; the y axis runs from 0 to `y_top` (a share)."""
    ticks = [f'<text x="{_PAD - 4}" y="{_H - _PAD + 4}" font-size="10" text-anchor="end">0</text>',
             f'<text x="{_PAD - 4}" y="{_PAD + 4}" font-size="10" text-anchor="end">{y_top}</text>']
    for i in range(5):
        value = top * i / 4
        x = _PAD + i / 4 * (_W - 2 * _PAD)
        label = f"{value:.0f}" if integer or top >= 20 else f"{value:.2g}"
        ticks.append(f'<text x="{x:.1f}" y="{_H - _PAD + 16}" font-size="10" text-anchor="middle">{label}</text>')
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" role="img">'
        f'<text x="{_W / 2}" y="16" font-size="13" text-anchor="middle">{html.escape(title)}</text>'
        f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="#333"/>'
        f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{_H - _PAD}" stroke="#333"/>'
        f'<text x="{_W / 2}" y="{_H - 8}" font-size="11" text-anchor="middle">{html.escape(xlabel)}</text>'
        + "".join(ticks)
    )


def _legend(names: list[str]) -> str:
    """One row of coloured names between the title and the plot, where no line or bar can run under it."""
    parts, x = [], float(_PAD)
    for name, colour in zip(names, _COLOURS, strict=False):
        parts.append(f'<rect x="{x:.1f}" y="26" width="10" height="3" fill="{colour}"/>'
                     f'<text x="{x + 14:.1f}" y="31" font-size="11" fill="{colour}">{html.escape(name)}</text>')
        x += 14 + 6.5 * len(name) + 16
    return "".join(parts)
