"""The "dfserve training" dashboard: a training run's checkpoints as `dfserve eval watch` scores them, read from
the gauges it pushes to a Pushgateway (one group per watch): τ of the latest checkpoint against the baseline's,
the gap, the step scored, and the projection (outcome, crossing step).

The gauges change once per checkpoint, so the panels show their last value over time, not rates.
"""

from __future__ import annotations

from dfserve import metrics as m

from .grafana import Dashboard, Panel, Row, Target, Variable
from .promql import selector

SCOPE = ('watch=~"$watch"', 'method=~"$method"')
LEGEND = "{{watch}} {{method}}"


def _latest(name: str, matchers: tuple[str, ...] = SCOPE) -> str:
    return f"max by (watch, method) ({selector(name, matchers)})"


def build() -> Dashboard:
    return Dashboard(
        uid="dfserve-training",
        title="dfserve training",
        description="Each checkpoint of a training run scored offline against a baseline drafter, and whether the "
                    "run is projected to reach it (dfserve eval watch --pushgateway).",
        variables=(
            Variable("datasource", "Data source"),
            Variable("watch", "Watch", m.EVAL_WATCH_STEP, "watch"),
            Variable("method", "Method", m.EVAL_WATCH_TAU, "method"),
        ),
        rows=(
            Row("Checkpoints against the baseline", (
                Panel("τ: latest checkpoint and baseline", "Offline τ (tokens per verify round) of the latest "
                      "checkpoint scored, and the baseline's on the same features.", (
                          Target(_latest(m.EVAL_WATCH_TAU), LEGEND),
                          Target(_latest(m.EVAL_WATCH_BASELINE_TAU), f"baseline {LEGEND}"),
                      ), width=12),
                Panel("Gap to the baseline", "Latest checkpoint's τ minus the baseline's: negative while below it.",
                      (Target(_latest(m.EVAL_WATCH_TAU_GAP), LEGEND),), width=12),
            )),
            Row("Projection", (
                Panel("Training step scored", "Step of the latest checkpoint scored.",
                      (Target(f"max by (watch) ({selector(m.EVAL_WATCH_STEP, SCOPE[:1])})", "{{watch}}"),),
                      kind="stat", width=6),
                Panel("Projected crossing step", "Where the saturating fit of τ by step reaches the baseline's τ; "
                      "empty when the fit places no crossing.",
                      (Target(_latest(m.EVAL_WATCH_PROJECTED_CROSSING_STEP), LEGEND),), kind="stat", width=6,
                      no_value="none"),
                Panel("Projection outcome", "1 on the current outcome: reached, will_reach, plateau_below (projected "
                      "not to reach the baseline), undetermined, too_few_checkpoints.",
                      (Target(f"max by (watch, method, outcome) ({selector(m.EVAL_WATCH_PROJECTION, SCOPE)}) == 1",
                              "{{watch}} {{method}}: {{outcome}}"),), kind="stat", width=12),
            )),
        ),
        time_from="now-7d",
        refresh="1m",
    )
