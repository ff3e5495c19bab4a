"""What a benchmarked server process holds in memory, asked for from outside: live Python objects beside resident
memory, so that a leak (objects kept) can be told from the allocator keeping pages it once used.

The server is started through `SNIPPET`, which installs the probe and then runs the `dfserve` command line, so the
product carries no debug hook:

    [sys.executable, "-c", SNIPPET, "/tmp/probe.json", "gateway", "--port", "0", ...]

`ask(pid, path)` sends SIGUSR1 and returns what the process wrote: its resident memory as found, then, after a full
collection, its live gc-tracked objects by type and its allocated blocks (`sys.getallocatedblocks`: every object
and buffer of Python's allocator, not only the gc-tracked ones), then its resident memory once `malloc_trim(0)` has
given back the C heap's free pages. With `PYTHONTRACEMALLOC=1` in the process's environment it adds the traced
bytes and the source lines whose allocations grew most since the first ask. Only stdlib imports: the probe must not
change what it measures.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import signal
import sys
import time
import tracemalloc
from pathlib import Path
from types import FrameType
from typing import Any

SNIPPET = (
    "import sys\n"
    f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
    "from bench.heap_probe import install\n"
    "install(sys.argv[1])\n"
    "from dfserve.cli import main\n"
    "main(sys.argv[2:])\n"
)


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError("VmRSS")


def install(path: str) -> None:
    """On SIGUSR1, write this process's memory figures to `path` (JSON, replaced whole)."""
    first = path + ".first"
    trim = ctypes.CDLL("libc.so.6").malloc_trim

    def probe(signum: int, frame: FrameType | None) -> None:
        figures: dict[str, Any] = {"rss_mib": rss_mib()}
        gc.collect()
        figures["types"] = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
        figures["gc_objects"] = sum(figures["types"].values())
        figures["allocated_blocks"] = sys.getallocatedblocks()
        if tracemalloc.is_tracing():
            figures["traced_mib"] = tracemalloc.get_traced_memory()[0] / 2**20
            snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            if not os.path.exists(first):
                snapshot.dump(first)  # on disk, not held: the first snapshot would be most of what later asks see
            figures["grown"] = [str(stat) for stat in snapshot.compare_to(tracemalloc.Snapshot.load(first),
                                                                          "lineno")[:10]]
            del snapshot
        trim(0)
        figures["trimmed_rss_mib"] = rss_mib()
        Path(path + ".part").write_text(json.dumps(figures))
        os.replace(path + ".part", path)

    signal.signal(signal.SIGUSR1, probe)


def ask(pid: int, path: Path, timeout_s: float = 30.0) -> dict[str, Any]:
    """Signal the process installed with `path` and wait for its figures."""
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} wrote no memory figures to {path} within {timeout_s:g} s")
        time.sleep(0.05)
    figures: dict[str, Any] = json.loads(path.read_text())
    return figures
