"""The projection on synthetic τ curves with a known answer, noisy ones included: it must neither call a plateau
while the run is still rising nor promise a crossing beyond what the points show."""

from __future__ import annotations

import numpy as np
import pytest

from dfserve.eval.projection import project


def saturating(a: float, b: float, c: float, steps: np.ndarray, noise: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return a - b * np.exp(-steps / c) + rng.normal(0, noise, len(steps))


STEPS = np.arange(200, 2001, 200, dtype=float)


def test_a_curve_heading_above_the_baseline_is_projected_to_cross_it_where_it_does() -> None:
    crossing = 800 * np.log(9 / 0.5)  # τ(s) = 10 - 9 exp(-s/800) meets 9.5 at s ≈ 2312
    covered = 0
    for seed in range(10):
        p = project(STEPS, saturating(10, 9, 800, STEPS, 0.05, seed), baseline_tau=9.5)
        assert p.outcome == "will_reach", p.detail
        assert p.crossing_low is not None and p.crossing_high is not None and p.crossing_step is not None
        assert p.crossing_low <= p.crossing_step <= p.crossing_high < 2 * crossing
        assert p.asymptote_low is not None and p.asymptote_low > 9.5
        covered += p.crossing_low <= crossing <= p.crossing_high
    assert covered >= 8


def test_a_run_levelling_off_below_the_baseline_is_called_a_plateau_with_its_level() -> None:
    steps = np.arange(250, 5001, 500, dtype=float)
    for seed in range(5):
        p = project(steps, saturating(7, 5, 500, steps, 0.05, seed), baseline_tau=9.0)
        assert p.outcome == "plateau_below", p.detail
        assert p.asymptote_low is not None and p.asymptote_high is not None
        assert p.asymptote_low <= 7.0 + 0.2 and p.asymptote_high >= 7.0 - 0.2 and p.asymptote_high < 9.0
        assert p.crossing_high is None  # never reaches it


@pytest.mark.parametrize("noise", [0.02, 0.2])
def test_a_run_early_in_a_long_rise_is_neither_a_plateau_nor_a_promised_crossing(noise: float) -> None:
    """τ(s) = 10 - 9 exp(-s/3000) seen up to step 800: it will pass 9 near step 6600, far beyond what 8 points
    rising almost in a straight line can tell."""
    steps = np.arange(100, 801, 100, dtype=float)
    outcomes = {project(steps, saturating(10, 9, 3000, steps, noise, seed), baseline_tau=9.0).outcome
                for seed in range(20)}
    assert outcomes == {"undetermined"}


def test_a_straight_rise_has_no_asymptote() -> None:
    p = project(STEPS, 1 + STEPS / 500, baseline_tau=9.0)
    assert p.outcome == "undetermined" and p.asymptote_high is None


def test_nothing_is_said_on_too_few_checkpoints_and_reaching_is_measured_not_fitted() -> None:
    few = project(STEPS[:4], saturating(7, 5, 500, STEPS[:4], 0.0, 0), baseline_tau=9.0)
    assert few.outcome == "too_few_checkpoints" and few.asymptote is None and few.crossing_step is None
    reached = project([100, 200, 300], [8.0, 9.2, 9.4], baseline_tau=9.1)
    assert reached.outcome == "reached" and reached.crossing_step == 200


def test_each_points_own_error_widens_the_interval() -> None:
    taus = saturating(7, 5, 500, np.arange(250, 5001, 500, dtype=float), 0.02, 0)
    steps = np.arange(250, 5001, 500, dtype=float)
    tight = project(steps, taus, baseline_tau=9.0)
    loose = project(steps, taus, baseline_tau=9.0, tau_se=[1.0] * len(steps))
    assert tight.asymptote_low is not None and tight.asymptote_high is not None
    assert loose.outcome != "plateau_below" or (
        loose.asymptote_high is not None and loose.asymptote_low is not None
        and loose.asymptote_high - loose.asymptote_low > tight.asymptote_high - tight.asymptote_low)
