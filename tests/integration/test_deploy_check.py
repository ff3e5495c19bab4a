"""`dfserve deploy --dry-run --check`: the printed argv is accepted by SGLang's real parser and DFLASH rules.

Runs the pinned SGLang release from the check venv the Makefile builds (`.venv-sglang`), as CI does.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT
from tests.fixtures.deploy.synth import (
    TINY_DRAFTER_CONFIG,
    TINY_TARGET,
    tiny_state_dict,
    trainer_checkpoint,
    write_checkpoint,
)
from tests.integration.servers import dfserve_argv

SGLANG_PYTHON = Path(os.environ.get("DFSERVE_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))


@pytest.fixture(scope="module")
def sglang_python() -> str:
    assert SGLANG_PYTHON.is_file(), f"{SGLANG_PYTHON} missing: `make .venv-sglang/.installed` builds SGLang's check venv"
    return str(SGLANG_PYTHON)


def deploy(*args: str, python: str, root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DFSERVE_SGLANG_PYTHON": python, "DFSERVE_DEPLOY_ROOT": str(root)}
    return subprocess.run(dfserve_argv("deploy", *args), capture_output=True, text=True, env=env, timeout=120, check=False)


def command(stdout: str) -> list[str]:
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout
    return shlex.split(lines[0])


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_zlab_dry_run_passes_sglang_parser(sglang_python: str, tmp_path: Path) -> None:
    done = deploy("--drafter", "zlab", "--dry-run", "--check", python=sglang_python, root=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "SGLang 0.5.23 accepts it: DFLASH, block 16, draft attention flashinfer" in done.stderr
    argv = command(done.stdout)
    assert argv[:2] == ["env", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"]
    assert argv[2:5] == [sglang_python, "-m", "sglang.launch_server"]
    assert flag(argv, "--speculative-algorithm") == "DFLASH"
    assert flag(argv, "--speculative-draft-model-path") == "z-lab/Qwen3.6-27B-DFlash"
    assert flag(argv, "--model-path") == "Qwen/Qwen3.6-27B"
    assert list(tmp_path.iterdir()) == []  # a dry run of zlab creates nothing


def test_converted_checkpoint_dry_run_passes_sglang_parser(sglang_python: str, tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt" / "checkpoint.pt", trainer_checkpoint(tiny_state_dict(), "model-draft_model"))
    done = deploy(
        "--drafter", str(checkpoint), "--target", str(TINY_TARGET), "--drafter-config", str(TINY_DRAFTER_CONFIG),
        "--dry-run", "--check", python=sglang_python, root=tmp_path / "root",
    )
    assert done.returncode == 0, done.stderr
    assert "accepts it: DFLASH, block 8" in done.stderr
    argv = command(done.stdout)
    folder = Path(flag(argv, "--speculative-draft-model-path"))
    assert folder.parent == tmp_path / "root" / "drafters" and folder.name.startswith("inhouse-")
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert flag(argv, "--model-path") == str(TINY_TARGET.resolve())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--sglang-arg=--no-such-flag=1", "unrecognized arguments: --no-such-flag=1"),
        ("--sglang-arg=--speculative-draft-window-size=4", "--speculative-draft-window-size must be >="),
        ("--sglang-arg=--pp-size=2", "only supports pp_size == 1"),
    ],
)
def test_sglang_rejections_are_one_line(sglang_python: str, tmp_path: Path, extra: str, message: str) -> None:
    done = deploy("--drafter", "zlab", "--dry-run", "--check", extra, python=sglang_python, root=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dfserve: error: --check: SGLang 0.5.23 rejects the argv")
    assert message in lines[0]


def test_check_starts_nothing(sglang_python: str, tmp_path: Path) -> None:
    done = deploy("--drafter", "zlab", "--check", "--health-timeout", "20", python=sglang_python, root=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "SGLang 0.5.23 accepts it" in done.stderr and done.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_the_simulators_check_uses_its_own_parser(tmp_path: Path) -> None:
    done = deploy("--drafter", "zlab", "--engine", "sim", "--check", python="/nonexistent/python", root=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "the simulator accepts it: profile zlab, block 16" in done.stderr and done.stdout == ""
    bad = deploy("--drafter", "zlab", "--engine", "sim", "--check", "--sim-profile", str(tmp_path / "gone.json"),
                 python="/nonexistent/python", root=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"dfserve: error: --sim-profile: {tmp_path / 'gone.json'}: no such file")
    assert list(tmp_path.iterdir()) == []


def test_check_without_sglang_says_so(tmp_path: Path) -> None:
    done = deploy("--drafter", "zlab", "--dry-run", "--check", python="/nonexistent/python", root=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "dfserve: error: --sglang-python: /nonexistent/python not found; --check needs the interpreter SGLang is installed in"
    bare = deploy("--drafter", "zlab", "--dry-run", "--check", python=sys.executable, root=tmp_path)
    lines = bare.stderr.strip().splitlines()
    assert bare.returncode == 2 and len(lines) == 1
    assert lines[0].endswith("(exit 1): ModuleNotFoundError: No module named 'sglang'")
