"""Prometheus recording and alerting rules for dfserve's arms and SGLang engines.

Recording rules pool over each (job, arm), so the gateway's and the load tester's views of one arm never mix, and
over generation requests only (`/v1/models` polled through the gateway is not an arm's traffic).
Each alert names the signals it compares: the expressions that must return data for the alert to be able to fire,
which the integration test checks against a real Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dfserve import metrics as m

from .engine import NameStyle, sglang_name
from .promql import (
    GENERATION,
    arm_acceptance,
    counter,
    error_ratio,
    increase_sum,
    quantile,
    selector,
    tokens_per_round,
)

ARM = ("job", "arm")
# Recording-rule names follow Prometheus' level:metric:operations convention, built from the metric constants so a
# renamed metric renames its rules too.
ACCEPT_LENGTH_5M = f"arm:{m.ACCEPT_LENGTH}:ratio_rate5m"
ERROR_RATIO_5M = f"arm:{m.REQUESTS}_error:ratio_rate5m"
ERROR_RATIO_1H = f"arm:{m.REQUESTS}_error:ratio_rate1h"
TTFT_P99_5M = f"arm:{m.TTFT}:p99_rate5m"
ENGINE_ACCEPT_LENGTH_5M = f"deployment:{sglang_name(m.SGLANG_SPEC_ACCEPT_LENGTH, 'underscore')}:ratio_rate5m"


@dataclass(frozen=True)
class RuleSettings:
    """Arm names and thresholds the alerts use; the defaults match `dfserve gateway`'s and the load tester's arms."""

    baseline_arm: str = "baseline"
    candidate_arm: str = "candidate"
    accept_tolerance: float = 0.95
    """The candidate alerts when its acceptance length falls below this share of the baseline's."""
    error_ratio: float = 0.05
    error_jump: float = 2.0
    """An error-rate jump: the 5-minute error ratio over `error_ratio` and over `error_jump` × the hourly one."""
    ttft_p99_s: float = 2.0


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str

    def to_json(self) -> dict[str, Any]:
        return {"record": self.record, "expr": self.expr}


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    signals: tuple[str, ...]
    for_: str
    severity: str
    summary: str
    description: str

    def to_json(self) -> dict[str, Any]:
        return {"alert": self.name, "expr": self.expr, "for": self.for_, "labels": {"severity": self.severity},
                "annotations": {"summary": self.summary, "description": self.description}}


def recording_rules(names: NameStyle = "colon") -> tuple[Recording, ...]:
    """The recording rules for a Prometheus that stores SGLang's names in `names` style."""
    return (
        Recording(ACCEPT_LENGTH_5M, arm_acceptance("5m", ARM, (GENERATION,))),
        *(Recording(record, error_ratio(window, ARM, (GENERATION,)))
          for record, window in ((ERROR_RATIO_5M, "5m"), (ERROR_RATIO_1H, "1h"))),
        Recording(TTFT_P99_5M, quantile(0.99, m.TTFT, "5m", ARM, (GENERATION,))),
        Recording(ENGINE_ACCEPT_LENGTH_5M, tokens_per_round(
            sglang_name(m.SGLANG_GENERATION_TOKENS, names), sglang_name(m.SGLANG_SPEC_VERIFY_CALLS, names), "5m",
            [m.DEPLOYMENT_LABEL])),
    )


def alerts(settings: RuleSettings) -> tuple[Alert, ...]:
    candidate = selector(ACCEPT_LENGTH_5M, [f'arm="{settings.candidate_arm}"'])
    baseline = selector(ACCEPT_LENGTH_5M, [f'arm="{settings.baseline_arm}"'])
    healthy = f"max by (job, arm, replica) ({m.REPLICA_HEALTHY})"
    engines_up = selector("up", [f'{m.DEPLOYMENT_LABEL}!=""'])
    routing_versions = f"count by (job) (count by (job, version) ({m.ROUTING_VERSION}))"
    refused = increase_sum(counter(m.ROUTING_RELOADS), "10m", ["job"], ('outcome="refused"',))
    plateau_below = selector(m.EVAL_WATCH_PROJECTION, ['outcome="plateau_below"'])
    plateau = f"max by (job, watch, method) ({plateau_below})"
    return (
        Alert("DfserveCandidateAcceptanceBelowBaseline",
              f"{candidate}\n< ignoring (arm) group_left\n{settings.accept_tolerance} * {baseline}",
              (candidate, baseline), "10m", "warning",
              "Candidate drafter accepts fewer tokens per round than the baseline",
              f"{{{{ $labels.job }}}}: acceptance length of {settings.candidate_arm} is {{{{ $value | printf \"%.2f\" }}}}, "
              f"under {settings.accept_tolerance:g} x {settings.baseline_arm}'s over 5 minutes."),
        Alert("DfserveErrorRateJump",
              f"{ERROR_RATIO_5M} > {settings.error_ratio}\nand\n{ERROR_RATIO_5M} > {settings.error_jump} * {ERROR_RATIO_1H}",
              (ERROR_RATIO_5M, ERROR_RATIO_1H), "5m", "critical",
              "Error ratio of an arm jumped",
              f"{{{{ $labels.job }}}} arm {{{{ $labels.arm }}}}: {{{{ $value | humanizePercentage }}}} of requests failed "
              f"over 5 minutes, above {settings.error_ratio:g} and {settings.error_jump:g} x the hourly ratio."),
        Alert("DfserveReplicaEjected", f"{healthy} == 0", (healthy,), "2m", "warning",
              "Gateway ejected a replica",
              "{{ $labels.job }}: replica {{ $labels.replica }} of arm {{ $labels.arm }} is ejected as unhealthy."),
        Alert("DfserveEngineDown", f"{engines_up} == 0", (engines_up,), "2m", "critical",
              "An SGLang engine is not answering scrapes",
              "Deployment {{ $labels.deployment }} target {{ $labels.instance }} has been down for 2 minutes."),
        Alert("DfserveTTFTP99High", f"{TTFT_P99_5M} > {settings.ttft_p99_s}", (TTFT_P99_5M,), "10m", "warning",
              "Time to first token p99 is over its threshold",
              f"{{{{ $labels.job }}}} arm {{{{ $labels.arm }}}}: TTFT p99 is {{{{ $value | humanizeDuration }}}}, "
              f"over {settings.ttft_p99_s:g} s."),
        Alert("DfserveGatewayRoutingSplit", f"{routing_versions} > 1", (routing_versions,), "10m", "warning",
              "Gateway replicas run different routing",
              "{{ $labels.job }}: {{ $value }} routing versions have been served side by side for 10 minutes; a "
              "replica did not pick up the config file (see its dfserve_gateway_routing_reloads_total)."),
        Alert("DfserveGatewayRoutingRefused", f"{refused} > 0", (refused,), "1m", "warning",
              "A gateway refused a new routing file",
              "{{ $labels.job }}: the config file's new version was refused (the gateway log says which field); "
              "the replicas keep the last good routing."),
        Alert("DfserveTrainingProjectedBelowBaseline", f"{plateau} == 1", (plateau,), "1m", "warning",
              "The training run is projected not to reach the baseline",
              "Watch {{ $labels.watch }}: the τ ({{ $labels.method }}) of its checkpoints levels off below the "
              "baseline's (dfserve eval watch's projection, see its report.html)."),
    )


def rule_groups(settings: RuleSettings, names: NameStyle = "colon") -> list[dict[str, Any]]:
    """The `groups:` of a Prometheus rule file (and of a PrometheusRule's spec)."""
    return [
        {"name": "dfserve.recording", "rules": [rule.to_json() for rule in recording_rules(names)]},
        {"name": "dfserve.alerts", "rules": [alert.to_json() for alert in alerts(settings)]},
    ]
