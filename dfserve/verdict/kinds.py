"""The metric kinds: what each design computes for a `MetricSpec` of each kind, one entry per kind.

The fixed-n design reads a kind's `statistic` (`bootstrap.py`), the sequential design feeds its `track`
(`tracks.py`), and a gate rule on it takes the limit named by `limit`. A new kind is a new entry here; neither
design asks which kind it holds.

    kind = kind_of(spec)
    result = kind.statistic(name, spec, pairs, weights)
    track = kind.track(spec, rule.limit, task_count)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from dfserve.verdict import bootstrap
from dfserve.verdict.pairs import MetricSpec, Pairs
from dfserve.verdict.results import Lossless, MetricResult
from dfserve.verdict.tracks import ErrorTrack, LosslessTrack, QuantileTrack, RatioTrack, Track


@dataclass(frozen=True)
class Kind:
    """`statistic`: the fixed-n change (or identical fraction) with its interval; `track`: the sequential running
    sums, given the spec, the rule's limit and the task set's size; `relative`: whether the change is relative."""

    statistic: Callable[[str, MetricSpec[Any], Pairs[Any], NDArray[np.float64]], MetricResult | Lossless]
    track: Callable[[MetricSpec[Any], float, int], Track[Any]]
    limit: Literal["max_worse", "at_least"] = "max_worse"
    relative: bool = True
    vacuous: Callable[[MetricSpec[Any], float], bool] = lambda spec, limit: False
    """A limit no candidate can miss on a metric: a gate rule with it would judge nothing."""


def _fall_whole(spec: MetricSpec[Any], limit: float) -> bool:
    """A relative limit of 1 or more on a metric where higher is better: a value of 0 or more falls by all of itself
    at most (one where lower is better may rise without bound)."""
    return spec.higher_is_better and limit >= 1


KINDS: Mapping[str, Kind] = {
    "ratio": Kind(bootstrap.ratio, RatioTrack, vacuous=_fall_whole),
    "quantile": Kind(bootstrap.quantile, lambda spec, limit, tasks: QuantileTrack(spec), vacuous=_fall_whole),
    "error_rate": Kind(bootstrap.error_rate, lambda spec, limit, tasks: ErrorTrack(limit, tasks), relative=False,
                       vacuous=lambda spec, limit: limit >= 1),  # a rate rises by 1 at most
    "identical": Kind(lambda name, spec, pairs, weights: bootstrap.identical(spec, pairs),
                      lambda spec, limit, tasks: LosslessTrack(spec), limit="at_least", relative=False,
                      vacuous=lambda spec, limit: limit <= 0),
}


def kind_of(spec: MetricSpec[Any]) -> Kind:
    try:
        return KINDS[spec.kind]
    except KeyError:
        raise ValueError(f"{spec.label}: unknown metric kind {spec.kind!r} (known: {', '.join(KINDS)})") from None
