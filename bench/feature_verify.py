"""Benchmark: what checking a feature cache's content costs a run, beside what scoring its tasks costs.

`dfserve eval run` hashes every task file of the cache it reads (sha256, once per run, before the run folder is
made) and reads each header. This measures that check (`dfserve.eval.features.verify`) on a cache written by the
real writer, per MB and per task, against scoring one task's anchors with the scaled-down drafter of
bench/eval_speed.py (batched, one thread). The files were just written, so they are read from the page cache: a
cold cache adds the disk's read time, which the scoring's own reads of the same files pay too.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/feature_verify.py
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.eval_speed import TAPS, drafter  # noqa: E402
from bench.results import write_section  # noqa: E402
from dfserve.eval import features as feat  # noqa: E402
from dfserve.eval.records import Health  # noqa: E402
from dfserve.eval.scoring import TargetHead, score_anchors  # noqa: E402


def build_cache(folder: Path, tasks: int, tokens: int, hidden: int) -> tuple[feat.FeatureBuild, float]:
    """A cache of `tasks` files written by the real writer; returns its build and its size in MB."""
    key = feat.FeatureKey(target_sha256="0" * 64, target="bench", references_key="r", references_sha256="s",
                          taps=TAPS, dtype="float32", versions={"torch": torch.__version__})
    generator = torch.Generator().manual_seed(0)
    with feat.write_features(folder) as writer:
        for index in range(tasks):
            writer.task(index, {tap: torch.randn(tokens, hidden, generator=generator) for tap in TAPS})
        build = feat.FeatureBuild(key=key, tasks=tuple(f"t{i}" for i in range(tasks)), built_at="", built_by="bench",
                                  build_s=0.0, health=Health(agree=1, positions=1, fraction=1.0, warning=None),
                                  files=writer.files)
        writer.finish(build)
    return build, sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e6


def scoring_s(hidden: int, prompt: int, generated: int, per_forward: int) -> float:
    """Seconds to score every anchor of one task (prompt + generated tokens), as `dfserve eval run` does."""
    model = drafter(hidden, 16)
    generator = torch.Generator().manual_seed(1)
    head = TargetHead(torch.randn(4096, hidden, generator=generator) * 0.02,
                      torch.randn(4096, hidden, generator=generator) * 0.02)
    tokens = torch.randint(0, 4095, (prompt + generated,), generator=generator)
    context = torch.randn(prompt + generated, len(TAPS) * hidden, generator=generator)
    anchors = torch.arange(prompt, prompt + generated - 1)
    started = time.perf_counter()
    score_anchors(model, head, context, tokens, anchors, top_k=4, anchors_per_forward=per_forward)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the taps (the 27B's is 5120)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--generated", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens = args.prompt + args.generated
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "features"
        build, megabytes = build_cache(folder, args.tasks, tokens, args.hidden)
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            feat.verify(folder, build)
            times.append(time.perf_counter() - started)
    verify_s = statistics.median(times)
    score_s = scoring_s(args.hidden, args.prompt, args.generated, 32)
    per_task_s, per_mb_ms = verify_s / args.tasks, verify_s / megabytes * 1e3
    full_task_mb = len(TAPS) * 5120 * 4 * 4096 / 1e6
    print(f"verify: {verify_s * 1e3:.1f} ms for {args.tasks} tasks, {megabytes:.1f} MB: {per_mb_ms:.2f} ms/MB, "
          f"{per_task_s * 1e3:.2f} ms/task; scoring one task: {score_s:.2f} s ({per_task_s / score_s:.2%})")
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python " + shlex.join(["bench/feature_verify.py", *sys.argv[1:]])
    body = "\n".join([
        "## Offline evaluation: checking the feature cache's content (`bench/feature_verify.py`)",
        "",
        f"`{command}` — {datetime.now(UTC):%Y-%m-%d}, {platform.machine()}, {os.cpu_count()} cores shared with other "
        f"work (measured under load), torch {torch.__version__}, one thread. A cache of {args.tasks} tasks written by "
        f"`dfserve eval`'s writer, {tokens} tokens each, {len(TAPS)} taps of hidden {args.hidden} in float32 "
        f"({megabytes / args.tasks:.1f} MB a task), verified as a run opens it (sha256 of every file, then its "
        f"header), median of {args.repeats}, from the page cache; beside it, scoring the {args.generated - 1} "
        f"anchors of one such task with bench/eval_speed.py's drafter (hidden {args.hidden}, batched, 32 anchors a "
        "forward).",
        "",
        "| verify per MB | verify per task | scoring per task | verify / scoring |",
        "|---|---|---|---|",
        f"| {per_mb_ms:.2f} ms | {per_task_s * 1e3:.1f} ms | {score_s:.2f} s | {per_task_s / score_s:.2%} |",
        "",
        f"Reading. The check reads each file once more than scoring does and hashes it at about "
        f"{1e3 / per_mb_ms:.0f} MB/s. For the 27B (five taps of hidden 5120, float32) a 4096-token task holds "
        f"{full_task_mb:.0f} MB: about {full_task_mb * per_mb_ms / 1e3:.2f} s to verify at this rate. Scored on CPU, "
        "as here, that is a fraction of a percent of the scoring; on a GPU host scoring is far faster while the "
        "check stays at one core's hashing speed, so there it may be of the order of the scoring itself. It is "
        "paid once per run, not once per drafter, and is the price of never scoring features that are no longer "
        "what the target computed.",
    ])
    if not args.no_write:
        write_section("feature_verify", body)


if __name__ == "__main__":
    main()
