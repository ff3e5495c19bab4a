"""The same DeploymentSpec as Kubernetes objects: a Deployment running SGLang with the spec's server arguments and a
Service in front of it, as YAML to a folder (one file per object) or to stdout.

The container runs exactly `server_args(spec)`, only listening on 0.0.0.0 instead of loopback; a local drafter or
target folder is mounted from the node at the same path, so the argv needs no rewriting::

    objects = render(spec, image="lmsysorg/sglang:v0.5.23")
    write(objects, Path("k8s-out"))
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

from deploy.spec import DeploymentSpec, server_args
from dfserve.errors import UserError

POD_HOST = "0.0.0.0"
PART_OF = "dfserve"
COMPONENT = "engine"
SHM_GI = 16
"""SGLang's workers share tensors through /dev/shm; a container's default 64 MiB is far too small."""


def labels(spec: DeploymentSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "sglang",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": COMPONENT,
        "app.kubernetes.io/part-of": PART_OF,
        "dfserve.io/drafter": re.sub(r"[^A-Za-z0-9_.-]", "-", spec.drafter.label)[:63],
    }


def _local_folders(spec: DeploymentSpec) -> list[str]:
    return sorted({path for path in (spec.target, spec.drafter.model_path) if path.startswith("/")})


def render(spec: DeploymentSpec, image: str, namespace: str | None = None) -> list[dict[str, Any]]:
    """A Deployment and a Service for the spec."""
    if spec.engine != "sglang":
        raise UserError("--emit k8s: renders the sglang engine only; drop --engine sim")
    meta: dict[str, Any] = {"name": spec.name, "labels": labels(spec)}
    if namespace:
        meta["namespace"] = namespace
    folders = _local_folders(spec)
    volumes: list[dict[str, Any]] = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{SHM_GI}Gi"}}]
    mounts: list[dict[str, Any]] = [{"name": "shm", "mountPath": "/dev/shm"}]
    for index, folder in enumerate(folders):
        volumes.append({"name": f"model-{index}", "hostPath": {"path": folder, "type": "Directory"}})
        mounts.append({"name": f"model-{index}", "mountPath": folder, "readOnly": True})
    port = {"containerPort": spec.port, "name": "http", "protocol": "TCP"}
    gpus = str(spec.sglang.tp_size)
    container: dict[str, Any] = {
        "name": "sglang",
        "image": image,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": server_args(spec, host=POD_HOST),
        "env": [{"name": key, "value": value} for key, value in sorted(spec.env.items())],
        "ports": [port],
        "resources": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}},
        # Loading 58 GB of weights and capturing CUDA graphs takes minutes: allow up to an hour to start.
        "startupProbe": {"httpGet": {"path": "/health_generate", "port": "http"}, "periodSeconds": 10, "failureThreshold": 360},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 30, "failureThreshold": 6},
        "volumeMounts": mounts,
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # one GPU per replica: the old pod must free it first
            "selector": {"matchLabels": {"app.kubernetes.io/instance": spec.name, "app.kubernetes.io/component": COMPONENT}},
            "template": {
                "metadata": {
                    "labels": labels(spec),
                    "annotations": {
                        "prometheus.io/scrape": str(spec.sglang.enable_metrics).lower(),
                        "prometheus.io/port": str(spec.port),
                        "prometheus.io/path": "/metrics",
                        "dfserve.io/drafter-sha256": spec.drafter.sha256 or "",
                        "dfserve.io/profile": spec.profile,
                    },
                },
                "spec": {"containers": [container], "volumes": volumes},
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "selector": {"app.kubernetes.io/instance": spec.name, "app.kubernetes.io/component": COMPONENT},
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return [deployment, service]


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False)


def write(objects: list[dict[str, Any]], out: Path | None) -> list[Path]:
    """One `<kind>.yaml` per object in `out` (created; existing files are not replaced), or all to stdout."""
    if out is None:
        sys.stdout.write(to_yaml(objects))
        return []
    paths = [out / f"{obj['kind'].lower()}.yaml" for obj in objects]
    if existing := [str(p) for p in paths if p.exists()]:
        raise UserError(f"--out: {', '.join(existing)} already exist; choose an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    for obj, path in zip(objects, paths, strict=True):
        path.write_text(to_yaml([obj]), encoding="utf-8")
    return paths
