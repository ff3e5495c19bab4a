"""Every file the dashboards and rules become, as text keyed by path: Grafana JSON, a Prometheus rule file, and the
Kubernetes objects that carry both (a ConfigMap for Grafana's dashboard sidecar, a PrometheusRule for the operator).

Rendering is pure so a test can compare it with the committed copy; `write()` is the only I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import ab, engine, training
from .engine import NameStyle
from .grafana import Dashboard
from .rules import RuleSettings, rule_groups

NAMESPACE_LABELS = {"app.kubernetes.io/part-of": "dfserve", "app.kubernetes.io/component": "monitoring"}
GRAFANA_SIDECAR_LABEL = "grafana_dashboard"
"""Label Grafana's dashboard sidecar (kube-prometheus-stack's default) watches for."""


@dataclass(frozen=True)
class Settings:
    rules: RuleSettings = field(default_factory=RuleSettings)
    sglang_names: NameStyle = "colon"


def dashboards(settings: Settings) -> tuple[Dashboard, ...]:
    return (ab.build(settings.rules.baseline_arm, settings.rules.candidate_arm, settings.sglang_names),
            engine.build(settings.sglang_names), training.build())


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (PromQL, dashboard JSON) as YAML block literals, so the files read like hand-written ones."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


def to_yaml(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_BlockDumper, sort_keys=False, width=120, allow_unicode=True)


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def render(settings: Settings) -> dict[str, str]:
    """Relative path -> file text, for everything under a `dfserve dashboards --out` folder."""
    boards = {f"{board.uid}.json": _json(board.to_json()) for board in dashboards(settings)}
    groups = rule_groups(settings.rules, settings.sglang_names)
    config_map = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "dfserve-grafana-dashboards", "labels": {**NAMESPACE_LABELS, GRAFANA_SIDECAR_LABEL: "1"},
                     "annotations": {"grafana_folder": "dfserve"}},
        "data": boards,
    }
    prometheus_rule = {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
        "metadata": {"name": "dfserve", "labels": NAMESPACE_LABELS},
        "spec": {"groups": groups},
    }
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["grafana-dashboards.yaml", "prometheus-rules.yaml"],
    }
    return {
        **{f"grafana/{name}": text for name, text in boards.items()},
        "prometheus/dfserve-rules.yml": to_yaml({"groups": groups}),
        "k8s/grafana-dashboards.yaml": to_yaml(config_map),
        "k8s/prometheus-rules.yaml": to_yaml(prometheus_rule),
        "k8s/kustomization.yaml": to_yaml(kustomization),
    }


def write(out: Path, files: dict[str, str]) -> list[Path]:
    """Write `files` under `out`, replacing earlier generated copies; returns the paths written."""
    written = []
    for relative, text in files.items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
