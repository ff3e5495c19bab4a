"""The replicated gateway and the sharded load test as a cluster would get them (rendering, strict validation and
the restricted profile are checked for every overlay in test_k8s): one watched routing file, replicas that an HPA
scales and a PodDisruptionBudget protects, and an Indexed Job whose pods each run one shard of one schedule."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from dfserve.gateway.cli import gateway as gateway_command
from dfserve.gateway.config import load_config
from dfserve.loadtest.cli import loadtest
from dfserve.shard import parse_shard
from tests.integration.test_k8s import one, rendered

GATEWAY = "overlays/gateway-replicated"
SHARDED = "overlays/loadtest-sharded"


def test_replicas_watch_one_config_map_that_keeps_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = rendered(GATEWAY)
    deployment = one(docs, "Deployment", "dfserve-gateway")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_map = one(docs, "ConfigMap", "dfserve-gateway")  # no hash suffix: an edit updates the mounted file
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == "dfserve-gateway"
    assert not any("subPath" in mount for mount in container["volumeMounts"]), "a subPath mount never updates"
    path = tmp_path / "gateway.yaml"
    path.write_text(config_map["data"]["gateway.yaml"])
    mounted = f"{volume_mount(container, volume['name'])}/{path.name}"
    argv = [str(path) if arg == mounted else arg for arg in container["command"][2:]]
    context = gateway_command.make_context("gateway", argv)
    assert context.params["config_path"] == path, "the command reads the mounted ConfigMap key"
    assert context.params["watch_interval"] > 0
    config = load_config(path, {"watch_interval_s": context.params["watch_interval"]})
    monkeypatch.setenv(config.admin.token_env, "x" * 32)
    assert config.admin_token()
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"


def volume_mount(container: dict[str, Any], volume: str) -> str:
    (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume]
    return str(mount)


def test_an_hpa_scales_the_replicas_and_a_pdb_keeps_most_of_them(tmp_path: Path) -> None:
    docs = rendered(GATEWAY)
    deployment = one(docs, "Deployment", "dfserve-gateway")
    assert "replicas" not in deployment["spec"], "the HPA owns the count"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    hpa = one(docs, "HorizontalPodAutoscaler", "dfserve-gateway")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "dfserve-gateway")
    assert hpa["spec"]["minReplicas"] >= 2
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"], "CPU utilization is measured against the request"
    pdb = one(docs, "PodDisruptionBudget", "dfserve-gateway")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]
    service = one(docs, "Service", "dfserve-gateway")
    assert service["spec"]["selector"].items() <= labels.items()


def kubelet_args(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The container's args with `$(VAR)` expanded as the kubelet does, `env` standing for fieldRef values."""
    values = {e["name"]: e["value"] for e in container["env"] if "value" in e} | env
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg) for arg in container["args"]]


def test_the_indexed_job_runs_every_shard_of_one_schedule_on_a_shared_volume() -> None:
    docs = rendered(SHARDED)
    job = one(docs, "Job", "dfserve-loadtest-sharded")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert fields["SHARD_INDEX"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    run = loadtest.commands["run"]
    seen = set()
    for index in range(spec["completions"]):
        params = run.make_context("run", kubelet_args(container, {"SHARD_INDEX": str(index), "JOB_UID": "u1"})).params
        shard = parse_shard(params["shard"])
        assert shard.count == spec["completions"]
        seen.add(shard.index)
        assert params["out"] == Path("/runs/job-u1") and params["name"] == f"shard-{index}"
    assert seen == set(range(spec["completions"]))
    (runs,) = [v for v in pod["volumes"] if v["name"] == "runs"]
    claim = one(rendered(f"{SHARDED}-volume"), "PersistentVolumeClaim", runs["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert one(docs, "Job", "dfserve-loadtest-sharded")["spec"]["backoffLimit"] == 0
