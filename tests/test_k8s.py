"""The Kubernetes manifests as a cluster would get them: every kustomization renders with `kubectl kustomize`,
passes strict schema validation, runs unprivileged with resources set, and agrees with the code it deploys
(the deployment spec's SGLang arguments, the gateway's config parser, the load tester's flags, the rules and
dashboards generator)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as operator

from dashboards.render import Settings, render
from deploy.drafters import Drafter, resolve_drafter, resolve_target
from deploy.k8s import render as emit_k8s
from deploy.profiles import load_profile
from deploy.spec import build_spec
from dfserve import metrics as m
from gateway.config import load_config
from loadtest.cli import loadtest

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
KUSTOMIZATIONS = sorted(str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml"))
OVERLAYS = sorted(f"overlays/{p.name}" for p in (K8S / "overlays").iterdir() if p.is_dir())
ENGINES = {"zlab": "z-lab/Qwen3.6-27B-DFlash", "inhouse": "/models/drafters/inhouse"}
OPERATOR_GROUP = "monitoring.coreos.com/"


def kubectl() -> str:
    path = shutil.which("kubectl")
    assert path, "kubectl not found (it ships with the project's machine image)"
    return path


@cache
def rendered_text(where: str) -> str:
    result = subprocess.run([kubectl(), "kustomize", str(K8S / where)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def rendered(where: str) -> list[dict[str, Any]]:
    return copy.deepcopy([doc for doc in yaml.safe_load_all(rendered_text(where)) if doc])


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            yield f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]["spec"]


def expanded_args(container: dict[str, Any]) -> list[str]:
    """Container args with `$(VAR)` replaced from its env, as the kubelet does."""
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container.get("args", [])]


def test_every_overlay_is_found() -> None:
    assert {Path(o).name for o in OVERLAYS} == {"zlab", "inhouse", "gateway", "loadtest", "monitoring", "fleet"}


@pytest.mark.parametrize("where", KUSTOMIZATIONS)
def test_renders_and_validates_strictly(where: str, tmp_path: Path) -> None:
    docs = rendered(where)
    assert docs
    builtin = [d for d in docs if not d["apiVersion"].startswith(OPERATOR_GROUP)]
    out = tmp_path / "rendered.yaml"
    out.write_text(yaml.safe_dump_all(builtin))
    result = subprocess.run([str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "--quiet", str(out)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for doc in docs:
        if doc["apiVersion"].startswith(OPERATOR_GROUP):
            model = getattr(operator, doc["kind"]).model_validate(doc)
            assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc, (
                f"{doc['kind']}/{doc['metadata']['name']} has fields the operator's schema does not know")


@pytest.mark.parametrize("where", [o for o in OVERLAYS if not o.endswith("monitoring")])
def test_pods_run_unprivileged_with_resources(where: str) -> None:
    pods = list(pod_specs(rendered(where)))
    assert pods
    for name, pod in pods:
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0, name
        assert security["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], name
            resources = container["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[kind]), f"{name}: {kind}"


@pytest.mark.parametrize("drafter", sorted(ENGINES))
def test_engine_agrees_with_deploy_emit_k8s(drafter: str, tmp_path: Path) -> None:
    """Where the overlays and `dfserve deploy --emit k8s` overlap (argv, env, labels, ports, GPUs), they agree."""
    docs = rendered(f"overlays/{drafter}")
    deployment = one(docs, "Deployment", f"sglang-{drafter}")
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    profile = load_profile("pro6000")
    target = resolve_target(None, profile, None)
    # The in-house folder exists only on the model cache volume; its resolved form is what deploy would make of it.
    source = resolve_drafter("zlab", profile, target, tmp_path) if drafter == "zlab" else Drafter(
        label=drafter, kind="folder", model_path=ENGINES[drafter], block_size=16, sha256=None, source=None,
        sim_profile="inhouse")
    spec = build_spec(profile, target, source, engine="sglang", port=30000, name=drafter)
    emitted_deployment, emitted_service = emit_k8s(spec, image=container["image"])
    emitted_template = emitted_deployment["spec"]["template"]
    (emitted,) = emitted_template["spec"]["containers"]
    assert container["command"] == emitted["command"]
    assert expanded_args(container) == emitted["args"]
    assert {(e["name"], e["value"]) for e in emitted["env"]} <= {(e["name"], e.get("value")) for e in container["env"]}
    assert container["ports"] == [{k: v for k, v in emitted["ports"][0].items() if k != "protocol"}]
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["nvidia.com/gpu"] == emitted["resources"][kind]["nvidia.com/gpu"]
    assert emitted_template["metadata"]["labels"].items() <= template["metadata"]["labels"].items()
    assert deployment["spec"]["strategy"] == emitted_deployment["spec"]["strategy"]
    service = one(docs, "Service", f"sglang-{drafter}")
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        (p["port"], p["targetPort"]) for p in emitted_service["spec"]["ports"]]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert container["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert template["spec"]["nodeSelector"] and template["spec"]["tolerations"]


def test_gateway_config_parses_and_points_at_the_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = rendered("overlays/fleet")
    gateway = one(docs, "Deployment", "dfserve-gateway")
    pod = gateway["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_map = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("dfserve-gateway"))
    assert pod["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]
    path = tmp_path / "gateway.yaml"
    path.write_text(config_map["data"]["gateway.yaml"])
    assert container["command"][-1] == f"/etc/dfserve/{path.name}"
    config = load_config(path, {})
    token = next(e for e in container["env"] if e["name"] == config.admin.token_env)
    one(docs, "Secret", token["valueFrom"]["secretKeyRef"]["name"])
    monkeypatch.setenv(config.admin.token_env, "x" * 32)
    assert config.admin_token() == "x" * 32
    services = {(d["metadata"]["name"], p["port"]) for d in docs if d["kind"] == "Service" for p in d["spec"]["ports"]}
    for arm in config.routing.arms.values():
        for replica in arm.replicas:
            host, port = re.fullmatch(r"http://([\w-]+):(\d+)", replica).groups()  # type: ignore[union-attr]
            assert (host, int(port)) in services, replica
    assert {p["containerPort"] for p in container["ports"]} == {config.port, config.admin.port}


def test_loadtest_job_flags_are_the_load_testers() -> None:
    docs = rendered("overlays/loadtest")
    job = one(docs, "Job", "dfserve-loadtest")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["dfserve", "loadtest", "run"]
    run = loadtest.commands["run"]
    context = run.make_context("run", expanded_args(container))
    assert context.params["pushgateway"].startswith("http://") and context.params["out"] == Path("/runs")
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    one(docs, "PersistentVolumeClaim", volumes["runs"]["persistentVolumeClaim"]["claimName"])


def test_monitoring_selects_the_engines_and_gateway_and_ships_the_generated_files() -> None:
    fleet = rendered("overlays/fleet")
    monitoring = rendered("overlays/monitoring")
    pod_monitor = one(monitoring, "PodMonitor", "dfserve-engines")
    for drafter in ENGINES:
        template = one(fleet, "Deployment", f"sglang-{drafter}")["spec"]["template"]
        assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
        relabel = pod_monitor["spec"]["podMetricsEndpoints"][0]["relabelings"][0]
        label = relabel["sourceLabels"][0].removeprefix("__meta_kubernetes_pod_label_")
        pod_label = next(k for k in template["metadata"]["labels"] if re.sub(r"[^A-Za-z0-9]", "_", k) == label)
        assert template["metadata"]["labels"][pod_label] == drafter and relabel["targetLabel"] == m.DEPLOYMENT_LABEL
    service_monitor = one(monitoring, "ServiceMonitor", "dfserve-gateway")
    service = one(fleet, "Service", "dfserve-gateway")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    files = render(Settings())
    dashboards = one(monitoring, "ConfigMap", "dfserve-grafana-dashboards")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert {f"grafana/{name}": text for name, text in dashboards["data"].items()} == {
        k: v for k, v in files.items() if k.startswith("grafana/")}
    rule = one(monitoring, "PrometheusRule", "dfserve")
    assert rule["spec"] == yaml.safe_load(files["prometheus/dfserve-rules.yml"])
