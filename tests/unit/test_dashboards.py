"""The dashboards as Grafana imports them: committed JSON current, layout sound, every query naming real metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dfserve import metrics as m
from dfserve.cli import main
from dfserve.dashboards import ab, engine, rules
from dfserve.dashboards.grafana import GRID_WIDTH, Dashboard, Panel, Target, expand
from dfserve.dashboards.promql import ratio
from dfserve.dashboards.render import Settings, dashboards, render
from tests import ROOT

GENERATED = ROOT / "dashboards" / "generated"
METRIC_TOKEN = re.compile(r"\b(?:dfserve_|sglang[:_]|arm:|deployment:)[A-Za-z0-9_:]*")
SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")


def _known_names() -> set[str]:
    names = {value for key, value in vars(m).items() if key.isupper() and isinstance(value, str)}
    exposed = {name + suffix for name in names for suffix in SUFFIXES}
    recorded = {rule.record for rule in rules.recording_rules()}
    return exposed | {engine.sglang_name(name, "underscore") for name in exposed} | recorded


def test_committed_files_match_the_generator() -> None:
    files = render(Settings())
    on_disk = {str(path.relative_to(GENERATED)) for path in GENERATED.rglob("*") if path.is_file()}
    assert on_disk == set(files), "run `dfserve dashboards` and commit dashboards/generated"
    for relative, text in files.items():
        assert (GENERATED / relative).read_text() == text, f"{relative} is stale: run `dfserve dashboards`"


@pytest.mark.parametrize("board", dashboards(Settings()), ids=lambda board: board.uid)
def test_structure_grafana_imports(board: Dashboard) -> None:
    data = json.loads(json.dumps(board.to_json()))
    assert data["schemaVersion"] >= 36 and data["uid"] and data["title"]
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    panels = data["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= GRID_WIDTH, panel["title"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        if "repeat" in panel:
            assert variables[panel["repeat"]]["multi"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            used = set(re.findall(r"\$\{?(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= set(variables), f"{panel['title']}: undefined variables {used - set(variables)}"


def test_every_query_and_variable_names_a_defined_metric() -> None:
    known = _known_names()
    settings = Settings()
    exprs = [q.expr for board in dashboards(settings) for q in board.queries()]
    exprs += [v.series for board in dashboards(settings) for v in board.variables if not v.is_datasource]
    exprs += [r.expr for r in rules.recording_rules()] + [a.expr for a in rules.alerts(settings.rules)]
    used = {token for expr in exprs for token in METRIC_TOKEN.findall(expr)}
    assert used and used <= known, f"unknown metric names: {sorted(used - known)}"
    families = {m.TTFT, m.ITL_PER_TOKEN, m.ITL_PER_CHUNK, m.E2E, m.ACCEPT_LENGTH, m.SHADOW_REQUESTS, m.EJECTIONS,
                m.REPLICA_HEALTHY, m.ARM_WEIGHT, m.ARM_WINDOWED_ACCEPT_LENGTH, m.SGLANG_SPEC_ACCEPT_LENGTH,
                m.SGLANG_SPEC_VERIFY_CALLS, m.SGLANG_TOKEN_USAGE, m.SGLANG_NUM_QUEUE_REQS}
    assert all(any(family in token for token in used) for family in families)


def test_pooled_acceptance_divides_the_tokens_of_the_requests_that_reported_rounds() -> None:
    """Every token over the rounds of only some requests would read too high when streamed chat is mixed in."""
    exprs = [q.expr for q in ab.build().queries()] + [r.expr for r in rules.recording_rules()]
    pooled = [e for e in exprs if f"{m.SPEC_VERIFY_ROUNDS}_total" in e]
    assert len(pooled) == 4, "three A/B panels and the recording rule the acceptance alert reads"
    for expr in pooled:
        assert f"{m.SPEC_OUTPUT_TOKENS}_total" in expr and not re.search(rf"\b{m.OUTPUT_TOKENS}_total", expr), expr


def test_ab_dashboard_compares_the_named_arms() -> None:
    board = ab.build(baseline="zlab", candidate="inhouse")
    variables = {v.name: v for v in board.variables}
    assert (variables["baseline"].default, variables["candidate"].default) == ("zlab", "inhouse")
    ratios = [q.expr for q in board.queries() if "$candidate" in q.expr]
    assert len(ratios) == 6
    assert all(e.rindex('arm="$candidate"') < e.index('arm="$baseline"') for e in ratios), "candidate / baseline"


def test_underscore_names_replace_every_sglang_colon_name() -> None:
    colon = [q.expr for q in engine.build("colon").queries()]
    underscore = [q.expr for q in engine.build("underscore").queries()]
    assert all("sglang:" in e for e in colon)
    assert not any("sglang:" in e for e in underscore)
    assert [e.replace("sglang:", "sglang_") for e in colon] == underscore
    assert engine.build("underscore").uid != engine.build("colon").uid


def test_ratio_of_ratios_keeps_its_grouping() -> None:
    assert ratio("a", "b") == "a\n/\nb"
    assert ratio(ratio("a", "b"), ratio("c", "d")) == "(\na\n/\nb\n)\n/\n(\nc\n/\nd\n)"


def test_expand_substitutes_like_grafana() -> None:
    expr = 'rate(x{arm=~"$arm", job=~"${job}"}[$__rate_interval])'
    assert expand(expr, {"arm": "a|b", "job": ".*", "__rate_interval": "1m"}) == 'rate(x{arm=~"a|b", job=~".*"}[1m])'
    with pytest.raises(KeyError):
        expand("$nope", {})


def test_panels_refuse_bad_shapes() -> None:
    with pytest.raises(ValueError, match="width"):
        Panel("wide", "", (Target("up"),), width=GRID_WIDTH + 1)
    with pytest.raises(ValueError, match="no query"):
        Panel("empty", "", ())


def test_cli_writes_every_file_and_rejects_bad_arms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["dashboards", "--out", str(tmp_path), "--sglang-names", "underscore",
          "--baseline-arm", "zlab", "--candidate-arm", "inhouse"])
    board = json.loads((tmp_path / "grafana" / "dfserve-engine-underscore.json").read_text())
    assert "sglang_num_running_reqs" in json.dumps(board)
    rule_file = (tmp_path / "prometheus" / "dfserve-rules.yml").read_text()
    assert 'arm="inhouse"' in rule_file and "sglang_generation_tokens_total" in rule_file and "sglang:" not in rule_file
    for arm in ('x"y', "z-lab.v1"):  # a dot: a name the gateway refuses, so its alerts would never see one
        with pytest.raises(SystemExit) as exit_info:
            main(["dashboards", "--out", str(tmp_path), "--candidate-arm", arm])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip() == (
            f"dfserve: error: --candidate-arm: {arm!r} is not an arm name (ASCII letters, digits, '-' and '_', as the "
            "gateway takes them)")


AGGREGATION = re.compile(r"\b(?:sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\)\s*)?\($")
PER_POD = {"instance", "pod", "namespace"}


def _across_pods(expr: str, position: int) -> bool:
    """Whether the series at `position` is aggregated by an operator that keeps no per-pod label."""
    depth = 0
    for i in range(position - 1, -1, -1):
        if expr[i] == ")":
            depth += 1
        elif expr[i] == "(" and depth:
            depth -= 1
        elif expr[i] == "(":
            found = AGGREGATION.search(expr[: i + 1])
            if found:
                return not PER_POD & {label.strip() for label in (found.group(1) or "").split(",")}
    return False


def test_gateway_families_are_summed_across_gateway_pods() -> None:
    """Several gateway replicas (k8s/overlays/gateway-replicated) read as one gateway: every dfserve_ series a panel
    reads is aggregated without a per-pod label."""
    checked = 0
    for query in ab.build().queries():
        for found in re.finditer(r"\bdfserve_\w+", query.expr):
            assert _across_pods(query.expr, found.start()), query.expr
            checked += 1
    assert checked > 30
    for expr, summed in (("dfserve_arm_weight", False), ("sum by (arm, pod) (dfserve_arm_weight)", False),
                         ("max by (arm) (rate(dfserve_arm_weight[5m]))", True), ("count(dfserve_x)", True)):
        assert _across_pods(expr, expr.index("dfserve_")) is summed, expr


@pytest.mark.parametrize("value", ["inf", "nan", "1e309"])
def test_an_alert_threshold_that_could_never_fire_is_refused(tmp_path: Path, value: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`> inf` never fires, and `nan` passed the flag's bound: both were written into the rules, exit 0."""
    with pytest.raises(SystemExit) as exited:
        main(["dashboards", "--ttft-p99-seconds", value, "--out", str(tmp_path / "out")])
    assert exited.value.code == 2 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err == f"dfserve: error: --ttft-p99-seconds: '{value}' is not a finite number\n"


def test_ab_dashboard_reads_one_source_and_counts_each_request_once() -> None:
    """The gateway and the load tester export the same families: `Source` is one job, never All; the heatmap's
    cells are rates (an increase over windows that overlap from step to step counts a request in several)."""
    board = ab.build()
    variables = {v["name"]: v for v in board.to_json()["templating"]["list"]}
    assert not variables["job"]["multi"] and not variables["job"]["includeAll"]
    assert variables["run"]["query"].startswith("query_result(sort_desc(") and variables["run"]["sort"] == 0
    (heatmap,) = [p for row in board.rows for p in row.panels if p.kind == "heatmap"]
    assert all(t.expr.startswith("sum by (le) (rate(") for t in heatmap.targets)
