"""Benchmark: what cutting spec details out of a stream costs the relay per piece.

The gateway asks SGLang for spec details on every chat and completions stream whose client did not, and the relay
(`EventRelay`, `strip`) cuts them out again: one byte search per piece, where only the last events carry the key.
This times `EventRelay.received` on one streamed-chat chunk per piece, CPU time per piece (the best and the median
of `--rounds` rounds of `--pieces` pieces), for the relay without `strip` (native streams, and streams whose client
asked) and with it, in C and in the pure-Python twin; `--baseline` names another build of the C extension (a
`_relay*.so`, say the main branch's) to time beside this one without `strip`. Target: without `strip`, no change
against the baseline beyond the rounds' spread.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/relay_strip.py --baseline /path/to/main/dfserve/_relay.so

It prints its figures and replaces its own section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import platform
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_section  # noqa: E402
from dfserve import _relay, _relay_py, sglang  # noqa: E402

SECTION = "relay_strip"
CHUNK = b"data: " + sglang.json_bytes({
    "id": "5f1d2c0a9b8e4f7aa1b2c3d4e5f60718", "object": "chat.completion.chunk", "created": 1764460000,
    "model": "Qwen/Qwen3.6-27B", "choices": [{"index": 0, "delta": {"role": None, "content": "    return a + b",
                                                                     "reasoning_content": None, "tool_calls": None},
                                              "logprobs": None, "finish_reason": None, "matched_stop": None}],
    "usage": None}) + b"\n\n"
"""A content chunk as SGLang 0.5.23 streams one (``ChatCompletionStreamResponse.model_dump_json``)."""


def load_build(path: Path) -> ModuleType:
    """Another build of the extension, beside the one imported (each shared object has its own types)."""
    spec = importlib.util.spec_from_file_location("dfserve._relay", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_piece_ns(impl: ModuleType, strip: bytes | None, pieces: int, rounds: int) -> tuple[float, float]:
    """Best and median CPU nanoseconds per piece over the rounds."""
    marks = sglang.CONTENT_CHUNKS
    written: list[bytes] = []
    times = []
    for _ in range(rounds):
        extra = {} if strip is None else {"strip": strip}
        relay = impl.EventRelay(written.append, True, marks.keys, marks.cumulative, (0.01, 0.1), None, **extra)
        start = time.process_time_ns()
        for i in range(pieces):
            relay.received(0.001 * i, CHUNK)
        times.append((time.process_time_ns() - start) / pieces)
        written.clear()
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another build of dfserve/_relay*.so, timed without strip")
    parser.add_argument("--pieces", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rows = []
    if args.baseline is not None:
        rows.append(("C, baseline build", load_build(args.baseline), None))
    rows += [("C", _relay, None), ("C", _relay, sglang.SPEC_DETAILS_KEY), ("Python twin", _relay_py, None),
             ("Python twin", _relay_py, sglang.SPEC_DETAILS_KEY)]
    lines = ["| relay | strip | best ns per piece | median ns per piece |", "|---|---|---|---|"]
    medians = {}
    for name, impl, strip in rows:
        pieces = args.pieces if impl is not _relay_py else args.pieces // 10
        best, median = per_piece_ns(impl, strip, pieces, args.rounds)
        medians[name, strip] = median
        lines.append(f"| {name} | {'spec details' if strip else 'none'} | {best:.0f} | {median:.0f} |")
        print(lines[-1], flush=True)
    cut = medians["C", sglang.SPEC_DETAILS_KEY] - medians["C", None]
    reading = f"In C, cutting costs {cut:+.0f} ns per piece ({cut / medians['C', None]:+.0%})"
    if args.baseline is not None:
        change = medians["C", None] - medians["C, baseline build", None]
        reading += f"; without it, this build against the baseline: {change:+.0f} ns per piece"
    print(reading)
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python bench/relay_strip.py" + (
        " --baseline MAIN/dfserve/_relay.so" if args.baseline else "")
    write_section(SECTION, "\n".join([
        "## Relay: cutting spec details out of a stream, per piece (`bench/relay_strip.py`)",
        "",
        f"`{command}` on {datetime.date.today()} ({platform.machine()}, Python {platform.python_version()}; the "
        "machine was shared with other work). CPU time of `EventRelay.received` per piece, one "
        f"{len(CHUNK)}-byte streamed-chat chunk per piece, {args.rounds} rounds of {args.pieces} pieces (the twin: "
        f"{args.pieces // 10}). Without `strip` (native streams, and streams whose client asked for spec details) "
        "the relay does what it did before; with it, one byte search per piece.",
        "",
        *lines,
        "",
        reading + ".",
    ]))


if __name__ == "__main__":
    main()
