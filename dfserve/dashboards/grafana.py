"""A small typed model of the Grafana dashboard JSON dfserve ships, and the template-variable expansion Grafana does.

Only what the dashboards use is modelled: Prometheus targets, timeseries/stat/heatmap panels in titled rows laid
out left to right, and datasource/query variables. `Dashboard.to_json()` is what Grafana imports;
`Dashboard.queries()` and `expand()` let a test run every query against a real Prometheus.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

SCHEMA_VERSION = 39
"""Dashboard schema of Grafana 10.4/11, which imports it unchanged and migrates it forward on later releases."""
GRID_WIDTH = 24
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE_INTERVAL = "$__rate_interval"

PanelKind = Literal["timeseries", "stat", "heatmap"]


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel; `legend` uses Grafana's `{{label}}` syntax."""

    expr: str
    legend: str = ""
    heatmap: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: PanelKind = "timeseries"
    width: int = 8
    height: int = 8
    no_value: str | None = None
    """Shown instead of "No data" when the query is empty because the event counted has not happened yet."""
    repeat: str | None = None
    """Name of a multi-value variable: one copy of the panel per selected value, side by side."""

    def __post_init__(self) -> None:
        if not 0 < self.width <= GRID_WIDTH:
            raise ValueError(f"panel {self.title!r}: width {self.width} outside 1..{GRID_WIDTH}")
        if not self.targets:
            raise ValueError(f"panel {self.title!r} has no query")


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    """A dashboard variable: the datasource picker, or the values of one label (`label_values(series, label)`), or,
    `newest_first`, the `label_name` of each series of `series` (an instant vector of times, one series per value)
    in descending order of its value, the first selected: the latest pushed run, whatever its name."""

    name: str
    label: str
    series: str = ""
    label_name: str = ""
    multi: bool = True
    default: str | None = None
    newest_first: bool = False

    @property
    def is_datasource(self) -> bool:
        return not self.series

    @property
    def definition(self) -> str:
        if self.newest_first:
            return f"query_result(sort_desc({self.series}))"
        return f"label_values({self.series}, {self.label_name})"

    def to_json(self) -> dict[str, Any]:
        if self.is_datasource:
            return {"type": "datasource", "name": self.name, "label": self.label, "query": "prometheus",
                    "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
                    "regex": ""}
        current: dict[str, Any] = (
            {"selected": True, "text": self.default, "value": self.default} if self.default
            else {"selected": True, "text": ["All"], "value": ["$__all"]} if self.multi else {}
        )
        # a query result in the plain string form, which Grafana parses into its editor's (`query_result(...)`)
        query: str | dict[str, Any] = self.definition if self.newest_first else {
            "qryType": 1, "query": self.definition, "refId": "PrometheusVariableQueryEditor-VariableQuery"}
        return {
            "type": "query", "name": self.name, "label": self.label, "datasource": DATASOURCE,
            "definition": self.definition, "query": query,
            "current": current, "hide": 0, "includeAll": self.multi, "multi": self.multi,
            **({"allValue": ".*"} if self.multi else {}),
            "options": [], "refresh": 2, "regex": f'/{self.label_name}="([^"]+)"/' if self.newest_first else "",
            "sort": 0 if self.newest_first else 1,
        }


@dataclass(frozen=True)
class Query:
    """One query of a dashboard, with where it sits, for checks against a real Prometheus."""

    panel: str
    ref_id: str
    expr: str
    repeat: str | None


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = ("dfserve",)
    refresh: str = "30s"
    time_from: str = "now-1h"

    def queries(self) -> Iterator[Query]:
        for row in self.rows:
            for panel in row.panels:
                for ref_id, target in zip(_ref_ids(), panel.targets, strict=False):
                    yield Query(panel.title, ref_id, target.expr, panel.repeat)

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "editable": True,
            "graphTooltip": 1,
            "schemaVersion": SCHEMA_VERSION,
            "version": 1,
            "refresh": self.refresh,
            "time": {"from": self.time_from, "to": "now"},
            "timepicker": {},
            "timezone": "browser",
            "annotations": {"list": []},
            "links": [],
            "templating": {"list": [variable.to_json() for variable in self.variables]},
            "panels": list(_layout(self.rows)),
        }


def _ref_ids() -> Iterator[str]:
    return (chr(ord("A") + i) for i in range(26))


def _layout(rows: Sequence[Row]) -> Iterator[dict[str, Any]]:
    """Rows stacked top to bottom; inside a row, panels fill 24 columns left to right and wrap."""
    panel_id = 0
    y = 0
    for row in rows:
        panel_id += 1
        yield {"type": "row", "id": panel_id, "title": row.title, "collapsed": False, "panels": [],
               "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}}
        y += 1
        x = 0
        line_height = 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            panel_id += 1
            yield _panel_json(panel, panel_id, {"h": panel.height, "w": panel.width, "x": x, "y": y})
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height


def _panel_json(panel: Panel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.no_value is not None:
        defaults["noValue"] = panel.no_value
    body: dict[str, Any] = {
        "type": panel.kind,
        "id": panel_id,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": grid,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": _options(panel.kind),
        "targets": [
            {"refId": ref_id, "datasource": DATASOURCE, "expr": target.expr, "legendFormat": target.legend,
             "range": True, "format": "heatmap" if target.heatmap else "time_series"}
            for ref_id, target in zip(_ref_ids(), panel.targets, strict=False)
        ],
    }
    if panel.repeat:
        body.update(repeat=panel.repeat, repeatDirection="h", maxPerRow=4)
    return body


def _options(kind: PanelKind) -> dict[str, Any]:
    if kind == "heatmap":
        return {"calculate": False, "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges"},
                "yAxis": {"axisPlacement": "left"}, "legend": {"show": True}, "tooltip": {"mode": "single"}}
    if kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    return {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "mean"]},
            "tooltip": {"mode": "multi", "sort": "desc"}}


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def expand(expr: str, values: Mapping[str, str]) -> str:
    """Substitute `$name` / `${name}` the way Grafana does before a query reaches Prometheus.

    Multi-value variables must be given as the regex Grafana would send (`a|b`, or `.*` for All).
    An unknown variable raises KeyError, so a query naming a variable the dashboard lacks cannot pass a check.
    """
    return _VARIABLE.sub(lambda match: values[match.group(1) or match.group(2)], expr)
