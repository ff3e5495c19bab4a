"""The distribution: one top-level package, the data its servers need inside it, and an installed copy that serves
with nothing from this checkout, also when it was built without a compiler (the relay's pure-Python twin)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import ROOT
from tests.integration.servers import LOOPBACK, serve

pytestmark = pytest.mark.slow


def build_wheel(out: Path, source: Path = ROOT, env: dict[str, str] | None = None) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", str(source), "--no-deps", "--no-build-isolation",
                    "-w", str(out)], check=True, capture_output=True, timeout=300, env=env)
    (built,) = out.glob("dfserve-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_installs_one_package_with_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {name for name in top if not name.endswith(".dist-info")} == {"dfserve"}
    for data in ("dfserve/deploy/profiles/pro6000.yaml", "dfserve/deploy/sim/profiles/zlab.json",
                 "dfserve/deploy/sim/data/qwen3-tokenizer.json.xz", "dfserve/deploy/sglang_check.py"):
        assert data in names


def install(wheel: Path, tmp_path: Path) -> Path:
    """`wheel` installed into a new venv whose dependencies come from this one; its Python."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # The dependencies come from this venv (read-only, after the new venv's own site-packages); dfserve does not.
    (Path(purelib) / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", purelib, str(wheel)],
                   check=True, capture_output=True, timeout=300)
    where = subprocess.run([str(python), "-P", "-c", "import dfserve.deploy.sim.server as m; print(m.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(purelib)
    return python


def generate(python: Path) -> dict[str, Any]:
    """One request to the installed copy's simulator, streamed: its last event's `meta_info`."""
    argv = [str(python), "-P", "-m", "dfserve", "sim", "--host", LOOPBACK, "--port", "0", "--time-scale", "0.02"]
    with serve(argv) as sim:  # -P: the checkout (the working directory) is not put first on sys.path
        body = {"text": "def add(a, b):", "stream": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        events = httpx.post(sim.url + "/generate", json=body, timeout=30).text.split("\n\n")
    meta: dict[str, Any] = json.loads(events[-3].removeprefix("data: "))["meta_info"]
    return meta


def test_an_installed_copy_serves_the_simulator_with_nothing_from_the_checkout(wheel: Path, tmp_path: Path) -> None:
    meta = generate(install(wheel, tmp_path))
    assert meta["prompt_tokens"] > 0 and meta["completion_tokens"] == 8 and meta["dfserve_simulated"] is True


def test_without_a_compiler_the_install_goes_on_and_runs_on_the_pure_python_relay(tmp_path: Path) -> None:
    source = tmp_path / "source"  # no extension built before, in place or under build/
    shutil.copytree(ROOT / "dfserve", source / "dfserve", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    built = build_wheel(tmp_path / "wheel", source, {**os.environ, "CC": "false"})  # every compile fails
    assert not [name for name in zipfile.ZipFile(built).namelist() if name.endswith(".so")]
    python = install(built, tmp_path)
    probe = subprocess.run([str(python), "-P", "-c", "from dfserve import relay_core; print(relay_core.ACCELERATED)"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout == "False\n" and "using its pure-Python twin" in probe.stderr
    assert generate(python)["completion_tokens"] == 8
