"""`dfserve deploy --emit k8s`: valid Kubernetes objects (kubernetes-validate --strict) that a `restricted` namespace
admits, running the same argv with local folders read from the model-cache volume."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dfserve.deploy.drafters import Drafter, resolve_target
from dfserve.deploy.k8s import Pod, render
from dfserve.deploy.profiles import load_profile
from dfserve.deploy.spec import build_spec
from dfserve.errors import FieldError
from tests.fixtures.deploy.synth import TINY_DRAFTER_CONFIG, TINY_TARGET, tiny_state_dict, write_checkpoint
from tests.integration.servers import dfserve_argv
from tests.integration.test_k8s import restricted_violations

VALIDATE = str(Path(sys.executable).with_name("kubernetes-validate"))


def deploy(root: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DFSERVE_DEPLOY_ROOT": str(root), "DFSERVE_SGLANG_PYTHON": "python3"}
    return subprocess.run(dfserve_argv("deploy", *args), capture_output=True, text=True, env=env, timeout=120, check=False, cwd=cwd)


def local_server_args(root: Path, *args: str) -> list[str]:
    done = deploy(root, *args, "--dry-run")
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout)
    return argv[argv.index("sglang.launch_server") + 1:]


def with_host(argv: list[str], host: str) -> list[str]:
    out = list(argv)
    out[out.index("--host") + 1] = host
    return out


def test_zlab_objects_validate_strictly_and_match_local_argv(tmp_path: Path) -> None:
    out = tmp_path / "k8s"
    done = deploy(tmp_path / "root", "--drafter", "zlab", "--emit", "k8s", "--out", str(out), "--namespace", "serving")
    assert done.returncode == 0, done.stderr
    files = sorted(out.iterdir())
    assert [f.name for f in files] == ["deployment.yaml", "service.yaml"]
    check = subprocess.run([VALIDATE, "--strict", *map(str, files)], capture_output=True, text=True, timeout=120, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "passed for resource deployment/pro6000-zlab" in check.stdout + check.stderr
    deployment = yaml.safe_load((out / "deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    assert container["args"] == with_host(local_server_args(tmp_path / "root", "--drafter", "zlab"), "0.0.0.0")
    assert {"name": "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "value": "1"} in container["env"]
    assert {"name": "HF_HOME", "value": "/models/hf"} in container["env"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert restricted_violations(deployment["spec"]["template"]["spec"]) == []
    assert deployment["metadata"]["namespace"] == "serving" and deployment["metadata"]["name"] == "pro6000-zlab"
    service = yaml.safe_load((out / "service.yaml").read_text())
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["port"] == 30000


def test_inhouse_objects_read_local_folders_from_the_model_cache(tmp_path: Path) -> None:
    """Relative --root and paths still resolve; the converted drafter and a local target under the model cache
    (default --root) appear at the same relative place under /models, read from its volume, never from the node."""
    write_checkpoint(tmp_path / "checkpoint.pt", {"model": tiny_state_dict(), "step": 1})
    root = tmp_path.resolve() / "root"
    shutil.copytree(TINY_TARGET, root / "targets" / "tiny")
    args = ("--target", "root/targets/tiny", "--drafter-config", str(TINY_DRAFTER_CONFIG))
    done = deploy(Path("root"), "--drafter", "checkpoint.pt", *args, "--emit", "k8s", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    deployment, service = list(yaml.safe_load_all(done.stdout))
    assert (deployment["kind"], service["kind"]) == ("Deployment", "Service")
    pod = deployment["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    container = pod["containers"][0]
    local = local_server_args(root, "--drafter", str(tmp_path / "checkpoint.pt"), *args[:1], str(root / "targets" / "tiny"), *args[2:])
    drafter = local[local.index("--speculative-draft-model-path") + 1]
    assert drafter.startswith(str(root / "drafters" / "inhouse-"))
    in_pod = {drafter: "/models/drafters/" + Path(drafter).name, str(root / "targets" / "tiny"): "/models/targets/tiny"}
    assert container["args"] == [in_pod.get(arg, arg) for arg in with_host(local, "0.0.0.0")]
    for local_folder, pod_folder in in_pod.items():
        assert f"the pod reads {pod_folder}: copy {local_folder} " in done.stderr
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["models"] == "/models"
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "model-cache"
    assert deployment["spec"]["template"]["metadata"]["annotations"]["dfserve.io/drafter-sha256"]
    stdin = subprocess.run([VALIDATE, "--strict", "-"], input=done.stdout, capture_output=True, text=True, timeout=120, check=False)
    assert stdin.returncode == 0, stdin.stdout + stdin.stderr


def test_local_folder_outside_the_model_cache_is_refused(tmp_path: Path) -> None:
    """A pod cannot read this machine's folders: one outside the model cache is an error, never a hostPath."""
    tmp_path = tmp_path.resolve()
    profile = load_profile("pro6000")
    drafter = Drafter("local", "folder", str(tmp_path / "cache" / "drafters" / "local"), 16, None, None, "inhouse")
    spec = build_spec(profile, resolve_target(None, profile, None), drafter, engine="sglang", port=30000)
    with pytest.raises(FieldError, match=re.escape(f"model_cache: {tmp_path}/cache/drafters/local is not under {tmp_path}/other")):
        render(spec, Pod(model_cache=tmp_path / "other"))
    deployment, _ = render(spec, Pod(model_cache=tmp_path / "cache"))
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--speculative-draft-model-path") + 1] == "/models/drafters/local"


LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
"""The API server's rule for a label value (k8s.io/apimachinery validation.IsValidLabelValue), besides <= 63."""


@pytest.mark.parametrize("folder", ["my drafter_", "-lead", "ÄÖ-x", "ÄÖ", "d" * 62 + "-tail"])
def test_labels_from_any_drafter_folder_name_are_valid_label_values(tmp_path: Path, folder: str) -> None:
    """A drafter's label comes from its folder's name; every label value the objects carry is one the API server
    takes, derived the same way every time."""
    profile = load_profile("pro6000")
    drafter = Drafter(folder, "folder", str(tmp_path / "cache" / folder), 16, None, None, "inhouse")
    spec = build_spec(profile, resolve_target(None, profile, None), drafter, engine="sglang", port=30000)
    objects = render(spec, Pod(model_cache=tmp_path / "cache"))
    found = [obj["metadata"]["labels"] for obj in objects] + [objects[0]["spec"]["template"]["metadata"]["labels"]]
    for labels in found:
        for value in labels.values():
            assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), (folder, value)
    drafter_label = found[0]["dfserve.io/drafter"]
    assert drafter_label and render(spec, Pod(model_cache=tmp_path / "cache"))[0]["metadata"]["labels"]["dfserve.io/drafter"] == drafter_label


def test_node_selector_and_startup_allowance(tmp_path: Path) -> None:
    args = ("--drafter", "zlab", "--emit", "k8s", "--node-selector", "pool=gpu", "--health-timeout", "600")
    done = deploy(tmp_path / "root", *args)
    assert done.returncode == 0, done.stderr
    pod = next(yaml.safe_load_all(done.stdout))["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    startup = pod["containers"][0]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 600
    bad = deploy(tmp_path / "root", "--drafter", "zlab", "--emit", "k8s", "--node-selector", "pool")
    assert bad.returncode == 2 and "--node-selector: 'pool' is not KEY=VALUE" in bad.stderr


def test_emit_refuses_to_overwrite_and_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "k8s"
    assert deploy(tmp_path / "root", "--drafter", "zlab", "--emit", "k8s", "--out", str(out)).returncode == 0
    again = deploy(tmp_path / "root", "--drafter", "zlab", "--emit", "k8s", "--out", str(out))
    assert again.returncode == 2 and "already exist" in again.stderr
    sim = deploy(tmp_path / "root", "--drafter", "zlab", "--engine", "sim", "--emit", "k8s")
    assert sim.returncode == 2 and "--engine: sim runs on this machine only and has no Kubernetes form" in sim.stderr
    free = deploy(tmp_path / "root", "--drafter", "zlab", "--emit", "k8s", "--port", "0")
    assert free.returncode == 2 and "--port: a Service needs a fixed port" in free.stderr
