"""Benchmark: what a shadow record costs made alone after other work, against made in a batch.

The gateway's observers run on threads beside its event loop. Between two finished exchanges the loop's work (the
relay, the sockets, other streams' parsing) evicts an observer's code and data from the CPU's caches, so a record
made alone pays for cold caches that the next records of a batch find warm: the reason an observer's thread,
woken by an exchange, waits for more before it observes (`dfserve.gateway.observers.BATCH_WAIT_S`). This builds
`--exchanges` recorded native exchanges of `--tokens` tokens (SGLang's events through a recording relay, as the
gateway holds them), then reports CPU per record (`shadow_record` and its JSON line) made back to back, and made in
batches of 1 to 32 each after `--churn-mib` of unrelated memory traffic and JSON decoding.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/record_batches.py

It prints its figures and replaces its own section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.recorded_stream_memory import native_events, recording_relay
from bench.results import write_section
from dfserve import _relay
from dfserve.gateway.observers import Exchanged
from dfserve.metrics import Outcome
from dfserve.shadow.records import shadow_record

SECTION = "record_batches"
BATCHES = (1, 2, 4, 8, 16, 32)


def exchanges(count: int, tokens: int) -> list[Exchanged]:
    """`count` recorded native exchanges of `tokens` tokens, 1 to 4 an event, each its own bytes."""
    made = []
    for n in range(count):
        events = native_events(tokens, 1 + n % 4)
        relay = recording_relay(_relay)
        for i, event in enumerate(events):
            relay.received(100.0 + 0.01 * i, bytes(bytearray(event)), i == len(events) - 1)
        relay.ended()
        outcome = Outcome(arm="a", route="native", replica="r", status=200, error=None, ttft_s=0.02, e2e_s=2.0,
                          output_tokens=relay.tokens, verify_rounds=len(events) - 1, measure="exact")
        body = json.dumps({"text": f"prompt {n}", "sampling_params": {"temperature": 0}}).encode()
        made.append(Exchanged(n, n % 2 == 1, "POST", "/generate", b"", body, 100.0, outcome, answer=relay.tail,
                              streamed=True, pieces=relay.pieces))
    return made


def record(exchanged: Exchanged) -> None:
    shadow_record(exchanged, 100.0).model_dump_json()


def churner(mib: int) -> Callable[[], None]:
    """Work that evicts the caches, as the event loop's between two exchanges: memory traffic and JSON decoding."""
    memory = bytearray(mib << 20)
    documents = [json.dumps({f"k{i}": list(range(50)), "text": "x" * 200}) for i in range(300)]

    def churn() -> None:
        for at in range(0, len(memory), 64):
            memory[at] = (memory[at] + 1) & 255
        for document in documents:
            json.loads(document)

    return churn


def back_to_back_us(made: list[Exchanged], rounds: int) -> float:
    for exchanged in made:
        record(exchanged)
    start = time.thread_time()
    for _ in range(rounds):
        for exchanged in made:
            record(exchanged)
    return (time.thread_time() - start) / (rounds * len(made)) * 1e6


def batched_us(made: list[Exchanged], size: int, churn: Callable[[], None], rounds: int) -> float:
    """CPU per record, `size` records made together after each churn."""
    spent, count = 0.0, 0
    for _ in range(rounds):
        for first in range(0, len(made) - size + 1, size):
            churn()
            start = time.thread_time()
            for exchanged in made[first : first + size]:
                record(exchanged)
            spent += time.thread_time() - start
            count += size
    return spent / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exchanges", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--churn-mib", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    made = exchanges(args.exchanges, args.tokens)
    churn = churner(args.churn_mib)
    warm = back_to_back_us(made, args.rounds)
    print(f"back to back: {warm:.0f} us per record", flush=True)
    lines = ["| records made together after other work | CPU per record (µs) | against back to back |", "|---|---|---|"]
    for size in BATCHES:
        cost = batched_us(made, size, churn, args.rounds)
        lines.append(f"| {size} | {cost:.0f} | {cost / warm:.1f}x |")
        print(lines[-1], flush=True)
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python bench/record_batches.py" + "".join(
        f" --{name.replace('_', '-')} {value}" for name, value in vars(args).items()
        if value != parser.get_default(name))
    write_section(SECTION, "\n".join([
        "## Gateway: a shadow record alone against in a batch (`bench/record_batches.py`)",
        "",
        f"`{command}` on {datetime.date.today()} ({platform.machine()}, Python {platform.python_version()}). "
        f"{args.exchanges} recorded native exchanges of {args.tokens} tokens (1 to 4 an event), each made into its "
        "record and JSON line; CPU time of this thread. Back to back, the records cost "
        f"{warm:.0f} µs each. Batches: before each, {args.churn_mib} MiB of memory traffic and 300 JSON decodes, "
        f"as an event loop's work between two exchanges; {args.rounds} rounds.",
        "",
        *lines,
        "",
        "So an observer's thread waits for more exchanges before it observes (`BATCH_WAIT_S`): the first record of "
        "a batch pays for the caches the others find warm.",
    ]))


if __name__ == "__main__":
    main()
