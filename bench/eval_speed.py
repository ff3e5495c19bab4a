"""Benchmark: what `dfserve eval` costs on CPU, measured side by side in one run.

1. Anchors scored per second by one drafter: many anchors per forward (shared context keys and values, one mask per
   layer kind; `--anchors-per-forward 32`, the default) against z-lab's own `DFlashDraftModel.forward` once per
   anchor (`--anchors-per-forward 1`). Same drafter, features, anchors and thread count; the two paths alternate,
   repetition after repetition, and each repetition's ratio comes from its own pair, so a burst of other work on
   the machine lands in one pair instead of one side. Medians are reported; the drafts are checked equal.
   Target: batched at least 10x the per-anchor loop. Beside it, the ceiling: the per-anchor time over the batched
   time of anchors with next to no context, the block work (drafter layers over 16 rows, the target's head) both
   paths must pay whatever the context.
2. The batched scoring at one thread and at one per core, as the machine is and with a spinning process keeping one
   core busy: why the thread count is fixed (`--threads`, as `dfserve eval run --threads`).
3. Peak memory of the teacher-forced target forward: capturing only the drafter's tap layers (forward hooks, what
   the feature cache stores) against asking transformers for every layer's hidden states. Each runs in a fresh
   process; the peak resident set is reset after the model is built and read after the forward.

Random weights in a scaled-down Qwen3.6 layout (sizes below); the figures scale with the context length.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/eval_speed.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import write_section  # noqa: E402
from dfserve.eval.scoring import TargetHead, score_anchors, torch_threads  # noqa: E402

TAPS = (1, 6, 11, 16, 21)
"""Five taps spread over 24 target layers, as z-lab's drafter spreads its five over the 27B's 64."""


def drafter(hidden: int, block: int) -> torch.nn.Module:
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=4096, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=5,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
        max_position_embeddings=8192, layer_types=["sliding_attention"] * 4 + ["full_attention"],
        sliding_window=2048, use_sliding_window=True, block_size=block, num_target_layers=24,
        dflash_config={"mask_token_id": 4095, "target_layer_ids": list(TAPS)},
    )
    return DFlashDraftModel(config).eval()


@dataclass(frozen=True)
class Speed:
    """Anchors per second at one context length: medians over repetitions, and each repetition's own ratio."""

    batched: float
    per_anchor: float
    ratios: list[float]
    block_only: float
    """Batched anchors per second with next to no context: the block work alone."""

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def ceiling(self) -> float:
        return self.block_only / self.per_anchor


class Scorer:
    """One drafter, target head and sequence; times `score_anchors` over the anchors after `prompt` tokens."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.model = drafter(args.hidden, args.block)
        generator = torch.Generator().manual_seed(1)
        length = max(args.prompt) + args.generated
        self.head = TargetHead(torch.randn(4096, args.hidden, generator=generator) * 0.02,
                               torch.randn(4096, args.hidden, generator=generator) * 0.02)
        self.tokens = torch.randint(0, 4095, (length,), generator=generator)
        self.features = torch.randn(length, len(TAPS) * args.hidden, generator=generator)
        self.count = args.anchors

    def anchors(self, prompt: int) -> torch.Tensor:
        return torch.arange(prompt, prompt + self.count)

    def rate(self, prompt: int, per_forward: int) -> tuple[float, Any]:
        anchors = self.anchors(prompt)
        started = time.perf_counter()
        scores = score_anchors(self.model, self.head, self.features, self.tokens, anchors, top_k=8,
                               anchors_per_forward=per_forward)
        return anchors.shape[0] / (time.perf_counter() - started), scores.drafts

    def warm(self, prompt: int, per_forward: int) -> None:
        anchors = self.anchors(prompt)[:per_forward]
        score_anchors(self.model, self.head, self.features, self.tokens, anchors, top_k=8,
                      anchors_per_forward=per_forward)


def speed(scorer: Scorer, args: argparse.Namespace, prompt: int) -> Speed:
    scorer.warm(prompt, args.per_forward)
    scorer.warm(prompt, 1)
    batched, per_anchor, ratios = [], [], []
    for _ in range(args.repeats):
        fast, fast_drafts = scorer.rate(prompt, args.per_forward)
        slow, slow_drafts = scorer.rate(prompt, 1)
        assert (fast_drafts == slow_drafts).all(), "batched drafts differ from per-anchor drafts"
        batched.append(fast)
        per_anchor.append(slow)
        ratios.append(fast / slow)
    block_only = statistics.median(scorer.rate(1, args.per_forward)[0] for _ in range(args.repeats))
    return Speed(statistics.median(batched), statistics.median(per_anchor), ratios, block_only)


def by_threads(scorer: Scorer, args: argparse.Namespace) -> dict[int, tuple[float, float]]:
    """Batched anchors per second at the first context per thread count: (as the machine is, with a spinning process
    keeping one core busy); medians, the thread counts alternating."""
    prompt, counts = args.prompt[0], sorted({1, os.cpu_count() or 1})
    rates: dict[tuple[int, bool], list[float]] = {(n, busy): [] for n in counts for busy in (False, True)}
    for busy in (False, True):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            for _ in range(args.repeats):
                for threads in counts:
                    with torch_threads(threads):
                        scorer.warm(prompt, args.per_forward)
                        rates[threads, busy].append(scorer.rate(prompt, args.per_forward)[0])
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    return {n: (statistics.median(rates[n, False]), statistics.median(rates[n, True])) for n in counts}


def target_config(hidden: int) -> dict[str, int]:
    return {"vocab_size": 4096, "hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": 24,
            "num_attention_heads": hidden // 64, "num_key_value_heads": max(1, hidden // 256), "head_dim": 64,
            "max_position_embeddings": 16384}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_child(mode: str, hidden: int, tokens: int) -> None:
    """In a fresh process: build the target, reset the peak, run one teacher-forced forward, print the peak rise."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dfserve.eval.target import teacher_forced

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**target_config(hidden))).eval()
    ids = torch.randint(0, 4096, (tokens,)).tolist()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = _rss_kib("VmRSS")
    with torch.inference_mode():
        if mode == "taps":
            captured, _ = teacher_forced(model, ids, tokens // 2, TAPS)
            kept = sum(t.numel() * t.element_size() for t in captured.values())
        else:
            hidden_states = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            kept = sum(t.numel() * t.element_size() for t in hidden_states)
    print(json.dumps({"peak_mib": (_rss_kib("VmHWM") - before) / 1024, "kept_mib": kept / 2**20}))


def peak_memory(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    results = {}
    for mode in ("taps", "every layer"):
        out = subprocess.run([sys.executable, __file__, "--child", "taps" if mode == "taps" else "all",
                              "--target-hidden", str(args.target_hidden), "--tokens", str(args.tokens)],
                             check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512, help="drafter hidden size (z-lab's is 5120)")
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--prompt", type=int, nargs="+", default=[512, 1536, 4096],
                        help="context tokens before the first anchor (one measurement each)")
    parser.add_argument("--generated", type=int, default=512, help="reference tokens (anchors lie among them)")
    parser.add_argument("--anchors", type=int, default=64, help="anchors scored by each path")
    parser.add_argument("--per-forward", type=int, default=32, help="anchors per batched forward")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repetitions of both paths (medians)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, the same for both paths")
    parser.add_argument("--target-hidden", type=int, default=512, help="target hidden size (the 27B's is 5120)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the teacher-forced forward")
    parser.add_argument("--child", choices=["taps", "all"], help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    if args.child:
        peak_child(args.child, args.target_hidden, args.tokens)
        return
    if args.anchors >= args.generated:
        parser.error("--anchors must be fewer than --generated")
    torch.set_num_threads(args.threads)
    scorer = Scorer(args)
    speeds = {prompt: speed(scorer, args, prompt) for prompt in args.prompt}
    threads = by_threads(scorer, args)
    memory = peak_memory(args)
    for prompt, sp in speeds.items():
        print(f"context {prompt}: batched {sp.batched:.1f}, per anchor {sp.per_anchor:.1f} anchors/s, {sp.ratio:.1f}x "
              f"(pairs {', '.join(f'{r:.1f}' for r in sp.ratios)}; ceiling {sp.ceiling:.1f}x; target >= 10x)")
    for count, (quiet, busy) in threads.items():
        print(f"{count} thread(s): batched {quiet:.1f} anchors/s, {busy:.1f} with one core busy (context {args.prompt[0]})")
    for mode, figures in memory.items():
        print(f"{mode:12s} peak +{figures['peak_mib']:.0f} MiB, kept {figures['kept_mib']:.0f} MiB")
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python " + shlex.join(["bench/eval_speed.py", *sys.argv[1:]])
    per_token = 65 * 5120 * 4 / 2**20
    met = [prompt for prompt, sp in speeds.items() if sp.ratio >= 10]
    block_only = statistics.median(sp.block_only for sp in speeds.values())
    body = "\n".join([
        "## Offline evaluation: anchors scored per second, and memory of capturing the taps",
        "",
        f"`{command}` — {datetime.now(UTC):%Y-%m-%d}, {platform.machine()}, {os.cpu_count()} cores shared with other "
        f"work, torch {torch.__version__}, {args.threads} thread(s) for both paths, float32, random weights. Drafter in "
        f"z-lab's Qwen3.6 layout scaled down: hidden {args.hidden}, 5 layers (4 causal sliding-window 2048, 1 "
        f"bidirectional), {len(TAPS)} taps, blocks of {args.block}, vocabulary 4096; {args.anchors} anchors after a "
        "context of each length below, scored by z-lab's `DFlashDraftModel.forward` once per anchor and by `dfserve "
        f"eval`'s batched forward ({args.per_forward} anchors each), alternating, {args.repeats} repetitions; medians, "
        "and the ratio is the median of each repetition's own pair. The drafts are equal. Target: batched at least "
        "10x; met at context " + (", ".join(str(p) for p in met) if met else "none") + ".",
        "",
        "| context tokens | batched anchors/s | per-anchor anchors/s | batched / per anchor (pairs) | ceiling |",
        "|---|---|---|---|---|",
        *(f"| {prompt} | {sp.batched:.1f} | {sp.per_anchor:.1f} | **{sp.ratio:.1f}x** "
          f"({', '.join(f'{r:.1f}' for r in sp.ratios)}) | {sp.ceiling:.1f}x |" for prompt, sp in speeds.items()),
        "",
        f"Reading. Per anchor, z-lab's forward projects the whole context through `fc` (the drafter's largest matrix) "
        "and through every layer's key and value projections, so its cost grows with the context; the batched path "
        "projects the context once per task and its keys and values once per forward, and is left with the block "
        "work both paths pay alike: 5 layers over 16 rows and the target's head over 15 (here "
        f"{block_only:.0f} anchors/s with next to no context), plus attention over the context. The ceiling column "
        "is the per-anchor time over that block work: no batching can beat it, so 10x needs a context long enough "
        "for the per-anchor loop to spend nine tenths of its time on context. By multiply-adds the full-size drafter "
        "(5 layers of the 27B's width, hidden 5120 and MLP 17408, its 248k-token head) breaks even at about the same "
        "place: per anchor about 93 GFLOP of block work against 0.37 GFLOP per context token (`fc` over 5 x 5120 "
        "features, keys and values of 5 layers), so 10x needs about 2,400 context tokens: not at short prompts, "
        "yes at the thousands of tokens of thinking traces.",
        "",
        f"Batched anchors per second at context {args.prompt[0]} by torch thread count, as the machine was and with a "
        f"spinning process keeping one core busy (medians of {args.repeats}):",
        "",
        "| threads | as the machine was | one core busy |",
        "|---|---|---|",
        *(f"| {count} | {quiet:.1f} | {busy:.1f} |" for count, (quiet, busy) in threads.items()),
        "",
        "One thread per core (torch's default) waits at every parallel step for any thread that lost its core, so "
        "its pace follows whatever else runs; one thread keeps its own. Earlier runs of this benchmark, two threads "
        "and one timed pass per path, read from 0.7x to 8.7x from one run to the next, and a batched path slower at 512 context "
        "than at 1536: other work landing on one side of a single pass. Both paths now run at one fixed count, "
        "alternating; `dfserve eval run --threads N` sets the count for a run and records it in its config.json.",
        "",
        f"Teacher-forced forward of a 24-layer Qwen3 target (hidden {args.target_hidden}) over {args.tokens} tokens, each "
        "in a fresh process; the peak resident set is reset after the model is built, so the rise is the forward's "
        "own. `kept` is what the forward hands back.",
        "",
        "| capture | peak rise (MiB) | kept (MiB) |",
        "|---|---|---|",
        *(f"| {mode} | {m['peak_mib']:.0f} | {m['kept_mib']:.0f} |" for mode, m in memory.items()),
        "",
        f"For the 27B target (64 layers, hidden 5120, float32) every hidden state costs {per_token:.2f} MiB per token "
        f"(65 states), the five taps {5 * 5120 * 4 / 2**20:.2f} MiB: {per_token * 4096 / 1024:.1f} GiB against "
        f"{5 * 5120 * 4 * 4096 / 2**30:.2f} GiB for a 4096-token task.",
    ])
    if not args.no_write:
        write_section("eval_speed", body)


if __name__ == "__main__":
    main()
