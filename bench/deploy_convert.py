"""Benchmark: what deploying an in-house checkpoint costs the first time and every time after.

Builds a synthetic trainer checkpoint (the drafter's state dict under `model` with `module.` prefixes, beside Adam
moments and the step, so the file is about 3x the weights like a real one), then times `resolve_drafter` on it:
the first call hashes, verifies and converts; the second finds the converted folder by the cached content hash and
must not read the checkpoint again. Also times a cold content hash, the cost a new file always pays once.
Target: the second deploy of the same checkpoint converts nothing and costs well under a second.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/deploy_convert.py
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import write_section  # noqa: E402
from dfserve.deploy.assets import expected_tensors, target_from_config, verify_drafter_config  # noqa: E402
from dfserve.deploy.drafters import resolve_drafter  # noqa: E402
from dfserve.deploy.hashes import file_sha256  # noqa: E402
from dfserve.deploy.profiles import load_profile  # noqa: E402


def configs(hidden: int) -> tuple[dict, dict]:  # type: ignore[type-arg]
    profile = load_profile("pro6000")
    target = {"model_type": "qwen3_5", "text_config": {**profile.target.config["text_config"], "hidden_size": hidden}}
    drafter = {**profile.zlab.config, "hidden_size": hidden, "intermediate_size": 3 * hidden,
               "num_attention_heads": hidden // 128, "num_key_value_heads": max(1, hidden // 256)}
    return target, drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024, help="drafter hidden size (z-lab's is 5120)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    profile = load_profile("pro6000")
    target_config, drafter_config = configs(args.hidden)
    target = target_from_config("synthetic-target", target_config, "bench", profile.target_families)
    arch = verify_drafter_config(drafter_config, target)
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=generator) for name, shape in expected_tensors(arch).items()}
    params = sum(t.numel() for t in state.values())
    moments = {i: {"exp_avg": t.clone(), "exp_avg_sq": t.clone()} for i, t in enumerate(state.values())}
    with tempfile.TemporaryDirectory(prefix="dfserve-bench-convert-") as tmp:
        work = Path(tmp)
        checkpoint = work / "checkpoint.pt"
        torch.save({"model": {f"module.{k}": v for k, v in state.items()}, "optimizer": {"state": moments}, "step": 4000}, checkpoint)
        size_gb = checkpoint.stat().st_size / 1e9
        config_file = work / "drafter-config.json"
        config_file.write_text(json.dumps(drafter_config))
        store = work / "drafters"
        t0 = time.perf_counter()
        cold_hash = file_sha256(checkpoint)
        t_hash = time.perf_counter() - t0
        t0 = time.perf_counter()
        first = resolve_drafter(str(checkpoint), profile, target, store, config_file)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        second = resolve_drafter(str(checkpoint), profile, target, store, config_file)
        t_second = time.perf_counter() - t0
        assert first.converted and not second.converted and first.sha256 == cold_hash == second.sha256
        out_gb = sum(p.stat().st_size for p in Path(first.model_path).iterdir()) / 1e9
    rows = [
        ("cold SHA-256 of the checkpoint", t_hash, f"{size_gb / t_hash:.2f} GB/s"),
        ("first deploy: hash + load + verify (NaN/Inf) + bf16 write", t_first, f"{size_gb / t_first:.2f} GB/s of checkpoint"),
        ("second deploy of the same checkpoint", t_second, "converted nothing"),
    ]
    for what, seconds, note in rows:
        print(f"{what:60s} {seconds:8.4f} s  {note}")
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python " + shlex.join(["bench/deploy_convert.py", *sys.argv[1:]])
    body = "\n".join([
        "## Deploy: converting an in-house checkpoint, first time and again",
        "",
        f"`{command}` — {datetime.now(UTC):%Y-%m-%d}, {platform.machine()}, 2 cores shared with other work, "
        f"torch {torch.__version__}. Synthetic drafter: hidden {args.hidden}, {arch.num_hidden_layers} layers, "
        f"{params / 1e6:.0f} M parameters in fp32 with `module.` prefixes under `model`, beside Adam moments and the "
        f"step: a {size_gb:.2f} GB checkpoint.pt, converted to a {out_gb:.2f} GB bf16 folder. "
        "(z-lab's Qwen3.6-27B drafter is about 1.7 B parameters; its checkpoints are about 15 GB, so scale the first two "
        "rows by the size.) Target: the second deploy converts nothing and costs well under a second.",
        "",
        "| step | seconds | rate |",
        "|---|---|---|",
        *(f"| {what} | {seconds:.4f} | {note} |" for what, seconds, note in rows),
    ])
    if not args.no_write:
        write_section("deploy_convert", body)


if __name__ == "__main__":
    main()
