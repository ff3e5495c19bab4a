"""Benchmark: the CPU the load tester's record writer spends deriving one request's record, per chunk, in isolation.

`derive` as the writer process runs it (SGLang's framing split in one pass, chat content chunks read through
`sglang.ChunkTemplate`) beside `derive(..., decode_all=True)`, which decodes every event whole with `SSEDecoder` and
`json.loads`, as records were derived before. Streams: bench/sync_server.py's chat stream (what bench/tester_timing.py
`--parts sync` sends: 64 chunks), a chat stream shaped as SGLang 0.5.23 sends it (role chunk, 64 content chunks, the
finish reason, `sglext`, usage), and a native stream of 64 chunks; each read one event per read, and with four
events merged per read. Best of `--repeats` timings of `--streams` derivations each, on one core.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/derive_cost.py

It prints its figures and replaces its own section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_section  # noqa: E402
from bench.sync_server import chat_chunk, native_chunk, sse  # noqa: E402
from dfserve import sglang  # noqa: E402
from dfserve.loadtest.client import Finished, Sent, derive  # noqa: E402
from dfserve.sglang import server as engine  # noqa: E402

SECTION = "loadtest_derive_cost"
CHUNKS = 64
HEAD = engine.ResponseHead("5f1d2c0a9b8e4f7aa1b2c3d4e5f60718", 1764460000, "Qwen/Qwen3.6-27B")
WORDS = ["def", " add", "(a", ",", " b", "):\n", "    ", "return", " a", " +", " b", "\n"]


def sync_chat() -> list[bytes]:
    """bench/sync_server.py's chat stream, de-chunked."""
    usage = {"id": "chatcmpl-sync", "object": "chat.completion.chunk", "created": 0, "model": "sync", "choices": [],
             "usage": {"prompt_tokens": 8, "completion_tokens": CHUNKS, "total_tokens": 8 + CHUNKS}}
    events = [sse(chat_chunk(None)) for _ in range(CHUNKS - 1)]
    return [*events, sse(chat_chunk("stop")) + sse(usage) + sglang.SSE_DONE]


def sglang_chat() -> list[bytes]:
    """A chat stream as SGLang 0.5.23 sends it with spec details and usage asked for."""
    spec = sglang.SpecStats(verify_ct=20, num_correct_drafts=44, num_proposed_drafts=300, accept_rate=44 / 300,
                            correct_drafts_histogram=(4, 5, 6, 5))
    ends = engine.stream_end_chunks(HEAD, obj="chat.completion.chunk", prompt_tokens=12, completion_tokens=CHUNKS,
                                    spec=spec, include_usage=True)
    events = [engine.sse_event(engine.chat_chunk_body(HEAD, content="", first=True))]
    events += [engine.sse_event(engine.chat_chunk_body(HEAD, content=WORDS[n % len(WORDS)])) for n in range(CHUNKS)]
    final = engine.sse_event(engine.chat_chunk_body(HEAD, content=None, finish=sglang.FinishReason(kind="stop")))
    return [*events, final + b"".join(engine.sse_event(chunk) for chunk in ends) + sglang.SSE_DONE]


def native() -> list[bytes]:
    """bench/sync_server.py's native stream (cumulative text and counts in every event), de-chunked."""
    events = [sse(native_chunk(k + 1, None)) for k in range(CHUNKS - 1)]
    return [*events, sse(native_chunk(CHUNKS, {"type": "length", "length": CHUNKS})) + sglang.SSE_DONE]


def merged(pieces: list[bytes], per_read: int) -> list[bytes]:
    return [b"".join(pieces[at : at + per_read]) for at in range(0, len(pieces), per_read)]


def per_chunk_us(done: Finished, decode_all: bool, streams: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for _ in range(streams):
            derive(0.0, done, decode_all=decode_all)
        best = min(best, time.process_time() - started)
    return best / streams / CHUNKS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--streams", type=int, default=300, help="derivations per timing")
    parser.add_argument("--repeats", type=int, default=7, help="timings per case (the best is kept)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    streams: list[tuple[str, sglang.Api, list[bytes]]] = [("chat, bench/sync_server.py", "chat", sync_chat()),
                                                           ("chat, as SGLang sends it", "chat", sglang_chat()),
                                                           ("native, bench/sync_server.py", "native", native())]
    cases = [case for label, api, pieces in streams for case in (
        (f"{label}, one event a read", api, pieces), (f"{label}, 4 events a read", api, merged(pieces, 4)))]
    rows = []
    for label, api, pieces in cases:
        done = Finished(Sent("a", "t", 0, False, None, 0.0, 0.0, 1.0, api), 200,
                        [(0.01 * n, piece) for n, piece in enumerate(pieces)], None)
        cheap, whole = derive(0.0, done), derive(0.0, done, decode_all=True)
        assert cheap == whole and cheap.ok, label
        now = per_chunk_us(done, False, args.streams, args.repeats)
        before = per_chunk_us(done, True, args.streams, args.repeats)
        row = f"| {label} | {before:.2f} | {now:.2f} | {before / now:.1f}x |"
        print(row, flush=True)
        rows.append(row)
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python bench/derive_cost.py " + shlex.join(sys.argv[1:])
    body = "\n".join([
        "## Load tester: deriving a record, CPU per chunk",
        "",
        f"`{command.strip()}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
        f"{os.cpu_count()} cores shared with other work, pinned to one. CPU time (process_time) of `derive` per "
        f"chunk of a {CHUNKS}-chunk stream, best of {args.repeats} runs of {args.streams} derivations; the two "
        "ways give equal records (checked on each case).",
        "",
        "| stream | every event decoded whole (µs) | as the writer derives now (µs) | ratio |",
        "|---|---|---|---|",
        *rows,
        "",
        "Every event decoded whole is `derive(..., decode_all=True)`: `SSEDecoder` line by line and `json.loads` of "
        "every event, as records were derived before. Now SGLang's framing is split in one pass over the body and "
        "each chat content chunk that differs from one decoded chunk only in its content string is read as that "
        "string alone (`sglang.ChunkTemplate`); native events are still decoded whole (their text and counts change "
        "in every event).",
    ])
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
