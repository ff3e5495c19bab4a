"""`dfserve deploy --emit k8s`: valid Kubernetes objects (kubernetes-validate --strict) running the same argv."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from tests.fixtures.deploy.synth import TINY_DRAFTER_CONFIG, TINY_TARGET, tiny_state_dict, write_checkpoint
from tests.servers import dfserve_argv

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
    assert container["env"] == [{"name": "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "value": "1"}]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert deployment["metadata"]["namespace"] == "serving" and deployment["metadata"]["name"] == "pro6000-zlab"
    service = yaml.safe_load((out / "service.yaml").read_text())
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["port"] == 30000


def test_inhouse_objects_mount_local_folders_at_the_same_paths(tmp_path: Path) -> None:
    """Relative --root and checkpoint paths still give absolute host paths (a pod has no working directory of ours)."""
    write_checkpoint(tmp_path / "checkpoint.pt", {"model": tiny_state_dict(), "step": 1})
    args = ("--drafter", "checkpoint.pt", "--target", str(TINY_TARGET), "--drafter-config", str(TINY_DRAFTER_CONFIG))
    done = deploy(Path("root"), *args, "--emit", "k8s", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    deployment, service = list(yaml.safe_load_all(done.stdout))
    assert (deployment["kind"], service["kind"]) == ("Deployment", "Service")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    local = local_server_args(tmp_path / "root", "--drafter", str(tmp_path / "checkpoint.pt"), *args[2:])
    assert container["args"] == with_host(local, "0.0.0.0")
    drafter = container["args"][container["args"].index("--speculative-draft-model-path") + 1]
    assert drafter.startswith(str(tmp_path / "root" / "drafters" / "inhouse-"))
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {drafter, str(TINY_TARGET.resolve())}
    assert {m["mountPath"] for m in container["volumeMounts"]} >= host_paths
    assert deployment["spec"]["template"]["metadata"]["annotations"]["dfserve.io/drafter-sha256"]
    stdin = subprocess.run([VALIDATE, "--strict", "-"], input=done.stdout, capture_output=True, text=True, timeout=120, check=False)
    assert stdin.returncode == 0, stdin.stdout + stdin.stderr


def test_emit_refuses_to_overwrite_and_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "k8s"
    assert deploy(tmp_path / "root", "--drafter", "zlab", "--emit", "k8s", "--out", str(out)).returncode == 0
    again = deploy(tmp_path / "root", "--drafter", "zlab", "--emit", "k8s", "--out", str(out))
    assert again.returncode == 2 and "already exist" in again.stderr
    sim = deploy(tmp_path / "root", "--drafter", "zlab", "--engine", "sim", "--emit", "k8s")
    assert sim.returncode == 2 and "renders the sglang engine only" in sim.stderr
