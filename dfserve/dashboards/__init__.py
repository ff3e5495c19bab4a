"""Grafana dashboards and Prometheus rules for dfserve, built in code from the metric names in `dfserve.metrics`.

Panels and rules import the name constants, so renaming a metric changes every query that reads it. The committed
files under `dashboards/generated/` are what Grafana and Prometheus load; `dfserve dashboards` rewrites them.
"""
