from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dfserve import __version__
from dfserve.cli import COMMANDS, root


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dfserve", *args], capture_output=True, text=True, timeout=60)


def test_help_lists_every_command_with_its_purpose() -> None:
    result = run("--help")
    assert result.returncode == 0
    for name, (_, purpose) in COMMANDS.items():
        assert name in result.stdout
        assert purpose.split()[0] in result.stdout


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0 and __version__ in result.stdout


def test_every_registered_command_imports() -> None:
    for name in COMMANDS:
        assert root.get_command(None, name) is not None, name  # type: ignore[arg-type]


def test_unknown_command_is_a_usage_error() -> None:
    result = run("no-such-command")
    assert result.returncode == 2
    assert "No such command" in result.stderr


BAD_INVOCATIONS = {
    "deploy port out of range": (["deploy", "--drafter", "zlab", "--port", "0", "--dry-run"], "--port:"),
    "sim time scale": (["deploy", "--drafter", "zlab", "--engine", "sim", "--time-scale", "0", "--dry-run"],
                       "--time-scale:"),
    "simulated drafter on sglang": (["deploy", "--drafter", "sim:inhouse", "--dry-run"], "only with --engine sim"),
    "unwritable output folder": (["dashboards", "--out", "/proc/no-such-dir"], "/proc/no-such-dir"),
    "broken gateway yaml": (["gateway", "--config", "{bad_yaml}"], "invalid YAML at line 2"),
    "gateway port taken": (["gateway", "--port", "{taken}", "--arm", "a=1@http://127.0.0.1:9"], "already in use"),
    "sim port taken": (["sim", "--port", "{taken}"], "already in use"),
    "duplicate gateway arms": (["gateway", "--port", "0", "--arm", "a=1@http://127.0.0.1:9",
                                "--arm", "a=2@http://127.0.0.1:9"], "its own name"),
    "shadow records without shadow mode": (["gateway", "--port", "0", "--arm", "a=1@http://127.0.0.1:9",
                                            "--record", "/tmp/dfserve-never-written"], "need mode: shadow"),
    "secondary that is the primary": (["gateway", "--port", "0", "--mode", "shadow", "--primary", "a",
                                       "--arm", "a=1@http://127.0.0.1:9", "--arm", "b=1@http://127.0.0.1:9",
                                       "--record", "/tmp/dfserve-never-written", "--secondary", "a"],
                                      "shadow.secondary: 'a' is not a mirrored arm"),
    "infinite gateway weight": (["gateway", "--port", "0", "--arm", "a=inf@http://127.0.0.1:9"],
                                "--arm: weight: Input should be a finite number"),
    "loadtest without a load shape": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9"], "--concurrency or --rate"),
}


@pytest.mark.parametrize("case", list(BAD_INVOCATIONS))
def test_bad_input_is_one_line_naming_what_to_fix_and_exit_2(case: str, tmp_path: Path) -> None:
    argv, expected = BAD_INVOCATIONS[case]
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("arms: [\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = run(*(a.format(bad_yaml=bad_yaml, taken=port) for a in argv))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("dfserve: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert expected in result.stderr
