"""Benchmark: are the judge's two designs calibrated, and how many requests does each spend to reach a verdict?

The fixed-n design judges a run of a set size on 95% paired-bootstrap intervals; the sequential design
(`--until-decided`) looks after every 16 pairs on always-valid intervals and stops at the first look that decides.
On the simulator the truth is known, so each verdict is right or wrong. Targets, for the acceptance rule of the
default gate (`accept_length` max_worse 2%): A/A false FAIL ≤ 5% with a look after every batch; a 3% regression
PASSed ≤ 5% and FAILed ≥ 90% (power); the sequential design at least 2x fewer requests at the median than the
fixed-n design at equal error rates when the candidate is clearly better or worse (10% on acceptance).

How: one real run over HTTP against the simulated engine (`zlab`, seed 0) gives each task's completion length and
spec_verify_ct. The simulator draws a request's rounds from a generator seeded by (engine seed, sampling key, prompt)
(`dfserve/deploy/sim/engine.py`, `Engine.submit`), so a prompt's rounds are a pure function of the engine's seed:
this script replays that draw in-process for any seed and profile, first checking that it reproduces the HTTP
run's spec_verify_ct on every task. Every comparison then takes fresh engine seeds and a fresh seeded task order,
and the records go through the real `judge` (fixed-n) and the real `SequentialMonitor` (sequential), fed pairs in
schedule order as the runner's prefix feeds them.

Two task sets:
- a population of synthetic coding tasks (HumanEval prompts with a variant line: to the simulator each is a distinct
  prompt with its own difficulty, length and rounds), large enough that a 3% change can be decided when the two
  engines' per-round luck is independent (the hardest case); the fixed-n size is the one that gives 90% power
  against 3% from a pilot's spread, the sequential maximum a multiple of it;
- HumanEval (164 tasks) at the load tester's default of 400 requests, where the task set is the limit.

At temperature 0 a repeated task repeats its output and rounds, on the simulator as on a real engine, so evidence on
acceptance grows with distinct tasks, not with requests.

    flock /tmp/dfserve-bench.lock .venv/bin/python bench/calibration.py --comparisons 100

It prints its figures and replaces its own section of bench/RESULTS.md. Rates carry a 95% Wilson interval for the
Monte-Carlo error of `--comparisons` runs, request counts a distribution-free interval of the median and p90.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from bench.results import write_section  # noqa: E402
from dfserve.deploy.sim.acceptance import RoundModel, prompt_difficulty  # noqa: E402
from dfserve.deploy.sim.profiles import DrafterProfile, load_profile  # noqa: E402
from dfserve.loadtest import cli as loadtest_cli  # noqa: E402
from dfserve.loadtest.config import SequentialDesign  # noqa: E402
from dfserve.loadtest.judge import DEFAULT_GATE, judge  # noqa: E402
from dfserve.loadtest.records import RequestRecord, read_records  # noqa: E402
from dfserve.loadtest.sequential import SequentialMonitor  # noqa: E402
from dfserve.tasks import Task, TaskSet, load_tasks  # noqa: E402
from dfserve.verdict import confseq, stats  # noqa: E402
from dfserve.verdict.gate import Gate  # noqa: E402
from tests.integration.servers import dfserve_argv, sim_server  # noqa: E402
from tests.synthetic import synthetic  # noqa: E402

SECTION = "loadtest_calibration"
Z_975, Z_90 = 1.959963984540054, 1.2815515655446004


def option_default(name: str) -> int:
    """The default of a `dfserve loadtest run` option, read from the command itself."""
    for param in loadtest_cli.run_command.params:
        if param.name == name:
            return int(param.default)  # type: ignore[arg-type]
    raise KeyError(name)


def population(size: int) -> list[dict[str, str]]:
    """`size` distinct prompts: HumanEval's, each pass over them with its own variant line."""
    humaneval = load_tasks("humaneval").tasks
    return [{"id": f"{t.id}#{k // len(humaneval)}", "prompt": f"{t.prompt}# variant {k // len(humaneval)}\n"}
            for k, t in ((k, humaneval[k % len(humaneval)]) for k in range(size))]


def http_run(tasks: str, count: int, max_new_tokens: int) -> dict[str, RequestRecord]:
    """Each task once on the simulator (zlab, seed 0), over HTTP."""
    with tempfile.TemporaryDirectory() as out, sim_server("zlab", 0.001, 0) as url:
        subprocess.run(dfserve_argv("loadtest", "run", "--arm", f"zlab={url}", "--tasks", tasks, "--num-requests",
                                    str(count), "--warmup", "0", "--concurrency", "64", "--max-new-tokens",
                                    str(max_new_tokens), "--out", out, "--name", "lengths", "--quiet"),
                       check=True, capture_output=True)
        records = list(read_records(Path(out) / "lengths" / "requests.jsonl"))
    if len(records) != count or not all(r.ok and r.spec_verify_ct is not None for r in records):
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


def expected_tau(profile: DrafterProfile, prompts: Sequence[Prompt]) -> float:
    """Σ tokens / Σ expected rounds over the task set (one request per task)."""
    rounds = 0.0
    for p in prompts:
        model = RoundModel.build(profile, prompt_difficulty(p.text))
        rounds += 1 + (p.length - 1) / model.expected_tokens
    return sum(p.length for p in prompts) / rounds


def scaled(profile: DrafterProfile, prompts: Sequence[Prompt], ratio: float) -> DrafterProfile:
    """The profile with conditional acceptances scaled by one factor, chosen by bisection to hit `ratio` x τ."""
    target = ratio * expected_tau(profile, prompts)
    low, high = 0.5, 1 / max(profile.conditional_accept)
    for _ in range(40):
        mid = (low + high) / 2
        trial = profile.model_copy(update={"conditional_accept": tuple(p * mid for p in profile.conditional_accept)})
        low, high = (mid, high) if expected_tau(trial, prompts) < target else (low, mid)
    factor = high if ratio < 1 else low
    return profile.model_copy(update={"name": f"{profile.name}{(ratio - 1) * 100:+.1f}%",
                                      "conditional_accept": tuple(p * factor for p in profile.conditional_accept)})


@dataclass(frozen=True)
class Truth:
    """A candidate whose expected acceptance is `ratio` x the baseline's; `shared_luck`: both engines draw each
    prompt's rounds from the same stream (same seed), as two drafters on one target share its easy stretches."""

    name: str
    ratio: float
    shared_luck: bool = False


@dataclass(frozen=True)
class TaskBench:
    """One task set, replayable in-process: its prompts under every profile the truths need."""

    task_set: TaskSet
    prompts: dict[str, Prompt]
    tau: dict[float, float]

    @classmethod
    def build(cls, task_set: TaskSet, measured: dict[str, RequestRecord], ratios: set[float]) -> TaskBench:
        zlab = load_profile("zlab")
        assert zlab is not None
        bare = [Prompt(t.as_text(), measured[t.id].completion_tokens or 0, {}) for t in task_set.tasks]
        profiles = {ratio: zlab if ratio == 1 else scaled(zlab, bare, ratio) for ratio in ratios}
        prompts = {t.id: Prompt(p.text, p.length, {str(ratio): RoundModel.build(profile, prompt_difficulty(p.text))
                                                   for ratio, profile in profiles.items()})
                   for t, p in zip(task_set.tasks, bare, strict=True)}
        wrong = [k for k, p in prompts.items() if engine_rounds(p, str(1.0), 0) != measured[k].spec_verify_ct]
        if wrong:
            raise SystemExit(f"calibration: the in-process replay disagrees with the simulator on {len(wrong)} tasks")
        return cls(task_set, prompts, {ratio: expected_tau(profile, bare) for ratio, profile in profiles.items()})

    def arm(self, name: str, order: Sequence[Task], ratio: float, seed: int) -> Arm:
        return Arm(self, name, order, str(ratio), seed)


class Arm:
    """One simulated engine's records for a schedule, made as far as a design reads them (most runs stop early)."""

    def __init__(self, bench: TaskBench, name: str, order: Sequence[Task], profile: str, seed: int) -> None:
        self.bench, self.name, self.order, self.profile, self.seed = bench, name, order, profile, seed
        self.rounds: dict[str, int] = {}
        self.made: list[RequestRecord] = []

    def upto(self, n: int) -> list[RequestRecord]:
        for i in range(len(self.made), min(n, len(self.order))):
            task = self.order[i]
            prompt = self.bench.prompts[task.id]
            if task.id not in self.rounds:
                self.rounds[task.id] = engine_rounds(prompt, self.profile, self.seed)
            self.made.append(RequestRecord(
                arm=self.name, index=i, task_id=task.id, dispatched_s=0.0, sent_s=0.0, end_s=None,
                completion_tokens=prompt.length, spec_verify_ct=self.rounds[task.id], acceptance="exact",
                finish_reason="length", output_sha256=task.id, simulated=True))
        return self.made[:n]


@dataclass
class Outcomes:
    verdicts: list[str]
    requests: list[int]


def compare(bench: TaskBench, truths: Sequence[Truth], fixed_n: int, max_n: int, comparisons: int,
            gate: Gate) -> dict[tuple[str, str], Outcomes]:
    """Each truth judged by both designs on the same simulated runs (fresh seeds and task order per comparison)."""
    design = SequentialDesign(gate=gate)
    results = {(t.name, d): Outcomes([], []) for t in truths for d in ("fixed", "sequential")}
    size = len(bench.task_set.tasks)
    for k in range(comparisons):
        order = bench.task_set.sequence(max(fixed_n, max_n), seed=10_000 + k)
        seed = 1 + 2 * k
        base = bench.arm("base", order, 1.0, seed)
        for truth in truths:
            cand = bench.arm("cand", order, truth.ratio, seed if truth.shared_luck else seed + 1)
            fixed = results[(truth.name, "fixed")]
            fixed.verdicts.append(judge(base.upto(fixed_n), cand.upto(fixed_n), gate, temperature=0.0).verdict)
            fixed.requests.append(fixed_n)
            monitor = SequentialMonitor(design, "base", "cand", 0.0, size)
            for start in range(0, max_n, design.look_every):
                end = min(max_n, start + design.look_every)
                for b, c in zip(base.upto(end)[start:], cand.upto(end)[start:], strict=True):
                    monitor.observe(b)
                    monitor.observe(c)
                if monitor.stopped:
                    break
            look = monitor.decision or monitor.look()
            sequential = results[(truth.name, "sequential")]
            sequential.verdicts.append(look.verdict)
            sequential.requests.append(look.pairs)
    return results


def rate(count: int, runs: int) -> str:
    interval = stats.wilson(count, runs)
    assert interval is not None
    return f"{interval.estimate:.1%} ({interval.low:.1%}–{interval.high:.1%})"


def requests_spread(requests: list[int]) -> str:
    if len(set(requests)) == 1:
        return f"{requests[0]} / {requests[0]}"
    parts = []
    for q in (0.5, 0.9):
        interval = stats.quantile_interval([float(r) for r in requests], q)
        assert interval is not None
        parts.append(f"{interval.estimate:.0f} ({interval.low:.0f}–{interval.high:.0f})")
    return " / ".join(parts)


def table_rows(label: str, truths: Sequence[Truth], results: dict[tuple[str, str], Outcomes],
               limits: dict[str, str]) -> list[str]:
    rows = []
    for truth in truths:
        for design in ("fixed", "sequential"):
            o = results[(truth.name, design)]
            runs = len(o.verdicts)
            median = float(np.median(o.requests))
            fixed_median = float(np.median(results[(truth.name, "fixed")].requests))
            saving = f"{fixed_median / median:.1f}x" if design == "sequential" else ""
            rows.append(f"| {label} | {truth.name} | {design} ({limits[design]}) | {runs} | "
                        f"{rate(o.verdicts.count('FAIL'), runs)} | {rate(o.verdicts.count('PASS'), runs)} | "
                        f"{rate(o.verdicts.count('INCONCLUSIVE'), runs)} | {requests_spread(o.requests)} | {saving} |")
    return rows


def pilot_fixed_n(bench: TaskBench, effect: float, limit: float) -> tuple[int, float]:
    """Tasks a fixed-n 95% interval needs for 90% power against `effect` (from one comparison's per-task spread),
    and that spread."""
    order = bench.task_set.sequence(len(bench.task_set.tasks), seed=9_999)
    base, cand = bench.arm("b", order, 1.0, 7).upto(len(order)), bench.arm("c", order, 1 - effect, 8).upto(len(order))
    sums = np.array([[b.completion_tokens, b.spec_verify_ct, c.completion_tokens, c.spec_verify_ct]
                     for b, c in zip(base, cand, strict=True)], dtype=float).T
    result = confseq.paired_log_ratio(sums)
    assert result is not None
    spread = result[1] * math.sqrt(len(order))
    margin = math.log(1 - limit) - math.log(1 - effect)
    return math.ceil(((Z_975 + Z_90) * spread / margin) ** 2 / 16) * 16, spread


def look_cost(pairs: Sequence[int]) -> list[str]:
    """Microseconds per look and per record for the default gate, on synthetic records with latencies."""
    rows = []
    for n in pairs:
        base, cand = synthetic("a", n, 9.0, seed=1, tasks=n), synthetic("b", n, 8.8, seed=2, tasks=n)
        monitor = SequentialMonitor(SequentialDesign(gate=DEFAULT_GATE), "a", "b", 0.0, n)
        started = time.perf_counter()
        for b, c in zip(base, cand, strict=True):
            monitor.observe(b)
            monitor.observe(c)
        per_record = (time.perf_counter() - started) / (2 * n)
        repeats = 50
        started = time.perf_counter()
        for _ in range(repeats):
            monitor.look()
        per_look = (time.perf_counter() - started) / repeats
        rows.append(f"| {n} | {per_look * 1e6:.0f} | {per_record * 1e6:.1f} |")
    return rows


def run(args: argparse.Namespace) -> str:
    started = time.perf_counter()
    rule = next(r for r in DEFAULT_GATE.rules if r.metric == "accept_length")
    assert rule.max_worse is not None
    gate = Gate(rules=(rule,), bootstrap_draws=DEFAULT_GATE.bootstrap_draws)
    truths = [Truth("A/A", 1.0), Truth(f"-{rule.max_worse:.0%} (at the limit)", 1 - rule.max_worse),
              Truth(f"-{args.effect:.0%}", 1 - args.effect), Truth(f"-{args.clear:.0%}", 1 - args.clear),
              Truth(f"+{args.clear:.0%}", 1 + args.clear)]
    ratios = {t.ratio for t in truths}
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / "population.jsonl"
        file.write_text("".join(json.dumps(task) + "\n" for task in population(args.population)))
        synthetic_set = load_tasks(str(file))
        pop = TaskBench.build(synthetic_set, http_run(str(file), args.population, args.max_new_tokens), ratios)
    humaneval = TaskBench.build(load_tasks("humaneval"), http_run("humaneval", 164, args.max_new_tokens), ratios)
    replayed = time.perf_counter()
    powered_n, spread = pilot_fixed_n(pop, args.effect, rule.max_worse)
    fixed_n = args.fixed_n or powered_n
    if fixed_n > args.population:
        raise SystemExit(f"--population: {args.population} tasks, and the fixed-n design needs {fixed_n} distinct ones")
    max_n = min(args.population, args.max_factor * fixed_n // 16 * 16)
    population_results = compare(pop, truths, fixed_n, max_n, args.comparisons, gate)
    default_n = option_default("num_requests")
    he_truths = [truths[0], truths[2], Truth(f"-{args.effect:.0%}, shared luck", 1 - args.effect, True), *truths[3:]]
    he_results = compare(humaneval, he_truths, default_n, default_n, args.comparisons, gate)
    elapsed = time.perf_counter() - replayed
    rows = [*table_rows(f"population of {args.population}", truths, population_results,
                        {"fixed": f"n = {fixed_n}", "sequential": f"max {max_n}"}),
            *table_rows("HumanEval (164)", he_truths, he_results,
                        {"fixed": f"n = {default_n}", "sequential": f"max {default_n}"})]
    for row in rows:
        print(row, flush=True)
    costs = look_cost(args.look_cost)
    for row in costs:
        print(row, flush=True)
    command = "flock /tmp/dfserve-bench.lock .venv/bin/python bench/calibration.py " + " ".join(sys.argv[1:])
    taus = ", ".join(f"{ratio:.2f}: {tau:.3f}" for ratio, tau in sorted(pop.tau.items()))
    return "\n".join([
        "## Load tester: gate calibration, fixed-n and sequential (`--until-decided`) designs",
        "",
        f"`{command.strip()}` — {time.strftime('%Y-%m-%d', time.gmtime())}, {platform.machine()}, 2 cores shared "
        f"with other work; {elapsed:.0f} s after the HTTP runs ({replayed - started:.0f} s). Rule: `accept_length` "
        f"max_worse {rule.max_worse} (the default gate). Fixed-n: 95% paired bootstrap over tasks "
        f"({gate.bootstrap_draws} draws), judged once at n. Sequential: {SequentialDesign(gate=gate).alpha} "
        f"two-sided confidence sequences, a look every {SequentialDesign(gate=gate).look_every} pairs from "
        f"{SequentialDesign(gate=gate).min_tasks} tasks, stop at the first look that decides; requests to a "
        "decision are the pairs at that look (requests in flight then also finish in a real run). Max-new-tokens "
        f"{args.max_new_tokens}; completion lengths and seed-0 rounds from HTTP runs, which the in-process replay "
        f"reproduced on every task. Population: {args.population} synthetic tasks, expected τ by candidate/baseline "
        f"ratio {taus}; per-task spread of the log change {spread:.3f} with independent luck, so a fixed-n 95% "
        f"interval needs n = {powered_n} distinct tasks for 90% power against -{args.effect:.0%} (fixed-n run at "
        f"{fixed_n}; the sequential maximum is {args.max_factor}x that). Every comparison: fresh engine seeds and task order; independent "
        "per-round luck unless marked shared.",
        "",
        "| task set | candidate vs baseline (acceptance) | design | runs | FAIL | PASS | INCONCLUSIVE | requests per "
        "arm to a decision, median / p90 | median saving |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Right answers: PASS for A/A, the limit and +10%; FAIL for -3% and -10%. So FAIL on A/A or at the limit is a "
        "false FAIL (at the limit is its worst case), PASS at -3% a false PASS, FAIL at -3% the power. Rates in "
        "brackets: 95% Wilson intervals for the Monte-Carlo error of the runs; request counts: distribution-free 95% "
        "intervals of the median and p90. On HumanEval at 400 requests a 3% change is out of reach of either design "
        "when the engines' luck is independent: the sequential design stops as soon as all 164 tasks are seen and "
        "says the task set is the limit (about "
        f"{math.ceil(((Z_975 + Z_90) * spread / (math.log(1 - rule.max_worse) - math.log(1 - args.effect))) ** 2)}"
        " distinct tasks are needed at fixed n), instead of repeating tasks that add nothing.",
        "",
        "Cost of a look on the runner's event loop (default gate: acceptance, TPOT p95, error rate, losslessness; "
        "synthetic records with 256 chunks each; a look runs every 16 pairs, every record is an O(1) append "
        "otherwise):",
        "",
        "| pairs so far | µs per look | µs per record, looks included |",
        "|---|---|---|",
        *costs,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--comparisons", type=int, default=200, help="simulated runs per truth and task set")
    parser.add_argument("--population", type=int, default=8000, help="synthetic tasks in the large task set")
    parser.add_argument("--fixed-n", type=int, default=None, help="fixed-n size (default: 90%% power at --effect)")
    parser.add_argument("--max-factor", type=int, default=3, help="sequential maximum = this x the fixed-n size")
    parser.add_argument("--max-new-tokens", type=int, default=option_default("max_new_tokens"))
    parser.add_argument("--effect", type=float, default=0.03, help="the regression to be caught (power)")
    parser.add_argument("--clear", type=float, default=0.10, help="a clearly better or worse candidate")
    parser.add_argument("--look-cost", type=int, nargs="+", default=[400, 2000, 8000], help="pairs at which to time a look")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    body = run(args)
    print(json.dumps({"section": SECTION}), flush=True)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
