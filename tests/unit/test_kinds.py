"""The metric kinds and the task sources are entries at a seam: every one in use is an entry, and an unknown one is
refused by name."""

from __future__ import annotations

import pytest

from dfserve.capture import replay
from dfserve.eval.verdict import metrics_of
from dfserve.loadtest.judge import METRICS
from dfserve.tasks import SOURCES, _source
from dfserve.verdict.kinds import KINDS, kind_of
from dfserve.verdict.pairs import MetricSpec


def test_every_metric_in_use_is_of_a_registered_kind() -> None:
    specs = [*METRICS.values(), *metrics_of(["dflash"]).values()]
    assert {spec.kind for spec in specs} == set(KINDS)
    assert all(kind_of(spec) is KINDS[spec.kind] for spec in specs)


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="τ: unknown metric kind 'mean' \\(known: ratio, quantile, error_rate, identical\\)"):
        kind_of(MetricSpec("τ", "mean"))


def test_every_task_source_resolves_and_capture_is_read_by_the_capture_package() -> None:
    assert SOURCES["capture:"].startswith("dfserve.capture.replay:")
    assert replay.PREFIX == "capture:"
    assert _source(SOURCES["capture:"]) is replay.load_capture_tasks
    assert all(callable(_source(loader)) for loader in SOURCES.values())
