from __future__ import annotations

import subprocess
import sys

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
