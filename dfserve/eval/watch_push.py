"""The watch's trend pushed to a Prometheus Pushgateway after each checkpoint it scores, as the gauges of
`dfserve.metrics.EvalWatchMetrics`, grouped by the watch's name (a push replaces the group's previous one)::

    push_trend("http://pushgateway:9091", "qwen-drafter-run7", trend)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, push_to_gateway

from dfserve.errors import FieldError
from dfserve.eval.trend import Trend
from dfserve.metrics import EVAL_WATCH_OUTCOMES, EvalWatchMetrics

PUSH_JOB = "dfserve_eval_watch"


def trend_registry(trend: Trend) -> CollectorRegistry:
    """The gauges of the trend's latest point and its projections (nothing for a trend with no point yet)."""
    registry = CollectorRegistry()
    metrics = EvalWatchMetrics.build(registry)
    if not trend.points:
        return registry
    latest = trend.points[-1]
    metrics.step.set(latest.step)
    for method in trend.methods:
        tau, baseline = latest.tau[method].estimate, trend.baseline.tau[method].estimate
        metrics.tau.labels(method).set(tau)
        metrics.baseline_tau.labels(method).set(baseline)
        metrics.tau_gap.labels(method).set(tau - baseline)
        projection = trend.projections[method]
        if projection.crossing_step is not None:
            metrics.projected_crossing_step.labels(method).set(projection.crossing_step)
        for outcome in EVAL_WATCH_OUTCOMES:
            metrics.projection.labels(method, outcome).set(1.0 if projection.outcome == outcome else 0.0)
    return registry


def push_trend(url: str, watch: str, trend: Trend) -> None:
    try:
        push_to_gateway(url, job=PUSH_JOB, registry=trend_registry(trend), grouping_key={"watch": watch}, timeout=10)
    except OSError as exc:
        raise FieldError("pushgateway", f"push to {url} failed ({exc})") from None
