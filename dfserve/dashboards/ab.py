"""The "dfserve A/B" dashboard: every arm side by side, as measured by the gateway or the load tester.

Every query is scoped to one source (`$job`: the gateway and the load tester export the same families, so
summing across them would count a request twice), the selected arms (`$arm`) and generation routes (the gateway
also relays `/v1/models` and `/server_info` to an arm: not its traffic). Rate panels follow live sources (the
gateway, a running load tester); the last row reads whole-run totals, which is what a load test pushed to a
Pushgateway at its end offers, of one pushed run (`$run`, the latest by default: the Pushgateway keeps every run's
group). The ratio row compares `$candidate` to `$baseline` directly.
"""

from __future__ import annotations

from collections.abc import Callable

from dfserve import metrics as m

from .engine import NameStyle, sglang_name
from .grafana import RATE_INTERVAL, Dashboard, Panel, Row, Target, Variable
from .promql import (
    ERROR_STATUS,
    GENERATION,
    QUANTILES,
    arm_acceptance,
    counter,
    error_ratio,
    histogram_mean,
    increase_sum,
    quantile,
    quantile_total,
    rate_sum,
    ratio,
    selector,
    total,
)

W = RATE_INTERVAL
D = m.DEPLOYMENT_LABEL
DEPLOYMENTS = (f'{D}=~"$deployment"',)
SCOPE = ('job=~"$job"', 'arm=~"$arm"')
"""Of the families labelled by arm only (weights, shadow outcomes, the engines' counters as the gateway reads them)."""
ROUTED = (*SCOPE, GENERATION)
"""Of the per-request families, labelled by route too."""
TOTALS = (*ROUTED, 'run_id=~"$run"')
"""Of the whole-run row: one pushed load test's group (a live source has none; the variable is then empty, and
`run_id=~""` matches series without the label)."""


def _one_arm(variable: str) -> tuple[str, ...]:
    return ('job=~"$job"', f'arm="${variable}"', GENERATION)


def _quantile_targets(histogram: str) -> tuple[Target, ...]:
    return tuple(Target(quantile(q, histogram, W, ["arm"], ROUTED), f"{{{{arm}}}} p{round(q * 100)}")
                 for q in QUANTILES)


def _candidate_over_baseline(expr_for: Callable[[tuple[str, ...]], str]) -> str:
    """`expr_for(matchers)` for the candidate arm divided by the same for the baseline arm."""
    return ratio(expr_for(_one_arm("candidate")), expr_for(_one_arm("baseline")))


def _traffic(names: NameStyle) -> Row:
    return Row("Traffic", (
        Panel("Request rate", "Finished requests per second, per arm.",
              (Target(rate_sum(counter(m.REQUESTS), W, ["arm"], ROUTED), "{{arm}}"),), unit="reqps", width=6),
        Panel("Error ratio", "Share of finished requests without a complete 2xx answer: HTTP errors, client "
              "give-ups (499) and answers that broke off.",
              (Target(error_ratio(W, ["arm"], ROUTED), "{{arm}}"),),
              unit="percentunit", no_value="0", width=6),
        Panel("Output tokens per second", "Completion tokens streamed back to clients, per arm.",
              (Target(rate_sum(counter(m.OUTPUT_TOKENS), W, ["arm"], ROUTED), "{{arm}}"),), width=6),
        Panel("Requests in flight", "Requests sent to an arm and not yet finished.",
              (Target(f"sum by (arm) ({selector(m.REQUESTS_IN_FLIGHT, ROUTED)})", "{{arm}}"),), width=6),
        Panel("Engine queue", "Requests running in and queued before each selected engine deployment (SGLang's "
              "gauges), next to the in-flight count of the arm it serves.", (
                  Target(f"sum by ({D}) ({selector(sglang_name(m.SGLANG_NUM_RUNNING_REQS, names), DEPLOYMENTS)})",
                         f"{{{{{D}}}}} running"),
                  Target(f"sum by ({D}) ({selector(sglang_name(m.SGLANG_NUM_QUEUE_REQS, names), DEPLOYMENTS)})",
                         f"{{{{{D}}}}} queued"))),
        Panel("Arm weight", "Configured share of live traffic per arm (gateway).",
              (Target(f"max by (arm) ({selector(m.ARM_WEIGHT, SCOPE)})", "{{arm}}"),)),
        Panel("Shadow requests", "Mirrored requests per second by outcome; a shadow answer never reaches a client.",
              (Target(rate_sum(counter(m.SHADOW_REQUESTS), W, ["arm", "outcome"], SCOPE), "{{arm}} {{outcome}}"),),
              unit="reqps", no_value="0"),
    ))


def _latency() -> Row:
    return Row("Latency", (
        Panel("Time to first token", "p50/p95/p99 per arm, from request sent to first content chunk.",
              _quantile_targets(m.TTFT), unit="s", width=12),
        Panel("End-to-end latency", "p50/p95/p99 per arm, from request sent to the last byte.",
              _quantile_targets(m.E2E), unit="s", width=12),
        Panel("Inter-token latency (per token)",
              "Gap between chunks divided over the tokens each chunk carried: one sample per token.",
              _quantile_targets(m.ITL_PER_TOKEN), unit="s", width=12),
        Panel("Inter-chunk latency (per chunk)",
              "Gap between successive chunks, one sample per chunk; with speculative decoding a chunk carries "
              "a whole verify round.", _quantile_targets(m.ITL_PER_CHUNK), unit="s", width=12),
    ))


def _acceptance() -> Row:
    exact = (*ROUTED, 'measure="exact"')
    estimated = (*ROUTED, 'measure="estimated"')
    return Row("Acceptance", (
        Panel("Acceptance length (pooled, exact)",
              "Σ completion tokens / Σ verify rounds over the window, both of the requests whose meta_info "
              "reported verify rounds: tokens per target forward pass, bonus token included.",
              (Target(arm_acceptance(W, ["arm"], ROUTED), "{{arm}}"),)),
        Panel("Acceptance length (mean per request)",
              "Mean of per-request acceptance lengths: exact from meta_info, estimated from chunk counts where "
              "meta_info is not visible.",
              (Target(histogram_mean(m.ACCEPT_LENGTH, W, ["arm"], exact), "{{arm}} exact"),
               Target(histogram_mean(m.ACCEPT_LENGTH, W, ["arm"], estimated), "{{arm}} estimated"))),
        Panel("Acceptance length (engine counters)",
              "Δ sglang:generation_tokens / Δ sglang:spec_verify_calls over each arm's replicas, as the gateway "
              "reads them.",
              (Target(f"max by (arm) ({selector(m.ARM_WINDOWED_ACCEPT_LENGTH, SCOPE)})", "{{arm}}"),)),
        Panel("Acceptance length distribution ($arm)", "Requests per second finishing with each exact acceptance "
              "length (per bucket; a rate, so that windows overlapping from one step to the next count no request "
              "twice).",
              (Target(rate_sum(f"{m.ACCEPT_LENGTH}_bucket", W, ["le"], (*_one_arm("arm"), 'measure="exact"')),
                      "{{le}}", heatmap=True),),
              kind="heatmap", width=12, repeat="arm"),
    ))


def _comparison() -> Row:
    def quantile_ratio(q: float, histogram: str) -> str:
        return _candidate_over_baseline(lambda arm: quantile(q, histogram, W, [], arm))

    return Row("Candidate / baseline", (
        Panel("Acceptance length ratio", "Pooled exact acceptance length of $candidate over $baseline; above 1 the "
              "candidate drafts better.",
              (Target(_candidate_over_baseline(
                  lambda arm: arm_acceptance(W, [], arm)), "acceptance"),),
              kind="stat", width=6),
        Panel("TTFT ratio", "Time to first token of $candidate over $baseline (p50 and p99).",
              (Target(quantile_ratio(0.5, m.TTFT), "p50"), Target(quantile_ratio(0.99, m.TTFT), "p99")), kind="stat", width=6),
        Panel("Inter-token latency ratio", "Per-token ITL of $candidate over $baseline (p50 and p99).",
              (Target(quantile_ratio(0.5, m.ITL_PER_TOKEN), "p50"),
               Target(quantile_ratio(0.99, m.ITL_PER_TOKEN), "p99")), kind="stat", width=6),
        Panel("Output tokens/s ratio", "Output token rate of $candidate over $baseline; read with the arm weights.",
              (Target(_candidate_over_baseline(lambda arm: rate_sum(counter(m.OUTPUT_TOKENS), W, [], arm)),
                      "tokens/s"),), kind="stat", width=6),
    ))


def _replicas() -> Row:
    job = ('job=~"$job"',)
    replica = (*job, 'arm=~"$arm"')
    return Row("Replicas", (
        Panel("Replica admitted", "1 while the gateway sends traffic to a replica, 0 while it is ejected.",
              (Target(f"max by (arm, replica) ({selector(m.REPLICA_HEALTHY, replica)})", "{{arm}} {{replica}}"),)),
        Panel("Ejections", "Replicas ejected as unhealthy in the window.",
              (Target(increase_sum(counter(m.EJECTIONS), W, ["arm", "replica"], replica), "{{arm}} {{replica}}"),),
              no_value="0"),
        Panel("Upstream errors and retries", "Upstream failures by kind, and requests retried on another replica.",
              (Target(rate_sum(counter(m.UPSTREAM_ERRORS), W, ["arm", "kind"], replica), "{{arm}} {{kind}}"),
               Target(rate_sum(counter(m.RETRIES), W, ["arm"], replica), "{{arm}} retries")),
              unit="reqps", no_value="0"),
        Panel("Gateway routing versions", "Gateway replicas running each version of the routing (a hash of mode, "
              "arms and weights): one line once every replica has applied the config file; refused files below.",
              (Target(f"count by (version) ({selector(m.ROUTING_VERSION, job)})", "{{version}}"),
               Target(increase_sum(counter(m.ROUTING_RELOADS), W, ["outcome"], job), "reloads {{outcome}}")),
              no_value="0"),
    ))


def _gateway() -> Row:
    job = ('job=~"$job"',)
    return Row("Gateway", (
        Panel("Answered by the gateway", "Requests the gateway answered itself before an arm took them, per second "
              "by status: 4xx (unreadable, too large, too slow, not allowed) or 500 (failed inside the gateway).",
              (Target(rate_sum(counter(m.REQUESTS_ANSWERED_BY_GATEWAY), W, ["status"], job), "{{status}}"),),
              unit="reqps", no_value="0", width=6),
        Panel("Connections refused", "Client connections the gateway closed on its own, per second: over "
              "max_connections (503), or a request head or body not sent in time (408).",
              (Target(rate_sum(counter(m.CLIENT_CONNECTIONS_REFUSED), W, ["reason"], job), "{{reason}}"),),
              unit="reqps", no_value="0", width=6),
        Panel("Observers' missed exchanges", "Finished exchanges an observer (metrics, capture, shadow records) "
              "missed in the window: it raised, or fell behind and its queue was full. Clients never wait for them.",
              (Target(increase_sum(counter(m.OBSERVER_FAILURES), W, ["observer", "reason"], job),
                      "{{observer}} {{reason}}"),), no_value="0", width=6),
        Panel("Shadow live decision", "With shadow.until_decided: 1 on the decision's state (deciding; pass or "
              "fail: mirroring has stopped; abandoned), and the mirrored pairs judged (in the first record folder).",
              (Target(f"max by (state) ({selector(m.SHADOW_DECISION, job)})", "{{state}}"),
               Target(f"max({selector(m.SHADOW_DECISION_PAIRS, job)})", "pairs judged")), width=6),
    ))


def _totals() -> Row:
    return Row("Whole run ($run for a pushed load test; since start for live sources)", (
        Panel("Requests", "Finished requests per arm: all of them, and those without a complete 2xx answer by "
              "status (4xx, 5xx, 499: the client gave up, error: no complete answer).", (
            Target(total(counter(m.REQUESTS), ["arm"], TOTALS), "{{arm}}"),
            Target(total(counter(m.REQUESTS), ["arm", "status"], (*TOTALS, ERROR_STATUS)), "{{arm}} {{status}}"),
        ), kind="stat", width=6, no_value="0"),
        Panel("Acceptance length (whole run)",
              "Σ completion tokens / Σ verify rounds of the requests that reported verify rounds, over the run, "
              "and the mean per request (exact from meta_info, estimated from chunk counts).", (
                  Target(ratio(total(counter(m.SPEC_OUTPUT_TOKENS), ["arm"], TOTALS),
                               total(counter(m.SPEC_VERIFY_ROUNDS), ["arm"], TOTALS)), "{{arm}} pooled"),
                  Target(ratio(total(f"{m.ACCEPT_LENGTH}_sum", ["arm", "measure"], TOTALS),
                               total(f"{m.ACCEPT_LENGTH}_count", ["arm", "measure"], TOTALS)),
                         "{{arm}} mean per request ({{measure}})"),
              ), kind="stat", width=6),
        Panel("Time to first token (whole run)", "p50 and p99 over every request of the run.", tuple(
            Target(quantile_total(q, m.TTFT, ["arm"], TOTALS), f"{{{{arm}}}} p{round(q * 100)}") for q in (0.5, 0.99)
        ), kind="stat", unit="s", width=6),
        Panel("End-to-end latency (whole run)", "p50 and p99 over every request of the run.", tuple(
            Target(quantile_total(q, m.E2E, ["arm"], TOTALS), f"{{{{arm}}}} p{round(q * 100)}") for q in (0.5, 0.99)
        ), kind="stat", unit="s", width=6),
    ))


def build(baseline: str = "baseline", candidate: str = "candidate", names: NameStyle = "colon") -> Dashboard:
    """The A/B dashboard; `baseline` and `candidate` are the arm names the ratio row starts on, `names` the style
    of SGLang's metric names in the Prometheus queried."""
    requests = counter(m.REQUESTS)
    return Dashboard(
        uid="dfserve-ab",
        title="dfserve A/B",
        description="Drafter arms side by side: traffic, latency, acceptance, candidate/baseline ratios, replicas, "
                    "the gateway's own answers and observers.",
        variables=(
            Variable("datasource", "Data source"),
            Variable("job", "Source", requests, "job", multi=False),
            Variable("arm", "Arm", f'{requests}{{job=~"$job"}}', "arm"),
            Variable("baseline", "Baseline", f'{requests}{{job=~"$job"}}', "arm", multi=False, default=baseline),
            Variable("candidate", "Candidate", f'{requests}{{job=~"$job"}}', "arm", multi=False, default=candidate),
            Variable("deployment", "Engine deployment", sglang_name(m.SGLANG_NUM_RUNNING_REQS, names), D),
            Variable("run", "Pushed run", 'max by (run_id) (push_time_seconds{job=~"$job", run_id!=""})', "run_id",
                     multi=False, newest_first=True),
        ),
        rows=(_traffic(names), _latency(), _acceptance(), _comparison(), _replicas(), _gateway(), _totals()),
    )
