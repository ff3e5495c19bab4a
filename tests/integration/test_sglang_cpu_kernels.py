"""The CPU SGLang distribution's own tests (sglang_cpu/tests: each stand-in sgl_kernel op against the Triton kernel it
replaces, and the hooks), run under .venv-sglang-cpu's interpreter, where SGLang and Triton are installed."""

from __future__ import annotations

import re
import subprocess

from tests.fixtures.sglang_cpu import REPO, SGLANG_CPU_PYTHON, require_sglang_cpu


def test_stand_in_kernels_and_hooks_pass_their_tests_in_the_cpu_venv() -> None:
    require_sglang_cpu()
    done = subprocess.run([str(SGLANG_CPU_PYTHON), "-m", "pytest", "-q"],
                          cwd=REPO / "sglang_cpu", capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 8, done.stdout[-1000:]
    assert "failed" not in done.stdout and "skipped" not in done.stdout
