"""Benchmark: the memory a recorded native stream holds, and what recording costs the relay per piece.

SGLang's native `/generate` stream repeats the whole output so far (text and ids) in every event, so the events of
a stream grow with the square of its length. A relay that records the stream (`keep_pieces`, for shadow records)
used to keep every piece by reference; it now keeps each event's changed running total (`completion_tokens`) with
its arrival, and the shadow record takes the output from the stream's last events. This feeds one native stream
of `--tokens` tokens (`--tokens-per-event` each, as SGLang writes them) to a recording relay, each event a new
bytes object as a read of the socket is, and reports with tracemalloc what the relay holds once the stream is
over and the peak while it ran, then the record built from it (what the recorder holds while the primary waits
for its mirror); and CPU time per piece of the recording relay, best of `--rounds`. `--baseline` names another
build of the C extension (a `_relay*.so`, say the main branch's) measured beside this one.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/recorded_stream_memory.py --baseline MAIN/dfserve/_relay.so

It prints its figures and replaces its own section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import sys
import time
import tracemalloc
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.relay_strip import load_build  # noqa: E402
from bench.results import write_section  # noqa: E402
from dfserve import _relay, sglang  # noqa: E402
from dfserve.gateway.observers import Exchanged  # noqa: E402
from dfserve.metrics import Outcome  # noqa: E402
from dfserve.sglang.server import NativeStreamEncoder, meta_info_body  # noqa: E402
from dfserve.shadow.records import shadow_record  # noqa: E402

SECTION = "recorded_stream_memory"
TOKEN = " tok"
"""One token's text: a common English token is 4 or 5 bytes."""


def native_events(tokens: int, per_event: int) -> list[bytes]:
    """A native stream as SGLang 0.5.23 writes it, without incremental output, ending in `[DONE]`."""
    encoder, events, sent = NativeStreamEncoder(incremental=False), [], 0
    while sent < tokens:
        step = min(per_event, tokens - sent)
        sent += step
        last = sent == tokens
        meta = meta_info_body(rid="5f1d2c0a9b8e4f7aa1b2c3d4e5f60718", prompt_tokens=412, completion_tokens=sent,
                              finish=sglang.FinishReason("length", length=tokens) if last else None,
                              e2e_latency_s=9.5 if last else None)
        events.append(encoder.event(TOKEN * step, range(1000 + sent - step, 1000 + sent), meta))
    return [*events, sglang.SSE_DONE]


def recording_relay(impl: ModuleType) -> Any:
    marks = sglang.NATIVE_TOKENS
    return impl.EventRelay(None, True, marks.keys, marks.cumulative, (0.01, 0.1), None, None, True)


def relay_held(impl: ModuleType, events: list[bytes]) -> tuple[int, int, Any]:
    """Bytes a recording relay holds once the stream is over, its peak while fed, and the relay."""
    gc.collect()
    tracemalloc.start()
    relay = recording_relay(impl)
    for n, event in enumerate(events):
        relay.received(0.001 * n, bytes(bytearray(event)), n == len(events) - 1)  # a new object, as a read is
    relay.ended()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return kept, peak, relay


def record_held(relay: Any) -> int:
    """Bytes of the shadow record built from this build's relay: what the recorder holds for a pending primary."""
    outcome = Outcome(arm="a", route="native", replica="r", status=200, error=None, ttft_s=0.001, e2e_s=2.0,
                      output_tokens=relay.tokens)
    exchange = Exchanged(1, False, "POST", "/generate", b"", b"{}", 0.0, outcome, answer=relay.tail, streamed=True,
                         pieces=relay.pieces)
    shadow_record(exchange, 0.0)  # caches warmed outside the count
    gc.collect()
    tracemalloc.start()
    record = shadow_record(exchange, 0.0)
    gc.collect()
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    if record.output_sha256 is None or len(record.chunk_times_s) != len(relay.pieces):
        raise SystemExit("the record of the stream is incomplete: its output or chunks were not read")
    return size


def per_piece_ns(impl: ModuleType, events: list[bytes], rounds: int) -> float:
    """Best CPU nanoseconds per piece of a recording relay over the rounds."""
    best = float("inf")
    for _ in range(rounds):
        relay = recording_relay(impl)
        start = time.process_time_ns()
        for n, event in enumerate(events):
            relay.received(0.001 * n, event)
        best = min(best, (time.process_time_ns() - start) / len(events))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another build of dfserve/_relay*.so, measured beside this one")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--tokens-per-event", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    events = native_events(args.tokens, args.tokens_per_event)
    builds = ([("C, baseline build", load_build(args.baseline))] if args.baseline is not None else []) + [
        ("C, this build", _relay)]
    lines = ["| relay | held after the stream (KiB) | peak while fed (KiB) | CPU per piece, recording (ns) |",
             "|---|---|---|---|"]
    held_kib = {}
    last: Any = None
    for name, impl in builds:
        kept, peak, last = relay_held(impl, events)
        held_kib[name] = kept / 1024
        lines.append(f"| {name} | {kept / 1024:,.0f} | {peak / 1024:,.0f} | "
                     f"{per_piece_ns(impl, events, args.rounds):,.0f} |")
        print(lines[-1], flush=True)
    record_kib = record_held(last) / 1024
    body = sum(map(len, events))
    reading = (f"The stream: {len(events)} events, {body / 2**20:.1f} MiB in all. The shadow record built from this "
               f"build's relay, what the recorder now holds while a primary waits for its mirror: {record_kib:,.0f} "
               "KiB")
    if args.baseline is not None:
        reading += (f" (it held the exchange, whose pieces were the baseline's {held_kib['C, baseline build']:,.0f} "
                    "KiB)")
    print(reading)
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python bench/recorded_stream_memory.py" + (
        " --baseline MAIN/dfserve/_relay.so" if args.baseline else "") + (
        f" --tokens {args.tokens}" if args.tokens != 2048 else "") + (
        f" --tokens-per-event {args.tokens_per_event}" if args.tokens_per_event != 1 else "")
    write_section(SECTION, "\n".join([
        "## Gateway: memory held by a recorded native stream (`bench/recorded_stream_memory.py`)",
        "",
        f"`{command}` on {datetime.date.today()} ({platform.machine()}, Python {platform.python_version()}; the "
        f"machine was shared with other work). One native `/generate` stream of {args.tokens} tokens, "
        f"{args.tokens_per_event} an event, each event repeating the whole text and ids so far, fed to a relay that "
        "records it (`keep_pieces`), each event a new bytes object; bytes traced by tracemalloc. The baseline kept "
        "every piece; this build keeps each event's changed running total and reads the output from the last "
        f"events. CPU per piece: best of {args.rounds} rounds of the whole stream.",
        "",
        *lines,
        "",
        reading + ".",
    ]))


if __name__ == "__main__":
    main()
