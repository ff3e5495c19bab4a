"""Runs SGLang's own benchmark (`python -m sglang.benchmark.serving ARGS`) with the interpreter of `.venv-sglang`.

The benchmark imports `FAKE_BOOTSTRAP_HOST` from `sglang.srt.disaggregation.utils`, whose imports reach GPU-only
packages (torchvision) that a CPU install of SGLang lacks; the benchmark uses the constant only for disaggregated
prefill, so a module holding just that constant (its value in SGLang 0.5.23) stands in for it.

`ARGS --then ARGS ...` runs the benchmark once per group of arguments, in this one process: its imports, which take
most of a short run's time, are paid once.
"""

import runpy
import sys
import types

stub = types.ModuleType("sglang.srt.disaggregation.utils")
stub.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # type: ignore[attr-defined]
sys.modules[stub.__name__] = stub
runs: list[list[str]] = [[]]
for arg in sys.argv[1:]:
    if arg == "--then":
        runs.append([])
    else:
        runs[-1].append(arg)
for args in runs:
    sys.argv = ["sglang.benchmark.serving", *args]
    runpy.run_module("sglang.benchmark.serving", run_name="__main__")
