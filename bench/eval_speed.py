"""Benchmark: what `dfserve eval` costs on CPU, measured side by side in one run.

1. Anchors scored per second by one drafter: many anchors per forward (shared context keys and values, one mask per
   layer kind; `--anchors-per-forward 32`, the default) against z-lab's own `DFlashDraftModel.forward` once per
   anchor (`--anchors-per-forward 1`). Same drafter, features and anchors; the drafts are checked equal.
   Target: batched at least 10x the per-anchor loop.
2. Peak memory of the teacher-forced target forward: capturing only the drafter's tap layers (forward hooks, what
   the feature cache stores) against asking transformers for every layer's hidden states. Each runs in a fresh
   process; the peak resident set is reset after the model is built and read after the forward.

Random weights in a scaled-down Qwen3.6 layout (sizes below); the figures scale with the context length.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/eval_speed.py
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import write_section  # noqa: E402

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


def anchors_per_second(args: argparse.Namespace, prompt: int) -> dict[str, float]:
    from dfserve.eval.scoring import TargetHead, score_anchors

    model = drafter(args.hidden, args.block)
    generator = torch.Generator().manual_seed(1)
    length = prompt + args.generated
    head = TargetHead(torch.randn(4096, args.hidden, generator=generator) * 0.02,
                      torch.randn(4096, args.hidden, generator=generator) * 0.02)
    tokens = torch.randint(0, 4095, (length,), generator=generator)
    features = torch.randn(length, len(TAPS) * args.hidden, generator=generator)
    anchors = torch.arange(prompt, length - 1)[:args.anchors]
    timings = {}
    drafts = {}
    for label, per_forward in (("batched", args.per_forward), ("per anchor", 1)):
        score_anchors(model, head, features, tokens, anchors[:2], top_k=8, anchors_per_forward=per_forward)  # warm-up
        started = time.perf_counter()
        scores = score_anchors(model, head, features, tokens, anchors, top_k=8, anchors_per_forward=per_forward)
        timings[label] = anchors.shape[0] / (time.perf_counter() - started)
        drafts[label] = scores.drafts
    assert (drafts["batched"] == drafts["per anchor"]).all(), "batched drafts differ from per-anchor drafts"
    return timings


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
    parser.add_argument("--prompt", type=int, nargs="+", default=[512, 1536],
                        help="context tokens before the first anchor (one measurement each)")
    parser.add_argument("--generated", type=int, default=512, help="reference tokens (anchors lie among them)")
    parser.add_argument("--anchors", type=int, default=128, help="anchors scored by each path")
    parser.add_argument("--per-forward", type=int, default=32, help="anchors per batched forward")
    parser.add_argument("--target-hidden", type=int, default=512, help="target hidden size (the 27B's is 5120)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the teacher-forced forward")
    parser.add_argument("--child", choices=["taps", "all"], help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    if args.child:
        peak_child(args.child, args.target_hidden, args.tokens)
        return
    torch.set_num_threads(2)
    rates = {prompt: anchors_per_second(args, prompt) for prompt in args.prompt}
    memory = peak_memory(args)
    for prompt, rate in rates.items():
        print(f"context {prompt}: batched {rate['batched']:.1f}, per anchor {rate['per anchor']:.1f} anchors/s, "
              f"{rate['batched'] / rate['per anchor']:.1f}x (target >= 10x)")
    for mode, figures in memory.items():
        print(f"{mode:12s} peak +{figures['peak_mib']:.0f} MiB, kept {figures['kept_mib']:.0f} MiB")
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python " + shlex.join(["bench/eval_speed.py", *sys.argv[1:]])
    per_token = 65 * 5120 * 4 / 2**20
    body = "\n".join([
        "## Offline evaluation: anchors scored per second, and memory of capturing the taps",
        "",
        f"`{command}` — {datetime.now(UTC):%Y-%m-%d}, {platform.machine()}, 2 cores shared with other work, torch "
        f"{torch.__version__}, 2 threads, float32, random weights. Drafter in z-lab's Qwen3.6 layout scaled down: hidden "
        f"{args.hidden}, 5 layers (4 causal sliding-window, 1 bidirectional), {len(TAPS)} taps, blocks of {args.block}; "
        f"{args.anchors} anchors after a context of each length below, scored by z-lab's `DFlashDraftModel.forward` once per "
        f"anchor and by `dfserve eval`'s batched forward ({args.per_forward} anchors each); the drafts are equal. "
        "Target: batched at least 10x. The per-anchor loop projects the whole context (the drafter's largest matrix) "
        "for every anchor, the batched path once per task; both pay the same block work, and the batched blocks also "
        "attend past each other's (masked) keys. Target "
        + ("met." if min(r["batched"] / r["per anchor"] for r in rates.values()) >= 10 else "**not met** in this run."),
        "",
        "| context tokens | batched anchors/s | per-anchor anchors/s | batched / per anchor |",
        "|---|---|---|---|",
        *(f"| {prompt} | {r['batched']:.1f} | {r['per anchor']:.1f} | **{r['batched'] / r['per anchor']:.1f}x** |"
          for prompt, r in rates.items()),
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
