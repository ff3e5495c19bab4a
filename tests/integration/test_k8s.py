"""The Kubernetes manifests as a cluster would get them: every kustomization renders with `kubectl kustomize`,
passes strict schema validation and the `restricted` Pod Security Standard with resources set, and agrees with the
code it deploys (the engines are `deploy.k8s`'s objects verbatim; the gateway's config parser, the load tester's
flags, the rules and dashboards generator)."""

from __future__ import annotations

import copy
import os
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

from dfserve import metrics as m
from dfserve.dashboards.render import Settings, render
from dfserve.deploy.k8s import FLEET_HEADER, PRO6000_NODES, fleet, to_yaml
from dfserve.eval.cli import cache_merge_command, run_command, watch_command
from dfserve.gateway.config import load_config
from dfserve.loadtest.cli import loadtest
from tests import ROOT
from tests.integration.servers import dfserve_argv

K8S = ROOT / "k8s"
KUSTOMIZATIONS = sorted(str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml"))
OVERLAYS = sorted(f"overlays/{p.name}" for p in (K8S / "overlays").iterdir() if p.is_dir())
VOLUME_OVERLAYS = [o for o in OVERLAYS if o.endswith("-volume")]
TRAINER_CLAIM = "trainer-checkpoints"
"""The trainer's own claim, which the watch mounts read-only: the training run's, never rendered here."""
ENGINES = ("zlab", "inhouse")
OPERATOR_GROUP = "monitoring.coreos.com/"
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                      "secret"}
SGLANG_HEALTH_CHECK_TIMEOUT_S = 20
"""How long SGLang's /health and /health_generate wait for output before answering 503 (http_server.py)."""


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


def keyed(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Objects by kind and name (kustomize reorders them)."""
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            yield f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]["spec"]


def expanded_args(container: dict[str, Any]) -> list[str]:
    """Container args with `$(VAR)` replaced from its env, as the kubelet does (a reference it cannot resolve, such
    as one to a downward-API variable here, is left as written)."""
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg) for arg in container.get("args", [])]


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What the `restricted` Pod Security Standard (baseline included) would reject in a pod spec."""
    found = [f"host namespace {key}" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    found += [f"volume {v['name']}: not a restricted type" for v in pod.get("volumes", [])
              if set(v) - {"name"} - RESTRICTED_VOLUMES]
    security = pod.get("securityContext", {})
    for container in pod.get("initContainers", []) + pod["containers"]:
        name, own = container["name"], container.get("securityContext", {})
        merged = {**security, **own}
        if merged.get("runAsNonRoot") is not True or merged.get("runAsUser") == 0:
            found.append(f"{name}: may run as root")
        if merged.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile neither RuntimeDefault nor Localhost")
        if own.get("privileged") or own.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: privilege escalation allowed")
        capabilities = own.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities not dropped")
        found += [f"{name}: hostPort" for port in container.get("ports", []) if port.get("hostPort")]
    return found


def test_every_overlay_is_found() -> None:
    assert {Path(o).name for o in OVERLAYS} == {"zlab", "inhouse", "gateway", "loadtest", "monitoring", "fleet",
                                                  "gateway-replicated", "loadtest-sharded", "eval-watch",
                                                  "eval-features-sharded", "eval-features-merge", "eval-volume",
                                                  "loadtest-volume", "loadtest-sharded-volume"}


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


@pytest.mark.parametrize("where", [o for o in OVERLAYS if o != "overlays/monitoring" and o not in VOLUME_OVERLAYS])
def test_pods_pass_restricted_pod_security_with_resources(where: str) -> None:
    pods = list(pod_specs(rendered(where)))
    assert pods
    for name, pod in pods:
        assert restricted_violations(pod) == [], name
        for container in pod["containers"]:
            resources = container["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[kind]), f"{name}: {kind}"


def test_restricted_check_catches_what_the_old_engine_objects_had() -> None:
    """The check above fails on a hostPath volume, a root container and kept capabilities."""
    (_, pod), = pod_specs(fleet()["zlab"])
    pod["volumes"].append({"name": "model-0", "hostPath": {"path": "/models", "type": "Directory"}})
    pod["securityContext"]["runAsUser"] = 0
    del pod["containers"][0]["securityContext"]["capabilities"]
    assert restricted_violations(pod) == [
        "volume model-0: not a restricted type", "sglang: may run as root", "sglang: capabilities not dropped"]


@pytest.mark.parametrize("drafter", ENGINES)
def test_engine_overlay_is_exactly_what_deploy_renders(drafter: str) -> None:
    """The whole engine (argv, env, probes, securityContext, resources, volumes, placement, Service) comes from
    deploy.k8s: the committed files are `dfserve deploy manifests` output and kustomize changes nothing in them."""
    expected = fleet()[drafter]
    for obj in expected:
        path = K8S / "overlays" / drafter / f"{obj['kind'].lower()}.yaml"
        assert path.read_text() == FLEET_HEADER + to_yaml([obj]), f"{path} is stale: run `dfserve deploy manifests`"
    assert keyed(rendered(f"overlays/{drafter}")) == keyed(expected)
    whole = rendered("overlays/fleet")
    for obj in expected:
        assert one(whole, obj["kind"], obj["metadata"]["name"]) == obj


@pytest.mark.parametrize("drafter", ENGINES)
def test_engine_probes_gpu_and_placement(drafter: str) -> None:
    deployment, _ = fleet()[drafter]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    probes = {kind: container[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness")}
    assert {kind: probe["httpGet"]["path"] for kind, probe in probes.items()} == {
        "startup": "/health", "readiness": "/health_generate", "liveness": "/health"}
    assert all(probe["timeoutSeconds"] > SGLANG_HEALTH_CHECK_TIMEOUT_S for probe in probes.values())
    startup = probes["startup"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800, "weights load and CUDA graphs capture"
    assert "--enable-metrics" in container["args"]
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == PRO6000_NODES and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    one(rendered("base"), "PersistentVolumeClaim", claims.pop())
    draft = container["args"][container["args"].index("--speculative-draft-model-path") + 1]
    assert draft == {"zlab": "z-lab/Qwen3.6-27B-DFlash", "inhouse": "/models/drafters/inhouse"}[drafter]


def test_zlab_overlay_is_what_deploy_emit_k8s_writes(tmp_path: Path) -> None:
    """The command the zlab overlay's kustomization names writes the very objects the overlay holds."""
    ((key, value),) = PRO6000_NODES.items()
    node = f"{key}={value}"
    done = subprocess.run(
        dfserve_argv("deploy", "--drafter", "zlab", "--emit", "k8s", "--namespace", "dfserve", "--node-selector", node),
        capture_output=True, text=True, env={**os.environ, "DFSERVE_DEPLOY_ROOT": str(tmp_path)}, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert keyed(list(yaml.safe_load_all(done.stdout))) == keyed(rendered("overlays/zlab"))
    assert node in (K8S / "overlays" / "zlab" / "kustomization.yaml").read_text()


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
    # Ready only while an arm can serve; alive whenever its loop answers (a restart cannot heal the engines).
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"


def test_loadtest_job_flags_are_the_load_testers() -> None:
    docs = rendered("overlays/loadtest")
    job = one(docs, "Job", "dfserve-loadtest")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["dfserve", "loadtest", "run"]
    run = loadtest.commands["run"]
    context = run.make_context("run", expanded_args(container))
    assert context.params["pushgateway"].startswith("http://") and context.params["out"] == Path("/runs")
    for overlay, suffix in (("overlays/loadtest", ""), ("overlays/loadtest-sharded", "-sharded")):
        # where compare and merge run once the Job is done: its volume, mounted where the Job writes its runs,
        # and no pod until it is scaled up (a ReadWriteOnce volume held on another node would stall the Job)
        docs = rendered(overlay)
        shell = one(docs, "Deployment", f"dfserve-runs{suffix}")
        job = one(docs, "Job", f"dfserve-loadtest{suffix}")
        claims = [{v["name"]: v["persistentVolumeClaim"]["claimName"]
                   for v in pod["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
                  for pod in (shell, job)]
        assert claims[0] == claims[1] == {"runs": f"loadtest-runs{suffix}"} and shell["spec"]["replicas"] == 0
        claim = one(rendered(f"{overlay}-volume"), "PersistentVolumeClaim", f"loadtest-runs{suffix}")
        assert claim["spec"]["accessModes"] == ["ReadWriteMany" if suffix else "ReadWriteOnce"]
        (mount,) = [m for m in shell["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] if m["name"] == "runs"]
        assert mount["mountPath"] == "/runs"


def test_no_deployment_of_any_overlay_selects_another_ones_pods() -> None:
    """Applied together (the fleet, a load test and its sharded twin, the watch), a Deployment whose selector takes
    another's pods would count them as its own, and `kubectl exec deploy/NAME` could run in a pod of the other."""
    templates: dict[str, dict[str, str]] = {}
    selectors: dict[str, dict[str, str]] = {}
    for where in ["base", *OVERLAYS]:
        for doc in rendered(where):
            if doc["kind"] == "Deployment":
                name = doc["metadata"]["name"]
                templates[name] = doc["spec"]["template"]["metadata"]["labels"]
                selectors[name] = doc["spec"]["selector"]["matchLabels"]
    assert {"dfserve-runs", "dfserve-runs-sharded", "dfserve-models", "pro6000-zlab"} <= set(templates)
    for name, selector in selectors.items():
        assert [other for other, labels in templates.items() if selector.items() <= labels.items()] == [name], name


def test_base_has_a_pod_for_staging_drafters_on_the_engines_model_cache() -> None:
    """Staging comes before the fleet (its in-house engine reads the drafter): base alone holds the volume and a pod
    that writes it where the engines read it, run only when scaled up."""
    base = rendered("base")
    shell = one(base, "Deployment", "dfserve-models")
    pod = shell["spec"]["template"]["spec"]
    assert shell["spec"]["replicas"] == 0
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "models"]
    claim = volume["persistentVolumeClaim"]["claimName"]
    one(base, "PersistentVolumeClaim", claim)
    assert mount["mountPath"] == "/models" and not mount.get("readOnly")
    engine = one(rendered("overlays/fleet"), "Deployment", "pro6000-inhouse")["spec"]["template"]["spec"]
    (engine_volume,) = [v for v in engine["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == claim]
    (engine_mount,) = [m for c in engine["containers"] for m in c["volumeMounts"] if m["name"] == engine_volume["name"]]
    assert engine_mount["mountPath"] == mount["mountPath"]


def test_monitoring_selects_the_engines_and_gateway_and_ships_the_generated_files() -> None:
    whole = rendered("overlays/fleet")
    monitoring = rendered("overlays/monitoring")
    pod_monitor = one(monitoring, "PodMonitor", "dfserve-engines")
    for drafter in ENGINES:
        instance = f"pro6000-{drafter}"
        template = one(whole, "Deployment", instance)["spec"]["template"]
        assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
        relabel = pod_monitor["spec"]["podMetricsEndpoints"][0]["relabelings"][0]
        label = relabel["sourceLabels"][0].removeprefix("__meta_kubernetes_pod_label_")
        pod_label = next(k for k in template["metadata"]["labels"] if re.sub(r"[^A-Za-z0-9]", "_", k) == label)
        assert template["metadata"]["labels"][pod_label] == instance and relabel["targetLabel"] == m.DEPLOYMENT_LABEL
    service_monitor = one(monitoring, "ServiceMonitor", "dfserve-gateway")
    service = one(whole, "Service", "dfserve-gateway")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    files = render(Settings())
    dashboards = one(monitoring, "ConfigMap", "dfserve-grafana-dashboards")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert {f"grafana/{name}": text for name, text in dashboards["data"].items()} == {
        k: v for k, v in files.items() if k.startswith("grafana/")}
    rule = one(monitoring, "PrometheusRule", "dfserve")
    assert rule["spec"] == yaml.safe_load(files["prometheus/dfserve-rules.yml"])


def test_eval_watch_reads_the_trainers_volume_only_and_runs_alone() -> None:
    docs = rendered("overlays/eval-watch")
    deployment = one(docs, "Deployment", "dfserve-eval-watch")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["dfserve", "eval", "watch", "/checkpoints"]
    # CHECKPOINTS exists only in the pod: parsed leniently, every flag must still be the command's own
    context = watch_command.make_context("watch", expanded_args(container), resilient_parsing=True)
    params = context.params
    assert params["stage"] == "copy" and params["pushgateway"].startswith("http://") and params["threads"] == 8
    assert params["niceness"] == 10 and params["baseline"] == "zlab" and params["dtype"] == "bfloat16"
    mounts = {v["name"]: v for v in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["checkpoints"]["mountPath"] == "/checkpoints" and mounts["checkpoints"]["readOnly"] is True
    assert volumes["checkpoints"]["persistentVolumeClaim"]["readOnly"] is True
    written = [params["out"], params["cache"], params["store"], params["registry"]]
    assert all(str(path).startswith(mounts["watch"]["mountPath"] + "/") for path in written), written
    one(rendered("overlays/eval-volume"), "PersistentVolumeClaim", volumes["watch"]["persistentVolumeClaim"]["claimName"])
    assert mounts["models"]["readOnly"] is True
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == TRAINER_CLAIM


def test_deleting_a_workloads_overlay_keeps_its_volumes() -> None:
    """A Job cannot be changed, so it runs again through `kubectl delete -k` and `apply -k` of its overlay, and a
    Deployment is taken down the same way: an overlay holding a workload and a claim would delete the volume (the
    recorded runs, the feature cache) with it. Claims live in the volume overlays, applied once, and in base (the
    namespace's own: deleting it deletes everything), and those hold every claim a workload mounts."""
    claims: dict[str, str] = {}
    for where in VOLUME_OVERLAYS:
        docs = rendered(where)
        assert docs and {d["kind"] for d in docs} == {"PersistentVolumeClaim"}, where
        claims |= {d["metadata"]["name"]: where for d in docs}
    claims |= {d["metadata"]["name"]: "base" for d in rendered("base") if d["kind"] == "PersistentVolumeClaim"}
    mounted: dict[str, str] = {}
    for where in OVERLAYS:
        docs = rendered(where)
        pods = dict(pod_specs(docs))
        held = [d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"]
        assert not (pods and held), f"`kubectl delete -k {where}` deletes {held} with {sorted(pods)}"
        mounted |= {v["persistentVolumeClaim"]["claimName"]: f"{where}: {name}" for name, pod in pods.items()
                    for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    unrendered = {claim: where for claim, where in mounted.items() if claim not in claims}
    assert unrendered == {TRAINER_CLAIM: "overlays/eval-watch: Deployment/dfserve-eval-watch"}
    assert {"loadtest-runs", "loadtest-runs-sharded", "eval-watch", "model-cache"} <= mounted.keys()


KEYING = ("target", "tasks", "num_tasks", "max_new_tokens", "dtype", "prompt_format", "thinking", "reference",
          "profile_name", "drafter_config")
"""The settings a feature cache is keyed by (with the drafter's taps): the parts' and the watch's must agree."""


def test_sharded_feature_build_makes_the_parts_of_the_watchs_cache() -> None:
    job = one(rendered("overlays/eval-features-sharded"), "Job", "dfserve-eval-features")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert job["spec"]["completionMode"] == "Indexed" and container["command"] == ["dfserve", "eval", "run"]
    count = job["spec"]["completions"]
    assert job["spec"]["parallelism"] == count
    downward = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert downward["SHARD_INDEX"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    shard = run_command.make_context("run", [a.replace("$(SHARD_INDEX)", "1").replace("$(JOB_UID)", "u")
                                             for a in expanded_args({**container, "env": []})]).params
    assert shard["shard"] == f"1/{count}" and shard["cache"] == Path("/watch/cache-parts/part-1")
    watch = one(rendered("overlays/eval-watch"), "Deployment", "dfserve-eval-watch")
    (watcher,) = watch["spec"]["template"]["spec"]["containers"]
    params = watch_command.make_context("watch", expanded_args(watcher), resilient_parsing=True).params
    assert {k: shard[k] for k in KEYING} == {k: params[k] for k in KEYING}
    assert shard["drafters"] == (params["baseline"],)  # the baseline's taps are the cache's
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    watch_claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                    for v in watch["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims["watch"] == watch_claims["watch"] and params["cache"] == Path("/watch/cache")
    claim = one(rendered("overlays/eval-volume"), "PersistentVolumeClaim", claims["watch"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # the parts are written from several nodes
    merge = one(rendered("overlays/eval-features-merge"), "Job", "dfserve-eval-features-merge")
    (merger,) = merge["spec"]["template"]["spec"]["containers"]
    assert merger["command"] == ["dfserve", "eval", "cache", "merge"]
    # the parts exist only on the volume: parsed leniently (they are left out), every flag must be the command's own
    merged = cache_merge_command.make_context("merge", expanded_args(merger), resilient_parsing=True).params
    assert expanded_args(merger)[:count + 1] == [*(f"/watch/cache-parts/part-{i}" for i in range(count)), "--cache"]
    assert merged["cache"] == params["cache"] and merged["num_tasks"] == params["num_tasks"]
    assert merged["tasks"] == params["tasks"]
    merge_claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                    for v in merge["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert merge_claims == {"watch": claims["watch"]}
