"""The reports' figures: ticks a reader can trust, and no series drawn invisibly."""

from __future__ import annotations

import re

import pytest

from dfserve.svg import nice_ticks, svg_lines


@pytest.mark.parametrize(("low", "high", "labels"), [
    (0.0, 0.0437, ["0.00", "0.01", "0.02", "0.03", "0.04"]),  # a gridline at 0.035 was labelled 0.04
    (0.0, 28.6, ["0", "5", "10", "15", "20", "25"]),  # 7.14, 14.29, 21, 29 before
    (-10.4, 0.0, ["-10", "-8", "-6", "-4", "-2", "0"]),
    (0.9124, 1.0, ["0.92", "0.94", "0.96", "0.98", "1.00"]),
    (0.0, 2.2, ["0.0", "0.5", "1.0", "1.5", "2.0"]),
    (0.0, 140.0, ["0", "25", "50", "75", "100", "125"]),  # not 25.0
    (0.0, 14.0, ["0.0", "2.5", "5.0", "7.5", "10.0", "12.5"]),
    (-0.05, 0.05, ["-0.04", "-0.02", "0.00", "0.02", "0.04"]),
])
def test_ticks_sit_at_round_values_labelled_as_drawn(low: float, high: float, labels: list[str]) -> None:
    ticks = nice_ticks(low, high)
    assert [label for _, label in ticks] == labels
    assert all(low <= value <= high and abs(value - float(label)) < 1e-9 for value, label in ticks)


def test_a_flat_range_has_one_tick() -> None:
    assert nice_ticks(3.0, 3.0) == [(3.0, "3")]
    assert nice_ticks(0.0, 5e-324) == [(0.0, "0")]  # a span below any step: log10 of 0 raised
    assert nice_ticks(1e9, 1e9 + 1e-4) == [(1e9, "1e+09")]


def test_a_series_of_one_point_is_drawn_as_a_dot() -> None:
    figure = svg_lines("accuracy", {"a": [0.5, 0.4, 0.3], "b": [0.2, None, None]}, "position", "share")
    assert len(re.findall(r"<polyline ", figure)) == 1 and len(re.findall(r'<circle [^>]*fill="#d62728"', figure)) == 1
