"""Every dashboard query and every rule, evaluated by a real Prometheus against real dfserve processes.

Two simulated engines (zlab as baseline, inhouse with 10% HTTP 500s as candidate) that send no spec details on the
OpenAI routes, as SGLang before 0.5.23, sit behind a splitting gateway (plus a dead replica, so retries and an
ejection happen), and two more that do, behind a shadowing gateway. One load test runs through the first with live
metrics; another runs OpenAI chat through the second and pushes its totals to a Pushgateway.
Prometheus scrapes everything on loopback with the committed rule file loaded; then each panel's PromQL, with
its template variables substituted as Grafana would, must return data, and each rule must evaluate cleanly.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, push_to_gateway

from dfserve import metrics as m
from dfserve.dashboards import ab, engine, rules, training
from dfserve.dashboards.grafana import Dashboard, expand
from dfserve.eval.watch_push import PUSH_JOB as WATCH_JOB
from dfserve.headers import ARM
from dfserve.listen import wait_listening
from tests import ROOT
from tests.integration.servers import (
    dfserve_argv,
    gateway_server,
    prometheus_server,
    pushgateway_server,
    refusing_port,
    sim_server,
    url_of,
)

pytestmark = pytest.mark.slow

RULE_FILE = ROOT / "dashboards" / "generated" / "prometheus" / "dfserve-rules.yml"
ARMS = ("baseline", "candidate")
GATEWAY_JOBS = "gateway|gateway-shadow"
LIVE_JOB = "loadtest"
EXPORTER_LISTENING = re.compile(r"dfserve loadtest metrics: listening on http://(\S+:\d+)")
PUSHED_JOB = "dfserve_loadtest"
METRIC = re.compile(r"\b(?:dfserve_|sglang[:_])[A-Za-z0-9_:]*")
SUFFIX = re.compile(r"_(?:total|bucket|sum|count)$")


@dataclass(frozen=True)
class Stack:
    prometheus: str
    live_start: float
    live_end: float
    pushed_run: str
    pushed_requests: int
    """Records per arm of the pushed run."""
    live_requests: int
    """Records per arm of the live (scraped) run."""


OLDER_RUN = "zz-older-run"
"""Pushed first, and named to sort first backwards by name: only the push times put it second."""


def _host(url: str) -> str:
    return url.removeprefix("http://")


def _scrape_config(engines: dict[str, str], gateways: dict[str, str], live_targets: Path, pushgateway: str) -> Any:
    """`live_targets`: a file_sd file that names the live load test's exporter once it says where it listens."""
    def static(job: str, targets: list[str], **extra: Any) -> dict[str, Any]:
        return {"job_name": job, "static_configs": [{"targets": targets}], **extra}

    engine_targets = [{"targets": [_host(url)], "labels": {m.DEPLOYMENT_LABEL: name}} for name, url in engines.items()]
    return {
        "global": {"scrape_interval": "500ms", "evaluation_interval": "1s"},
        "rule_files": [str(RULE_FILE)],
        "scrape_configs": [
            {"job_name": "engines", "static_configs": engine_targets},
            # The same engines as a Prometheus that stores SGLang's names with `sglang_` (dashboards/README.md).
            {"job_name": "engines-underscore", "static_configs": engine_targets, "metric_relabel_configs": [
                {"source_labels": ["__name__"], "regex": "sglang:(.*)", "target_label": "__name__",
                 "replacement": "sglang_${1}"}]},
            *(static(job, [_host(url)]) for job, url in gateways.items()),
            {"job_name": LIVE_JOB, "file_sd_configs": [{"files": [str(live_targets)], "refresh_interval": "1s"}]},
            static("pushgateway", [_host(pushgateway)], honor_labels=True),
        ],
    }


def _gateway_config(path: Path, routing: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump({
        "schema_version": 1, **routing, "seed": 0,
        # Health checks rarely, so requests meet the dead replica first: retries, then a passive ejection.
        "health": {"interval_s": 30, "eject_after_failures": 2},
        "scrape": {"interval_s": 0.5, "window_s": 30},
    }))
    return path


def _loadtest(tmp: Path, api: str, gateway: str, *extra: str, num_requests: int = 30,
              live: Callable[[str], None] | None = None) -> None:
    """A load test through `gateway`; `live` gets the URL of its exporter (`--metrics-port 0`) once it says where
    it listens, while the run goes on."""
    argv = dfserve_argv(
        "loadtest", "run", "--arm", f"baseline={gateway}", "--arm", f"candidate={gateway}", "--api", api,
        "--num-requests", str(num_requests), "--warmup", "2", "--max-new-tokens", "48", "--rate", "8",
        "--arrival", "constant", "--concurrency", "8", "--seed", "0", "--out", str(tmp / "runs"), "--quiet", *extra,
    )
    log = tmp / f"loadtest-{api}.log"
    with log.open("wb") as out:
        run = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            if live is not None:
                live(wait_listening(log, run.poll, 30, EXPORTER_LISTENING))
            assert run.wait(180) == 0, log.read_text()
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()


def _scraped_from(prometheus: str, targets: Path, url: str, timeout_s: float = 20) -> None:
    """Name `url` in the file_sd file `targets` and wait until Prometheus scrapes it (it applies discovered targets
    at most every 5 s)."""
    targets.write_text(json.dumps([{"targets": [_host(url)]}]))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        active = httpx.get(f"{prometheus}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        if any(t["labels"].get("job") == LIVE_JOB and t["health"] == "up" for t in active):
            return
        time.sleep(0.2)
    raise AssertionError(f"Prometheus did not scrape the live load tester at {url} within {timeout_s} s")


def query(prometheus: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    body = httpx.get(f"{prometheus}/api/v1/query", params=params, timeout=10).json()
    assert body["status"] == "success", f"{expr}\n-> {body.get('error')}"
    return list(body["data"]["result"])


def finite(samples: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in samples)


def _wait_for(prometheus: str, expr: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not finite(query(prometheus, expr)):
        assert time.monotonic() < deadline, f"no finite sample of {expr} after {timeout_s} s"
        time.sleep(0.5)


def _streamed_chat_without_spec_details(gateway: str, prometheus: str) -> None:
    """Streamed chat from a client that asks for usage but not for spec details, to engines that send none however
    asked (before SGLang 0.5.23): these requests are measured by the estimate (`measure="estimated"`); the load
    tester's chat goes to engines that send them, so its requests are exact. Sent in two rounds with a scrape between
    them: a series whose first scrape already holds every request has no increase, and the panels read increases."""
    body = {"model": "m", "messages": [{"role": "user", "content": "def f():"}], "max_tokens": 32, "stream": True,
            "stream_options": {"include_usage": True}}
    estimated = f'{m.ACCEPT_LENGTH}_count{{job="gateway", measure="estimated"}}'
    for waited in (f"count(count by (arm) ({estimated})) == 2",
                   f"count(sum by (arm) (increase({estimated}[1m])) > 0) == 2"):
        for arm in ARMS:
            for _ in range(3):
                with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers={ARM: arm},
                                  timeout=30) as r:
                    assert r.status_code in (200, 500) and r.read()
        _wait_for(prometheus, waited)


def _push_older_run(pushgateway: str) -> None:
    """A load test pushed before the stack's own: the Pushgateway keeps it."""
    registry = CollectorRegistry()
    metrics = m.DfserveMetrics.build(registry)
    for arm in ARMS:
        metrics.finished(arm, "chat", "", 200, None).inc(1000)
    push_to_gateway(pushgateway, job=PUSHED_JOB, registry=registry, grouping_key={"run_id": OLDER_RUN}, timeout=10)


def _measured(runs: Path, api: str) -> tuple[str, int]:
    """The `api` load test's run id and its measured records per arm (the same for both; warm-up requests are
    not exported)."""
    (run,) = [path for path in runs.iterdir() if (path / "requests.jsonl").exists()
              and json.loads((path / "config.json").read_text())["api"] == api]
    records = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
    (count,) = {sum(r["arm"] == arm and not r["warmup"] for r in records) for arm in ARMS}
    return json.loads((run / "config.json").read_text())["run_id"], count


def _push_watch(pushgateway: str) -> None:
    """What `dfserve eval watch --pushgateway` pushes after a checkpoint of a run levelling off below its baseline
    (the watch's own test pushes real trends; here the dashboards and rules read the names)."""
    registry = CollectorRegistry()
    gauges = m.EvalWatchMetrics.build(registry)
    gauges.step.set(4000)
    for method, tau, baseline in (("vanilla", 6.1, 7.9), ("ddtree8", 7.28, 11.26)):
        gauges.tau.labels(method).set(tau)
        gauges.baseline_tau.labels(method).set(baseline)
        gauges.tau_gap.labels(method).set(tau - baseline)
        gauges.projected_crossing_step.labels(method).set(9000)
        for outcome in m.EVAL_WATCH_OUTCOMES:
            gauges.projection.labels(method, outcome).set(1.0 if outcome == "plateau_below" else 0.0)
    push_to_gateway(pushgateway, job=WATCH_JOB, registry=registry, grouping_key={"watch": "run7"}, timeout=10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("observe")
    with contextlib.ExitStack() as stack:
        zlab = stack.enter_context(sim_server("zlab", 0.05, 1, "--no-spec-details"))
        inhouse = stack.enter_context(sim_server("inhouse", 0.05, 2, "--error-rate", "0.1", "--no-spec-details"))
        zlab_chat = stack.enter_context(sim_server("zlab", 0.05, 3))
        inhouse_chat = stack.enter_context(sim_server("inhouse", 0.05, 4))
        dead = url_of(stack.enter_context(refusing_port()))
        split = stack.enter_context(gateway_server(_gateway_config(tmp / "split.yaml", {"mode": "split", "arms": {
            "baseline": {"weight": 50, "replicas": [zlab]}, "candidate": {"weight": 50, "replicas": [inhouse, dead]}}})))
        shadow = stack.enter_context(gateway_server(_gateway_config(tmp / "shadow.yaml", {
            "mode": "shadow", "primary": "baseline",
            "arms": {"baseline": {"weight": 1, "replicas": [zlab_chat]},
                     "candidate": {"weight": 1, "replicas": [inhouse_chat]}},
            "shadow": {"dir": str(tmp / "shadow-records"), "until_decided": True}})))
        pushgateway = stack.enter_context(pushgateway_server())
        config = tmp / "prometheus.yml"
        live_targets = tmp / "loadtest-targets.json"
        live_targets.write_text("[]")
        config.write_text(yaml.safe_dump(_scrape_config({"zlab": zlab, "inhouse": inhouse},
                                                        {"gateway": split, "gateway-shadow": shadow},
                                                        live_targets, pushgateway)))
        prometheus = stack.enter_context(prometheus_server(config, tmp / "tsdb", log=tmp / "prometheus.log"))
        _wait_for(prometheus, 'min(up{job=~"engines|gateway.*|pushgateway"})')
        live_start = time.time()
        # Long enough to be scraped for a while after Prometheus discovers the exporter (up to 5 s).
        _loadtest(tmp, "native", split, "--metrics-port", "0", num_requests=80,
                  live=lambda url: _scraped_from(prometheus, live_targets, url))
        live_end = time.time()
        _push_older_run(pushgateway)
        time.sleep(1.1)  # the Pushgateway's push times are to the second or finer: the older run's is older
        _loadtest(tmp, "chat", shadow, "--pushgateway", pushgateway)
        _push_watch(pushgateway)
        _streamed_chat_without_spec_details(split, prometheus)
        assert httpx.get(f"{split}/no-such-route", timeout=10).status_code == 404  # answered by the gateway itself
        _wait_for(prometheus, f'count(count by (run_id) ({m.REQUESTS}_total{{job="{PUSHED_JOB}"}})) == 2')
        _wait_for(prometheus, f'min({m.ARM_WINDOWED_ACCEPT_LENGTH}{{job="gateway"}})')
        _wait_for(prometheus, f"min({rules.ACCEPT_LENGTH_5M})")
        _wait_for(prometheus, f'min({m.EVAL_WATCH_STEP}{{job="{WATCH_JOB}"}})')
        yield Stack(prometheus, live_start, live_end, *_measured(tmp / "runs", "chat"),
                    _measured(tmp / "runs", "native")[1])


def _families(expr: str) -> set[str]:
    return {SUFFIX.sub("", name) for name in METRIC.findall(expr)}


def _exported(stack: Stack, job: str) -> set[str]:
    """Families with samples from `job` during the test."""
    body = httpx.get(f"{stack.prometheus}/api/v1/series", timeout=10, params={
        "match[]": f'{{job=~"{job}"}}', "start": f"{stack.live_start - 60:.0f}", "end": f"{time.time():.0f}"}).json()
    return {SUFFIX.sub("", series["__name__"]) for series in body["data"]}


def _window(since: float, until: float) -> str:
    return f"{math.ceil(until - since) + 2}s"


def _expansions(board: Dashboard, values: dict[str, str], repeat: str | None) -> Iterator[dict[str, str]]:
    if repeat is None:
        yield values
    else:
        for arm in ARMS:
            yield {**values, repeat: arm}


def _check_dashboard(stack: Stack, board: Dashboard, values: dict[str, str], at: float | None,
                     exported: set[str], per_target: bool, need_finite: bool) -> list[str]:
    """Problems of the dashboard's panels whose families the source exports; returns the panels checked."""
    panels: dict[str, list[bool]] = {}
    problems = []
    for q in board.queries():
        if not _families(q.expr) <= exported:
            continue
        for variables in _expansions(board, values, q.repeat):
            samples = query(stack.prometheus, expand(q.expr, variables), at)
            ok = bool(samples) and (finite(samples) or not need_finite)
            panels.setdefault(q.panel, []).append(ok)
            if per_target and not ok:
                problems.append(f"{board.uid} / {q.panel} / {q.ref_id}: {'no data' if not samples else 'only NaN'}")
    if not per_target:
        problems += [f"{board.uid} / {panel}: no data" for panel, oks in panels.items() if not any(oks)]
    assert not problems, "\n".join(problems)
    return sorted(panels)


def _ab_values(job: str, window: str, run: str = "") -> dict[str, str]:
    """As Grafana sends them; `run` is empty where the source has no pushed run (Grafana's "None")."""
    return {"job": job, "arm": ".*", "baseline": "baseline", "candidate": "candidate", "deployment": ".*", "datasource": "",
            "__rate_interval": window, "run": run}


def _runs(stack: Stack, job: str) -> list[str]:
    """The `run` variable's options for `job` as Grafana makes them: its query's result in Prometheus's order (the
    variable does not sort), each series' text matched by the variable's regex."""
    (variable,) = [v for v in ab.build().variables if v.name == "run"]
    json_variable = variable.to_json()
    assert json_variable["sort"] == 0 and json_variable["query"] == variable.definition
    inner = variable.definition.removeprefix("query_result(").removesuffix(")")
    capture = re.compile(json_variable["regex"].strip("/"))
    samples = query(stack.prometheus, expand(inner, {"job": job}))
    texts = ["{" + ", ".join(f'{k}="{v}"' for k, v in s["metric"].items()) + "}" for s in samples]
    return [found.group(1) for text in texts if (found := capture.search(text))]


def test_every_ab_panel_has_data_from_the_gateways_and_engines(stack: Stack) -> None:
    board = ab.build()
    exported = _exported(stack, f"{GATEWAY_JOBS}|engines")
    every = {family for q in board.queries() for family in _families(q.expr)}
    assert every <= exported, f"the gateways and engines export no {sorted(every - exported)}"
    checked = _check_dashboard(stack, board, _ab_values(GATEWAY_JOBS, _window(stack.live_start, time.time())), None,
                               exported, per_target=True, need_finite=True)
    assert len(checked) == sum(len(row.panels) for row in board.rows)


def test_ab_panels_have_data_from_the_live_load_tester(stack: Stack) -> None:
    board = ab.build()
    at = stack.live_end - 0.75  # the last scrape before the load tester exited
    checked = _check_dashboard(stack, board, _ab_values(LIVE_JOB, _window(stack.live_start, at)), at,
                               _exported(stack, LIVE_JOB), per_target=False, need_finite=True)
    for panel in ("Time to first token", "Inter-token latency (per token)", "Acceptance length (pooled, exact)",
                  "Acceptance length ratio", "Acceptance length distribution ($arm)", "Requests"):
        assert panel in checked


def test_the_live_load_testers_last_requests_reach_prometheus(stack: Stack) -> None:
    """Its last requests finish after a scrape: the exporter serves on until the next one has read them."""
    seen = query(stack.prometheus, f'max_over_time(sum by (arm) ({m.REQUESTS}_total{{job="{LIVE_JOB}"}})[10m:250ms])')
    assert {s["metric"]["arm"]: float(s["value"][1]) for s in seen} == {arm: stack.live_requests for arm in ARMS}


def test_ab_whole_run_panels_have_data_from_the_pushgateway(stack: Stack) -> None:
    """A pushed run is one final snapshot: rates over it are zero, so its row is the whole-run totals."""
    board = ab.build()
    totals = Dashboard(board.uid, board.title, board.description, board.variables, board.rows[-1:])
    checked = _check_dashboard(stack, totals, _ab_values(PUSHED_JOB, "1m", _runs(stack, PUSHED_JOB)[0]), None,
                               _exported(stack, PUSHED_JOB), per_target=False, need_finite=True)
    assert len(checked) == len(totals.rows[0].panels)


def test_the_whole_run_row_counts_one_pushed_run_the_newest_first(stack: Stack) -> None:
    """The Pushgateway keeps every run's group: the row reads the one `$run` names, the newest by default, and
    counts its requests as its records do, never every run ever pushed (an older run was pushed before it)."""
    runs = _runs(stack, PUSHED_JOB)
    assert runs == [stack.pushed_run, OLDER_RUN]
    (requests,) = [q.expr for q in ab.build().queries() if q.panel == "Requests" and "status" not in q.expr]
    counted = {s["metric"]["arm"]: float(s["value"][1])
               for s in query(stack.prometheus, expand(requests, _ab_values(PUSHED_JOB, "1m", runs[0])))}
    assert counted == {arm: stack.pushed_requests for arm in ARMS}, counted


def test_request_panels_leave_out_metadata_gets(stack: Stack) -> None:
    """The load tester reads `/server_info` and `/v1/models` through the gateway: the arms count them under their
    own routes, and the Requests panel and the error-ratio rule count generation requests only."""
    metadata = query(stack.prometheus, f'sum({m.REQUESTS}_total{{job="gateway", route!~"native|chat|completions"}})')
    assert metadata and float(metadata[0]["value"][1]) > 0
    (requests,) = [q.expr for q in ab.build().queries() if q.panel == "Requests" and "status" not in q.expr]
    shown = sum(float(s["value"][1]) for s in query(stack.prometheus, expand(requests, _ab_values("gateway", "1m"))))
    generation = query(stack.prometheus, f'sum({m.REQUESTS}_total{{job="gateway", route=~"native|chat|completions"}})')
    assert shown == float(generation[0]["value"][1])


def test_an_arm_without_errors_has_an_error_ratio_of_zero_not_none(stack: Stack) -> None:
    """The splitting gateway's baseline engine never fails, its candidate fails 10% of requests: both arms have a
    line on the error-ratio panel, the baseline's at 0 (a share of errors that have not happened had no series)."""
    (error_ratio,) = [q.expr for q in ab.build().queries() if q.panel == "Error ratio"]
    samples = query(stack.prometheus, expand(error_ratio, _ab_values("gateway", _window(stack.live_start,
                                                                                          time.time()))))
    by_arm = {s["metric"]["arm"]: float(s["value"][1]) for s in samples}
    assert set(by_arm) == set(ARMS) and by_arm["baseline"] == 0 and 0 < by_arm["candidate"] < 0.5, by_arm


def test_pooled_acceptance_leaves_out_estimated_chat(stack: Stack) -> None:
    """The splitting gateway relays native requests with exact spec fields and a few streamed chat requests from
    engines that send no spec details (estimated, no verify rounds): their tokens are counted
    (`dfserve_output_tokens_total`), and every pooled acceptance query divides the tokens of the requests that
    reported verify rounds (`dfserve_spec_output_tokens_total`), never all of them."""
    at, window = time.time(), _window(stack.live_start, time.time())
    tokens = query(stack.prometheus, f'sum by (arm) ({m.OUTPUT_TOKENS}_total{{job="gateway"}})', at)
    spec = query(stack.prometheus, f'sum by (arm) ({m.SPEC_OUTPUT_TOKENS}_total{{job="gateway"}})', at)
    assert float(tokens[0]["value"][1]) > 0 and {s["metric"]["arm"] for s in tokens} >= {"baseline"}
    assert sum(float(s["value"][1]) for s in tokens) > sum(float(s["value"][1]) for s in spec)
    pooled = [q.expr for q in ab.build().queries() if f"{m.SPEC_VERIFY_ROUNDS}_total" in q.expr]
    assert len(pooled) == 3 and all(m.SPEC_OUTPUT_TOKENS in expr for expr in pooled)
    for expr in pooled:
        samples = query(stack.prometheus, expand(expr, _ab_values("gateway", window)), at)
        assert samples and all(math.isfinite(float(s["value"][1])) and float(s["value"][1]) > 0 for s in samples), expr


@pytest.mark.parametrize("names", engine.NAME_STYLES)
def test_every_engine_panel_has_data(stack: Stack, names: engine.NameStyle) -> None:
    board = engine.build(names)
    values = {"deployment": ".*", "datasource": "", "__rate_interval": _window(stack.live_start, time.time())}
    every = {family for q in board.queries() for family in _families(q.expr)}
    checked = _check_dashboard(stack, board, values, None, every, per_target=True, need_finite=True)
    assert len(checked) == sum(len(row.panels) for row in board.rows)


def test_every_training_panel_has_data_from_a_pushed_watch(stack: Stack) -> None:
    board = training.build()
    checked = _check_dashboard(stack, board, {"watch": ".*", "method": ".*", "datasource": ""}, None,
                               _exported(stack, WATCH_JOB), per_target=True, need_finite=True)
    assert len(checked) == sum(len(row.panels) for row in board.rows)


@pytest.mark.parametrize("board", [ab.build(), engine.build("colon"), engine.build("underscore"), training.build()],
                         ids=lambda board: board.uid)
def test_every_variable_has_values(stack: Stack, board: Dashboard) -> None:
    values = {"job": ".*"}
    for variable in board.variables:
        if variable.is_datasource:
            continue
        if variable.newest_first:
            found = _runs(stack, values["job"])
        else:
            url = f"{stack.prometheus}/api/v1/label/{variable.label_name}/values"
            found = httpx.get(url, params={"match[]": expand(variable.series, values)}, timeout=10).json()["data"]
        assert found, f"{board.uid}: variable {variable.name} has no values"
        if variable.default:
            assert variable.default in found, variable.name


def test_rules_load_and_evaluate_with_data(stack: Stack) -> None:
    groups = httpx.get(f"{stack.prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = {rule["name"]: rule for group in groups for rule in group["rules"]}
    settings = rules.RuleSettings()
    assert set(loaded) == {r.record for r in rules.recording_rules()} | {a.name for a in rules.alerts(settings)}
    assert all(rule["health"] == "ok" and not rule.get("lastError") for rule in loaded.values()), loaded
    for recording in rules.recording_rules():
        assert finite(query(stack.prometheus, recording.record)), f"{recording.record}: no data"
    for alert in rules.alerts(settings):
        query(stack.prometheus, alert.expr)
        for signal in alert.signals:
            assert query(stack.prometheus, signal), f"{alert.name}: signal {signal} has no data"


def test_alerts_go_pending_on_what_the_stack_really_does(stack: Stack) -> None:
    """The candidate (inhouse profile) accepts fewer tokens than the baseline, and the dead replica is ejected."""
    deadline = time.monotonic() + 20
    while True:
        alerts = httpx.get(f"{stack.prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        active = {(a["labels"]["alertname"], a["labels"].get("job"), a["labels"].get("arm")) for a in alerts}
        wanted = {("DfserveCandidateAcceptanceBelowBaseline", "gateway", "candidate"),
                  ("DfserveReplicaEjected", "gateway", "candidate")}
        if wanted <= active or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert wanted <= active, active
