"""Benchmark: what cutting spec details out of a stream, and watching it for error events, cost the relay per piece.

The gateway asks SGLang for spec details on every chat and completions stream whose client did not, and the relay
(`EventRelay`, `strip`) cuts them out again: one byte search per piece, where only the last events carry the key.
On the same streams it looks for an error or abort event wherever it comes (`alarm`: SGLang sends the error, then
the usage chunk and `[DONE]`, so the last events alone may not hold it): one more search per piece. This times
`EventRelay.received` on one streamed-chat chunk per piece, CPU time per piece (the best and the median of
`--rounds` rounds of `--pieces` pieces), for the relay without either (native streams), with `strip`, and with both
(an OpenAI stream through the gateway), in C and in the pure-Python twin; `--baseline` names another build of the C
extension (a `_relay*.so`, say the main branch's) to time beside this one without either. Target: without them,
no change against the baseline beyond the rounds' spread.

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


WATCHES: dict[str, dict[str, object]] = {
    "none": {},
    "spec details": {"strip": sglang.SPEC_DETAILS_KEY},
    "spec details, error events": {"strip": sglang.SPEC_DETAILS_KEY, "alarm": sglang.OPENAI_ALARM},
}
"""What the relay does beside relaying, by name: its keyword arguments."""


def per_piece_ns(impl: ModuleType, watch: str, pieces: int, rounds: int) -> tuple[float, float]:
    """Best and median CPU nanoseconds per piece over the rounds."""
    marks = sglang.CONTENT_CHUNKS
    written: list[bytes] = []
    times = []
    for _ in range(rounds):
        relay = impl.EventRelay(written.append, True, marks.keys, marks.cumulative, (0.01, 0.1), None,
                                **WATCHES[watch])
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
        rows.append(("C, baseline build", load_build(args.baseline), "none"))
    rows += [(name, impl, watch) for name, impl in (("C", _relay), ("Python twin", _relay_py)) for watch in WATCHES]
    lines = ["| relay | beside relaying | best ns per piece | median ns per piece |", "|---|---|---|---|"]
    medians = {}
    for name, impl, watch in rows:
        pieces = args.pieces if impl is not _relay_py else args.pieces // 10
        best, median = per_piece_ns(impl, watch, pieces, args.rounds)
        medians[name, watch] = median
        lines.append(f"| {name} | {watch} | {best:.0f} | {median:.0f} |")
        print(lines[-1], flush=True)
    bare, cut, both = (medians["C", watch] for watch in WATCHES)
    reading = (f"In C, cutting costs {cut - bare:+.0f} ns per piece ({(cut - bare) / bare:+.0%}), and watching for "
               f"error events {both - cut:+.0f} more ({(both - cut) / bare:+.0%})")
    if args.baseline is not None:
        change = bare - medians["C, baseline build", "none"]
        reading += f"; without either, this build against the baseline: {change:+.0f} ns per piece"
    print(reading)
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python bench/relay_strip.py" + (
        " --baseline MAIN/dfserve/_relay.so" if args.baseline else "")
    write_section(SECTION, "\n".join([
        "## Relay: cutting spec details out of a stream and watching for error events, per piece "
        "(`bench/relay_strip.py`)",
        "",
        f"`{command}` on {datetime.date.today()} ({platform.machine()}, Python {platform.python_version()}; the "
        "machine was shared with other work). CPU time of `EventRelay.received` per piece, one "
        f"{len(CHUNK)}-byte streamed-chat chunk per piece, {args.rounds} rounds of {args.pieces} pieces (the twin: "
        f"{args.pieces // 10}). Native streams get neither; OpenAI streams through the gateway get both (`alarm`, "
        "error events, is one more byte search per piece for each of its keys).",
        "",
        *lines,
        "",
        reading + ".",
    ]))


if __name__ == "__main__":
    main()
