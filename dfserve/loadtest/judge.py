"""The load test as a source of pairs for the verdict core: which record fields feed which metric, how two arms'
records pair up, and whether two runs may be compared at all.

Requests are paired by schedule index (the same task at the same place in the run for both arms). Warm-up
requests and those the tester cancelled when it was stopped are no pairs: a cancelled request was not answered
badly, it was not waited for.

    verdict = judge(baseline_records, candidate_records, load_gate(None), temperature=0.0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dfserve.baselines import one_drafter
from dfserve.errors import UserError
from dfserve.loadtest import records as rec
from dfserve.loadtest.config import RunConfig, shared_servers
from dfserve.loadtest.records import RequestRecord
from dfserve.sglang import parse_server_info
from dfserve.verdict.fixed import FixedN
from dfserve.verdict.gate import Gate, Rule, check_rules, read_gate
from dfserve.verdict.pairs import MetricSpec, Pairs
from dfserve.verdict.results import Judgement
from dfserve.verdict.wording import differences

Metric = MetricSpec[RequestRecord]


def _quantiles(name: str, label: str, **how: Any) -> dict[str, Metric]:
    return {f"{name}_p{p}": MetricSpec(f"{label} p{p}", "quantile", q=p / 100, unit="s", **how) for p in (50, 95, 99)}


LOSSLESS = "lossless_fraction"
METRICS: dict[str, Metric] = {
    "accept_length": MetricSpec("acceptance length (Σ tokens / Σ verify rounds)", "ratio", True,
                                numerator=lambda r: r.completion_tokens, denominator=rec.verify_rounds,
                                fixed_by_task=True),
    "output_tokens_per_s": MetricSpec("output tokens/s per stream (Σ tokens / Σ E2E)", "ratio", True,
                                      numerator=lambda r: r.completion_tokens, denominator=rec.e2e_s),
    **_quantiles("ttft", "TTFT", value=rec.ttft_s),
    **_quantiles("tpot", "TPOT", value=rec.tpot_s),
    **_quantiles("itl_per_token", "ITL per token", samples=rec.itl_per_token_s),
    **_quantiles("itl_per_chunk", "ITL per chunk", samples=rec.itl_per_chunk_s),
    **_quantiles("e2e", "E2E", value=rec.e2e_s),
    "error_rate": MetricSpec("error rate", "error_rate"),
    LOSSLESS: MetricSpec("identical outputs (temperature 0)", "identical", output=lambda r: r.output_sha256,
                         fixed_by_task=True),
}

TIMED = frozenset(name for name in METRICS
                  if name.startswith(("tpot_", "itl_", "e2e_")) or name == "output_tokens_per_s")
"""The metrics read from a request's chunk times or end, which a slow client holds up (`RequestRecord.client_bound`);
TTFT is not: its first chunk comes before any wait."""

DEFAULT_GATE = Gate(rules=(
    Rule(metric="accept_length", max_worse=0.02),
    Rule(metric="tpot_p95", max_worse=0.05),
    Rule(metric="error_rate", max_worse=0.01),
    Rule(metric=LOSSLESS, at_least=0.99),
))


def load_gate(path: Path | None) -> Gate:
    """The gate in a YAML file (`rules: [{metric, max_worse | at_least}]`) on the load test's metrics, or the
    defaults."""
    gate = read_gate(path, DEFAULT_GATE)
    check_rules(gate, METRICS, path)
    return gate


def judged(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The records that can pair: measured (not warm-up) and not cancelled by the tester's stop."""
    return [r for r in rec.measured_records(records) if not r.cancelled]


def greedy_pair(temperature: float) -> Callable[[RequestRecord, RequestRecord], bool]:
    """Whether a pair's outputs must agree: both requests greedy, at their own temperature (a replayed capture's)
    or the run's. In a run whose loosest temperature is 0 every pair is greedy, whatever a record says."""
    def greedy(base: RequestRecord, cand: RequestRecord) -> bool:
        return temperature == 0 or all(r.temperature == 0 for r in (base, cand))
    return greedy


def pairs_of(baseline: Sequence[RequestRecord], candidate: Sequence[RequestRecord],
             temperature: float) -> Pairs[RequestRecord]:
    """Both arms' records paired by schedule index; refused when no index has both. `temperature`: the run's (the
    loosest replayed, for a capture); losslessness is judged on the pairs that are greedy."""
    arms = (baseline[0].arm if baseline else "baseline", candidate[0].arm if candidate else "candidate")
    pairs = Pairs.match(arms, ((r.index, r.task_id, r) for r in judged(baseline)),
                        ((r.index, r.task_id, r) for r in judged(candidate)), deterministic=temperature == 0,
                        greedy=greedy_pair(temperature))
    if not len(pairs):
        raise UserError("no request index appears in both arms: nothing to compare")
    rec.check_same_request(zip(pairs.base, pairs.cand, strict=True))
    return pairs


def judge(baseline: Sequence[RequestRecord], candidate: Sequence[RequestRecord], gate: Gate,
          temperature: float) -> Judgement:
    """Every metric with its paired interval, every gate rule's status, and the verdict (the fixed-n design)."""
    return FixedN().judge(pairs_of(baseline, candidate, temperature), METRICS, gate).judgement


def comparability(baseline: RunConfig, base_arm: str, candidate: RunConfig, cand_arm: str) -> list[str]:
    """What differs between the two sides beyond the drafter under test, one short line each; empty when they
    are comparable."""
    problems: list[str] = []
    infos = [baseline.arm(base_arm), candidate.arm(cand_arm)]
    if baseline.run_id != candidate.run_id:
        a, b = baseline.shape(), candidate.shape()
        problems.extend(line for key in a for line in differences(key, a[key], b[key]))
    elif not baseline.pin_arms and shared_servers([(i.name, i.url) for i in infos]):
        problems.append(f"arms {base_arm} and {cand_arm} are one server ({infos[0].url}) and were not pinned "
                        "(pin_arms): they got the same traffic, and the run compared it with itself")
    servers = [parse_server_info(i.server_info) if i.server_info is not None else None for i in infos]
    if servers[0] and servers[1]:
        for field in ("model_path", "max_running_requests"):
            problems.extend(differences(f"server {field}", getattr(servers[0], field), getattr(servers[1], field)))
        problems.extend(one_drafter(servers[0].draft_model_path or "none", servers[1].draft_model_path or "none"))
    problems.extend(f"arm {i.name}: its /server_info was not recorded, so its target and drafter are unknown (a "
                    "gateway answers it for one arm only: pin_arms)" for i in infos if i.server_info is None)
    paths = [(i.model_info or {}).get("model_path") for i in infos]
    if all(isinstance(path, str) for path in paths):
        problems.extend(differences("model_info model_path", paths[0], paths[1]))
    if infos[0].simulated != infos[1].simulated:
        problems.append(f"simulated: {infos[0].simulated} vs {infos[1].simulated} (one arm is a real engine)")
    return problems
