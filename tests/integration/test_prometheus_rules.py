"""The rules as Prometheus runs them: `promtool check rules` on the committed file, and `promtool test rules` on
synthetic series that must make each alert fire (and, just short of its condition, stay quiet)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from dfserve import metrics as m
from dfserve.dashboards import rules
from dfserve.dashboards.render import to_yaml
from tests import ROOT

RULE_FILE = ROOT / "dashboards" / "generated" / "prometheus" / "dfserve-rules.yml"
JOB = {"job": "gateway"}


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: `make test` installs the Debian package prometheus"
    return path


def test_promtool_accepts_the_committed_rules() -> None:
    result = subprocess.run([promtool(), "check", "rules", str(RULE_FILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules.recording_rules()) + len(rules.alerts(rules.RuleSettings()))} rules found" in result.stdout


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    body = ", ".join(f'{key}="{value}"' for key, value in {**JOB, **labels}.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def _acceptance(candidate_tokens_per_min: int) -> list[dict[str, str]]:
    """Both arms verify 100 rounds a minute; the baseline accepts 9 tokens a round. The candidate also serves
    streamed chat without verify rounds, 1000 tokens a minute: pooled over every token it would read 17 and 18.7,
    so the cases below fail if the rule divides the wrong numerator."""
    return [
        _series("dfserve_output_tokens_total", {"arm": "baseline", "route": "native"}, "0+900x40"),
        _series("dfserve_spec_output_tokens_total", {"arm": "baseline", "route": "native"}, "0+900x40"),
        _series("dfserve_spec_verify_rounds_total", {"arm": "baseline", "route": "native"}, "0+100x40"),
        _series("dfserve_output_tokens_total", {"arm": "candidate", "route": "native"}, f"0+{candidate_tokens_per_min + 1000}x40"),
        _series("dfserve_spec_output_tokens_total", {"arm": "candidate", "route": "native"}, f"0+{candidate_tokens_per_min}x40"),
        _series("dfserve_spec_verify_rounds_total", {"arm": "candidate", "route": "native"}, "0+100x40"),
    ]


def _requests(http_status: int | None, error: str | None) -> dict[str, str]:
    """Labels of `dfserve_requests_total` for one outcome, as the gateway and the load tester write them."""
    status, kind = m.request_labels(http_status, error)
    return {"arm": "candidate", "route": "native", "replica": "r1", "status": status, "error": kind}


FAILED = {"arm": "candidate", "route": "native", "replica": "r1"}
"""Labels of `dfserve_requests_failed_total`: started at 0 with the arm's 2xx series."""


def _alert(name: str, at: str, labels: dict[str, str] | None) -> dict[str, Any]:
    """`labels` None: the alert must not fire at `at`."""
    expected = [] if labels is None else [{"exp_labels": labels}]
    return {"eval_time": at, "alertname": name, "exp_alerts": expected}


def _without_annotations(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """promtool compares annotations verbatim; their templates are checked by `promtool check rules` instead."""
    return [{**group, "rules": [{k: v for k, v in rule.items() if k != "annotations"} for rule in group["rules"]]}
            for group in groups]


CASES: list[dict[str, Any]] = [
    {"interval": "1m", "input_series": _acceptance(700), "alert_rule_test": [
        _alert("DfserveCandidateAcceptanceBelowBaseline", "5m", None),
        _alert("DfserveCandidateAcceptanceBelowBaseline", "20m", {**JOB, "arm": "candidate", "severity": "warning"}),
    ], "promql_expr_test": [
        {"expr": f"round({rules.ACCEPT_LENGTH_5M}, 0.001)", "eval_time": "20m", "exp_samples": [
            {"labels": '{job="gateway", arm="baseline"}', "value": 9},
            {"labels": '{job="gateway", arm="candidate"}', "value": 7},
        ]},
    ]},
    {"interval": "1m", "input_series": _acceptance(870), "alert_rule_test": [
        _alert("DfserveCandidateAcceptanceBelowBaseline", "30m", None),
    ]},
    {"interval": "1m", "input_series": [
        _series("dfserve_requests_total", _requests(200, None), "0+100x120"),
        _series("dfserve_requests_total", _requests(502, "connect"), "0x59 0+10x60"),
        _series("dfserve_requests_total", _requests(200, "stream_cut"), "0x59 0+5x60"),
        _series("dfserve_requests_total", _requests(None, "cancelled"), "0x59 0+5x60"),
        _series(f"{m.REQUESTS_FAILED}_total", FAILED, "0x59 0+20x60"),
    ], "alert_rule_test": [
        _alert("DfserveErrorRateJump", "50m", None),
        _alert("DfserveErrorRateJump", "70m", {**JOB, "arm": "candidate", "severity": "critical"}),
    ]},
    {"interval": "1m", "input_series": [
        # One failure of a kind not seen before: its series appears at 1, which no rate() counts; the failed
        # count, started at 0, does.
        _series("dfserve_requests_total", _requests(200, None), "0+100x20"),
        _series("dfserve_requests_total", _requests(502, "connect"), "_x9 1x10"),
        _series(f"{m.REQUESTS_FAILED}_total", FAILED, "0x9 1x10"),
    ], "alert_rule_test": [], "promql_expr_test": [
        {"expr": f"{rules.ERROR_RATIO_5M} > bool 0", "eval_time": "12m",
         "exp_samples": [{"labels": '{job="gateway", arm="candidate"}', "value": 1}]},
        {"expr": f"{rules.ERROR_RATIO_5M} > bool 0", "eval_time": "18m",
         "exp_samples": [{"labels": '{job="gateway", arm="candidate"}', "value": 0}]},
    ]},
    {"interval": "1m", "input_series": [
        # Two gateway pods mid-rollout: "old" exports no failed counter (50 ok and 50 failed a minute), "new" does
        # (100 ok a minute): the old pod's failures are read from their kinds, 50 of 200.
        _series("dfserve_requests_total", {**_requests(200, None), "instance": "old"}, "0+50x20"),
        _series("dfserve_requests_total", {**_requests(502, "connect"), "instance": "old"}, "0+50x20"),
        _series("dfserve_requests_total", {**_requests(200, None), "instance": "new"}, "0+100x20"),
        _series(f"{m.REQUESTS_FAILED}_total", {**FAILED, "instance": "new"}, "0x20"),
    ], "alert_rule_test": [], "promql_expr_test": [
        {"expr": f"round({rules.ERROR_RATIO_5M}, 0.01)", "eval_time": "15m",
         "exp_samples": [{"labels": '{job="gateway", arm="candidate"}', "value": 0.25}]},
    ]},
    {"interval": "1m", "input_series": [
        # One gateway at one address restarted into this version at 30m (its counters start again): steady 6%
        # failures throughout. A window across the restart holds the earlier failures only in their kinds' series:
        # the ratio stays 6%, and the 1 h figure drops no failures for the jump alert to fire on.
        _series("dfserve_requests_total", _requests(200, None), "0+94x29 0+94x40"),
        _series("dfserve_requests_total", _requests(502, "connect"), "0+6x29 _ 6+6x39"),
        _series(f"{m.REQUESTS_FAILED}_total", FAILED, "_x30 0+6x40"),
    ], "alert_rule_test": [
        _alert("DfserveErrorRateJump", "45m", None),
    ], "promql_expr_test": [
        {"expr": f"round({rules.ERROR_RATIO_1H}, 0.01)", "eval_time": "45m",
         "exp_samples": [{"labels": '{job="gateway", arm="candidate"}', "value": 0.06}]},
    ]},
    {"interval": "1m", "input_series": [
        _series("dfserve_replica_healthy", {"arm": "baseline", "replica": "http://r1"}, "1x5 0x10"),
        {"series": 'up{job="engines", deployment="zlab", instance="10.0.0.1:30000"}', "values": "1x5 0x10"},
    ], "alert_rule_test": [
        _alert("DfserveReplicaEjected", "5m", None),
        _alert("DfserveReplicaEjected", "10m", {**JOB, "arm": "baseline", "replica": "http://r1", "severity": "warning"}),
        _alert("DfserveEngineDown", "10m", {"job": "engines", "deployment": "zlab", "instance": "10.0.0.1:30000",
                                            "severity": "critical"}),
    ]},
    {"interval": "1m", "input_series": [
        _series("dfserve_time_to_first_token_seconds_bucket", {"arm": "candidate", "route": "native", "le": "0.5"}, "0+10x30"),
        _series("dfserve_time_to_first_token_seconds_bucket", {"arm": "candidate", "route": "native", "le": "5"}, "0+100x30"),
        _series("dfserve_time_to_first_token_seconds_bucket", {"arm": "candidate", "route": "native", "le": "+Inf"}, "0+100x30"),
        _series("sglang:generation_tokens_total", {"deployment": "zlab"}, "0+1100x30"),
        _series("sglang:spec_verify_calls_total", {"deployment": "zlab"}, "0+100x30"),
    ], "alert_rule_test": [
        _alert("DfserveTTFTP99High", "20m", {**JOB, "arm": "candidate", "severity": "warning"}),
    ], "promql_expr_test": [
        {"expr": f"round({rules.ENGINE_ACCEPT_LENGTH_5M}, 0.001)", "eval_time": "20m",
         "exp_samples": [{"labels": '{deployment="zlab"}', "value": 11}]},
    ]},
    {"interval": "1m", "input_series": [
        # Three gateway replicas; at 5m the file changes, a and b apply it, c never does (and refuses nothing).
        _series(m.ROUTING_VERSION, {"instance": "a", "version": "v1"}, "1x5 _x25"),
        _series(m.ROUTING_VERSION, {"instance": "a", "version": "v2"}, "_x5 1x25"),
        _series(m.ROUTING_VERSION, {"instance": "b", "version": "v1"}, "1x6 _x24"),
        _series(m.ROUTING_VERSION, {"instance": "b", "version": "v2"}, "_x6 1x24"),
        _series(m.ROUTING_VERSION, {"instance": "c", "version": "v1"}, "1x30"),
        _series(f"{m.ROUTING_RELOADS}_total", {"instance": "a", "outcome": "applied"}, "0x5 1x25"),
        _series(f"{m.ROUTING_RELOADS}_total", {"instance": "b", "outcome": "refused"}, "0x20 1x10"),
    ], "alert_rule_test": [
        _alert("DfserveGatewayRoutingSplit", "4m", None),
        _alert("DfserveGatewayRoutingSplit", "12m", None),
        _alert("DfserveGatewayRoutingSplit", "20m", {**JOB, "severity": "warning"}),
        _alert("DfserveGatewayRoutingRefused", "15m", None),
        _alert("DfserveGatewayRoutingRefused", "24m", {**JOB, "severity": "warning"}),
    ], "promql_expr_test": [
        {"expr": f"count by (version) ({m.ROUTING_VERSION})", "eval_time": "20m",
         "exp_samples": [{"labels": '{version="v1"}', "value": 1}, {"labels": '{version="v2"}', "value": 2}]},
    ]},
    {"interval": "1m", "input_series": [
        # A watch's projection, pushed once per checkpoint: undetermined, then levelling off below the baseline.
        *({"series": f'{m.EVAL_WATCH_PROJECTION}{{job="dfserve_eval_watch", watch="run7", method="vanilla", '
                     f'outcome="{outcome}"}}', "values": values}
          for outcome, values in (("undetermined", "1x5 0x10"), ("plateau_below", "0x5 1x10"))),
        {"series": f'{m.EVAL_WATCH_PROJECTION}{{job="dfserve_eval_watch", watch="run8", method="vanilla", '
                   'outcome="plateau_below"}', "values": "0x15"},
    ], "alert_rule_test": [
        _alert("DfserveTrainingProjectedBelowBaseline", "5m", None),
        _alert("DfserveTrainingProjectedBelowBaseline", "10m", {"job": "dfserve_eval_watch", "watch": "run7",
                                                                "method": "vanilla", "severity": "warning"}),
    ]},
]


def _promtool_test(tmp_path: Path, groups: list[dict[str, Any]], cases: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "rules.yml").write_text(to_yaml({"groups": _without_annotations(groups)}))
    (tmp_path / "tests.yml").write_text(to_yaml({"rule_files": ["rules.yml"], "evaluation_interval": "1m",
                                                 "tests": cases}))
    return subprocess.run([promtool(), "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True,
                          check=False)


def test_alerts_fire_on_their_conditions_and_only_then(tmp_path: Path) -> None:
    result = _promtool_test(tmp_path, yaml.safe_load(RULE_FILE.read_text())["groups"], CASES)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {case["alertname"] for group in CASES for case in group["alert_rule_test"]}
    assert tested == {alert.name for alert in rules.alerts(rules.RuleSettings())}


def test_a_broken_rule_is_caught(tmp_path: Path) -> None:
    """The harness itself can fail: an inverted candidate alert does not pass the case above."""
    groups = yaml.safe_load(RULE_FILE.read_text())["groups"]
    for rule in groups[1]["rules"]:
        if rule["alert"] == "DfserveCandidateAcceptanceBelowBaseline":
            rule["expr"] = rule["expr"].replace("<", ">")
    result = _promtool_test(tmp_path, groups, [CASES[0]])
    assert result.returncode != 0 and "alertname: DfserveCandidateAcceptanceBelowBaseline" in result.stderr
