"""dfserve's tests: `unit/` (logic, in one process, no sockets) and `integration/` (real servers on loopback,
subprocesses and installed tools)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository."""
FIXTURES = ROOT / "tests" / "fixtures"
