"""Benchmark: is the judge's acceptance rule calibrated? False-FAIL rate on A/A and power on a 3% regression.

The gate must not FAIL a candidate that is as good as the baseline (target: at most 5% of A/A comparisons) and must
FAIL one whose acceptance is 3% lower when the rule allows 2% (target: at least 90%), at the request count
`dfserve loadtest run` uses by default.

How: one real run over HTTP against the simulated engine (`zlab`, seed 0, HumanEval, the default max-new-tokens)
gives each task's completion length and spec_verify_ct. The simulator draws a request's rounds from a generator
seeded by (engine seed, sampling key, prompt) (`dfserve/deploy/sim/engine.py`, `Engine.submit`), so a prompt's rounds are a
pure function of the engine's seed: this script replays that draw in-process for any seed, first checking that it
reproduces the HTTP run's spec_verify_ct for every task exactly. Each comparison then uses fresh engine seeds and a
fresh seeded task order:
- A/A: two `zlab` engines with different seeds (independent round noise, nothing else differs);
- A/B: the `zlab` profile against the same profile with every conditional acceptance scaled so that its expected
  acceptance length is 3.0% lower, both engines started with the same seed (as `dfserve sim --seed` would), and
  again with different seeds.
At temperature 0 a repeated task repeats its rounds exactly (on the simulator as on a real engine), so the evidence
grows with distinct tasks, not with requests; the bootstrap resamples tasks for that reason.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/calibration.py --comparisons 100

It prints its figures and replaces its own section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_section  # noqa: E402
from dfserve.deploy.sim.acceptance import RoundModel, prompt_difficulty  # noqa: E402
from dfserve.deploy.sim.profiles import DrafterProfile, load_profile  # noqa: E402
from dfserve.loadtest import cli as loadtest_cli  # noqa: E402
from dfserve.loadtest.judge import DEFAULT_GATE, Gate, judge  # noqa: E402
from dfserve.loadtest.records import RequestRecord, read_records  # noqa: E402
from dfserve.loadtest.tasks import Task, load_tasks  # noqa: E402
from tests.integration.servers import dfserve_argv, sim_server  # noqa: E402

SECTION = "loadtest_calibration"


def option_default(name: str) -> int:
    """The default of a `dfserve loadtest run` option, read from the command itself."""
    for param in loadtest_cli.run_command.params:
        if param.name == name:
            return int(param.default)  # type: ignore[arg-type]
    raise KeyError(name)


def http_run(max_new_tokens: int) -> dict[str, RequestRecord]:
    """Each HumanEval task once on the simulator (zlab, seed 0), over HTTP."""
    with tempfile.TemporaryDirectory() as out, sim_server("zlab", 0.001, 0) as url:
        subprocess.run(dfserve_argv("loadtest", "run", "--arm", f"zlab={url}", "--num-requests", "164", "--warmup",
                                    "0", "--concurrency", "32", "--max-new-tokens", str(max_new_tokens), "--out",
                                    out, "--name", "lengths", "--quiet"), check=True, capture_output=True)
        records = list(read_records(Path(out) / "lengths" / "requests.jsonl"))
    if not all(r.ok and r.spec_verify_ct is not None for r in records):
        raise SystemExit("calibration: the HTTP run had errors")
    return {r.task_id: r for r in records}


@dataclass(frozen=True)
class Prompt:
    text: str
    length: int
    models: dict[str, RoundModel]


def engine_rounds(prompt: Prompt, profile: str, seed: int) -> int:
    """Verify rounds the simulator runs for this prompt at temperature 0 (empty sampling key) with engine `seed`."""
    digest = hashlib.blake2b(f"{seed}\x1f\x1f{prompt.text}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    model = prompt.models[profile]
    remaining, rounds = prompt.length - 1, 0
    while remaining > 0:
        remaining -= model.sample_accepted(rng) + 1
        rounds += 1
    return rounds


def expected_tau(profile: DrafterProfile, prompts: dict[str, Prompt]) -> float:
    """Σ tokens / Σ expected rounds over the task set (one request per task)."""
    rounds = 0.0
    for p in prompts.values():
        model = RoundModel.build(profile, prompt_difficulty(p.text))
        rounds += 1 + (p.length - 1) / model.expected_tokens
    return sum(p.length for p in prompts.values()) / rounds


def scaled(profile: DrafterProfile, prompts: dict[str, Prompt], ratio: float) -> DrafterProfile:
    """The profile with conditional acceptances scaled by one factor, chosen by bisection to hit `ratio` x τ."""
    target = ratio * expected_tau(profile, prompts)
    low, high = 0.5, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        trial = profile.model_copy(update={"conditional_accept": tuple(p * mid for p in profile.conditional_accept)})
        low, high = (mid, high) if expected_tau(trial, prompts) < target else (low, mid)
    return profile.model_copy(update={"name": f"{profile.name}-{(1 - ratio) * 100:.1f}%",
                                      "conditional_accept": tuple(p * high for p in profile.conditional_accept)})


def arm_records(arm: str, order: list[Task], prompts: dict[str, Prompt], profile: str, seed: int) -> list[RequestRecord]:
    rounds = {task_id: engine_rounds(p, profile, seed) for task_id, p in prompts.items()}
    return [RequestRecord(arm=arm, index=i, task_id=t.id, dispatched_s=0.0, sent_s=0.0, end_s=1.0,
                          completion_tokens=prompts[t.id].length, spec_verify_ct=rounds[t.id], acceptance="exact",
                          finish_reason="length", output_sha256=t.id, simulated=True)
            for i, t in enumerate(order)]


def run(args: argparse.Namespace) -> str:
    task_set = load_tasks("humaneval")
    measured = http_run(args.max_new_tokens)
    zlab = load_profile("zlab")
    assert zlab is not None
    bare = {t.id: Prompt(t.as_text(), measured[t.id].completion_tokens or 0, {}) for t in task_set.tasks}
    worse = scaled(zlab, bare, 1 - args.effect)
    prompts = {k: Prompt(p.text, p.length, {"zlab": RoundModel.build(zlab, prompt_difficulty(p.text)),
                                            "worse": RoundModel.build(worse, prompt_difficulty(p.text))})
               for k, p in bare.items()}
    mismatched = [k for k, p in prompts.items() if engine_rounds(p, "zlab", 0) != measured[k].spec_verify_ct]
    if mismatched:
        raise SystemExit(f"calibration: the in-process replay disagrees with the simulator on {len(mismatched)} tasks")
    tau_b, tau_w = expected_tau(zlab, bare), expected_tau(worse, bare)
    rule = next(r for r in DEFAULT_GATE.rules if r.metric == "accept_length")
    gate = Gate(rules=(rule,), bootstrap_draws=DEFAULT_GATE.bootstrap_draws)
    rows = []
    started = time.perf_counter()
    for n in args.requests:
        outcomes: dict[str, list[str]] = {"A/A": [], "A/B same seed": [], "A/B other seed": []}
        widths: dict[str, list[float]] = {k: [] for k in outcomes}
        for k in range(args.comparisons):
            order = task_set.sequence(n, seed=10_000 + k)
            seed = 1 + 2 * k
            base = arm_records("base", order, prompts, "zlab", seed)
            for kind, profile, cand_seed in (("A/A", "zlab", seed + 1), ("A/B same seed", "worse", seed),
                                             ("A/B other seed", "worse", seed + 1)):
                result = judge(base, arm_records("cand", order, prompts, profile, cand_seed), gate, temperature=0.0)
                outcomes[kind].append(result.verdict)
                accept = next(m for m in result.metrics if m.metric == "accept_length")
                widths[kind].append(((accept.change_high or 0) - (accept.change_low or 0)) / 2)
        last_widths = widths["A/B other seed"]
        for kind, verdicts in outcomes.items():
            row = (f"| {n} | {kind} | {len(verdicts)} | {verdicts.count('FAIL') / len(verdicts):.1%} | "
                   f"{verdicts.count('PASS') / len(verdicts):.1%} | {verdicts.count('INCONCLUSIVE') / len(verdicts):.1%} | "
                   f"±{np.mean(widths[kind]) * 100:.2f}% |")
            print(row, flush=True)
            rows.append(row)
    elapsed = time.perf_counter() - started
    assert rule.max_worse is not None
    needed_hw = (args.effect - rule.max_worse) / (1 + 1.2816 / 1.96)  # one-sided 90% power at a 95% two-sided bound
    needed_tasks = int(len(prompts) * (np.mean(last_widths) / needed_hw) ** 2 + 0.5)
    default_n = option_default("num_requests")
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python bench/calibration.py " + " ".join(sys.argv[1:])
    return "\n".join([
        "## Load tester: gate calibration (false FAIL on A/A, power on a 3% acceptance regression)",
        "",
        f"`{command.strip()}` — {time.strftime('%Y-%m-%d', time.gmtime())}, {platform.machine()}, 2 cores shared "
        f"with other work; {elapsed:.0f} s after the HTTP run. Rule: `accept_length` max_worse {rule.max_worse} (the "
        f"default gate), 95% paired bootstrap over tasks ({gate.bootstrap_draws} draws). HumanEval (164 tasks), "
        f"max-new-tokens {args.max_new_tokens}, completion lengths from the HTTP run (mean "
        f"{np.mean([p.length for p in bare.values()]):.0f} tokens); the in-process replay reproduced the simulator's "
        f"spec_verify_ct on all 164 tasks. Baseline `zlab` expected τ {tau_b:.3f}; candidate scaled to τ "
        f"{tau_w:.3f} ({(tau_w / tau_b - 1) * 100:+.2f}%). `dfserve loadtest run` defaults to --num-requests "
        f"{default_n}. Targets: A/A FAIL ≤ 5%, A/B FAIL (power) ≥ 90%.",
        "",
        "| requests per arm | comparison | runs | FAIL | PASS | INCONCLUSIVE | mean CI half-width |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "FAIL on an A/A row is a false FAIL; FAIL on an A/B row is the power. Same seed: both engines draw each "
        "prompt's rounds from the same random stream, so a prompt's luck is shared, as two drafters on the same "
        "target output share its easy and hard stretches. Other seed: the two arms' per-round luck is independent, "
        "the hardest case; then the interval is set by the number of distinct tasks (repeats at temperature 0 add "
        f"nothing), and 90% power against a {args.effect:.0%} regression with a {rule.max_worse:.0%} limit needs a "
        f"half-width near {needed_hw * 100:.2f}%, about {needed_tasks} distinct tasks (a JSONL task set) instead of "
        "HumanEval's 164. Only the acceptance rule is calibrated here: latency rules need latency, which this "
        "replay does not model.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--comparisons", type=int, default=100, help="A/A and A/B comparisons per request count")
    parser.add_argument("--requests", type=int, nargs="+", default=[option_default("num_requests")])
    parser.add_argument("--max-new-tokens", type=int, default=option_default("max_new_tokens"))
    parser.add_argument("--effect", type=float, default=0.03, help="relative acceptance regression of the A/B arm")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    body = run(args)
    print(json.dumps({"section": SECTION}), flush=True)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
