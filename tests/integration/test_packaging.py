"""The distribution: one top-level package, the data its servers need inside it, and an installed copy that serves
with nothing from this checkout."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest

from tests import ROOT
from tests.integration.servers import LOOPBACK, serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-w", str(out)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("dfserve-*.whl")
    return built


def test_the_wheel_installs_one_package_with_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {name for name in top if not name.endswith(".dist-info")} == {"dfserve"}
    for data in ("dfserve/deploy/profiles/pro6000.yaml", "dfserve/deploy/sim/profiles/zlab.json",
                 "dfserve/deploy/sim/data/qwen3-tokenizer.json.xz", "dfserve/deploy/sglang_check.py"):
        assert data in names


def test_an_installed_copy_serves_the_simulator_with_nothing_from_the_checkout(wheel: Path, tmp_path: Path) -> None:
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
    argv = [str(python), "-P", "-m", "dfserve", "sim", "--host", LOOPBACK, "--port", "0", "--time-scale", "0.02"]
    with serve(argv) as sim:  # -P: the checkout (the working directory) is not put first on sys.path
        body = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        answer = httpx.post(sim.url + "/generate", json=body, timeout=30).json()
    assert answer["meta_info"]["prompt_tokens"] > 0 and answer["meta_info"]["completion_tokens"] == 8
    assert answer["meta_info"]["dfserve_simulated"] is True
