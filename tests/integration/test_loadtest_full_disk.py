"""The load tester when its records cannot be written (a full disk): one line, the run kept as interrupted with the
records that were written, a non-zero exit, no traceback. The disk fills at the writer's file: after a few batches
the writer process's requests.jsonl descriptor is pointed at /dev/full, whose writes fail with ENOSPC as a full
file system's do."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dfserve.loadtest.records import read_records
from tests.integration.servers import dfserve_argv, sim_server

pytestmark = pytest.mark.slow
REQUESTS = 400
"""At 20 a second: a writer's batch holds a record or two however late a loaded machine wakes it, so its third
batch comes long before the schedule's end."""
FILLS_AFTER_BATCHES = 2

FULL_DISK = f'''
import os
from dfserve import runs

_write = runs.JsonlAppender.write_lines
_batches = [0]


def _filling(self, lines):
    if _batches[0] == {FILLS_AFTER_BATCHES}:
        os.dup2(os.open("/dev/full", os.O_WRONLY), self._handle.fileno())
    _batches[0] += 1
    _write(self, lines)


runs.JsonlAppender.write_lines = _filling
'''


def test_a_full_disk_ends_the_run_in_one_line_and_keeps_it_as_interrupted(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FULL_DISK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    with sim_server("zlab", 0.002, 0) as zlab:
        done = subprocess.run(dfserve_argv("loadtest", "run", "--out", str(tmp_path), "--name", "full", "--arm",
                                           f"zlab={zlab}", "--num-requests", str(REQUESTS), "--warmup", "0",
                                           "--rate", "20", "--arrival", "constant", "--max-new-tokens", "64", "--quiet"),
                              capture_output=True, text=True, timeout=120, env=env)
    run_dir = tmp_path / "full"
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    # The read-lag warning may come too (the engine's chunks are microseconds apart here): not what is tested.
    [line] = [line for line in done.stderr.splitlines() if not line.startswith("warning: ")]
    prefix = f"dfserve: error: {run_dir / 'requests.jsonl'}: No space left on device: "
    suffix = f" finished requests were not written; run kept, marked interrupted: {run_dir}"
    assert line.startswith(prefix) and line.endswith(suffix), line
    lost, of = map(int, line[len(prefix):-len(suffix)].split(" of "))
    written = list(read_records(run_dir / "requests.jsonl"))
    assert lost >= 1 and of - lost == len(written) >= 1
    assert of < REQUESTS  # the run stopped sending once its records could not be kept
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["arms"][0]["requests"] == len(written)
