"""Confidence sequences on their own: exact boundaries, coverage at every look at once, and why peeking at fixed-n
intervals is not enough."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from dfserve.verdict import confseq, stats


def test_the_mixture_radius_is_where_the_mixed_likelihood_ratio_reaches_one_over_alpha() -> None:
    se, scale, alpha = 0.004, 0.02, 0.05
    radius = confseq.mixture_radius(se, scale, alpha)
    effects = np.linspace(-12 * scale, 12 * scale, 400_001)
    prior = np.exp(-effects**2 / (2 * scale**2)) / math.sqrt(2 * math.pi * scale**2)
    ratio = np.exp((effects * radius - effects**2 / 2) / se**2)
    assert float(np.sum(prior * ratio) * (effects[1] - effects[0])) == pytest.approx(1 / alpha, rel=1e-4)
    assert 1.96 * se < radius < 4 * se and confseq.mixture_radius(0.0, scale, alpha) == 0.0


def test_proportion_bounds_sit_where_the_evidence_reaches_one_over_alpha() -> None:
    low, high = confseq.proportion_sequence(30, 400, 0.05)
    assert low < 30 / 400 < high
    for p in (low, high):
        log_mixture = (math.lgamma(30.5) + math.lgamma(370.5) - math.lgamma(401)) - (2 * math.lgamma(0.5) - math.lgamma(1))
        evidence = log_mixture - (30 * math.log(p) + 370 * math.log1p(-p))
        assert evidence == pytest.approx(math.log(20), abs=1e-6)
    none_low, none_high = confseq.proportion_sequence(0, 1000, 0.025)
    assert none_low == 0.0 and 0.005 < none_high < 0.01  # no error in 1000 bounds the rate, it does not zero it
    assert confseq.proportion_sequence(0, 0, 0.05) == (0.0, 1.0)


def test_proportion_sequence_covers_the_truth_at_every_look_at_once() -> None:
    rng = random.Random(3)
    missed = 0
    for _ in range(300):
        successes = 0
        for n in range(1, 401):
            successes += rng.random() < 0.05
            if n % 20 == 0:
                low, high = confseq.proportion_sequence(successes, n, 0.1)
                if not low <= 0.05 <= high:
                    missed += 1
                    break
    assert missed / 300 < 0.1  # a fixed-n 90% interval looked at 20 times misses far more often


def test_quantile_sequence_covers_the_true_p95_at_every_look_at_once() -> None:
    rng = np.random.default_rng(5)
    true_p95 = -math.log(0.05)  # exponential(1)
    missed = 0
    for _ in range(300):
        draws = rng.exponential(size=800)
        for n in range(50, 801, 50):
            low, high = confseq.quantile_sequence(np.sort(draws[:n]), 0.95, 0.1)
            if not low <= true_p95 <= high:
                missed += 1
                break
    assert missed / 300 < 0.1
    low, high = confseq.quantile_sequence(np.sort(rng.exponential(size=20)), 0.99, 0.05)
    assert high == math.inf  # twenty draws cannot bound a p99 from above


def test_rank_band_is_wider_than_the_fixed_n_band_and_centred_on_nq() -> None:
    low, high = confseq.rank_band(1000, 0.95, 0.05)
    fixed = 1.96 * math.sqrt(1000 * 0.95 * 0.05)
    assert low < 950 < high and (high - low) / 2 > fixed


def test_quantile_rank_picks_the_quantile_figure() -> None:
    rng = np.random.default_rng(1)
    for n in (1, 7, 100, 999):
        values = np.sort(rng.random(n))
        for q in (0.5, 0.95, 0.99):
            assert values[stats.quantile_rank(n, q)] == stats.quantile(values, q)


def test_the_delta_method_error_of_a_paired_ratio_matches_the_task_bootstrap() -> None:
    rng = np.random.default_rng(2)
    tasks = 300
    tokens = rng.integers(50, 500, size=tasks).astype(float)
    difficulty = rng.uniform(0.7, 1.3, size=tasks)
    rounds_b = tokens / (8.5 * difficulty * np.exp(rng.normal(0, 0.15, tasks)))
    rounds_c = tokens / (8.0 * difficulty * np.exp(rng.normal(0, 0.15, tasks)))
    sums = np.stack([tokens, rounds_b, tokens, rounds_c])
    result = confseq.paired_log_ratio(sums)
    assert result is not None
    log_change, se = result
    assert math.exp(log_change) == pytest.approx(rounds_b.sum() / rounds_c.sum())
    weights = stats.cluster_weights(tasks, 4000, np.random.default_rng(0))
    draws = np.log((weights @ sums[2]) / (weights @ sums[3])) - np.log((weights @ sums[0]) / (weights @ sums[1]))
    assert se == pytest.approx(float(np.std(draws)), rel=0.1)


def _false_fail_rate(radius: object, sequences: int = 300, tasks: int = 1200, look_every: int = 16) -> float:
    """Candidate exactly at the 2% limit, per-task noise of 15%: how often a look ever says FAIL."""
    rng = np.random.default_rng(11)
    limit = 0.02
    fails = 0
    for _ in range(sequences):
        tokens = rng.integers(50, 500, size=tasks).astype(float)
        difficulty = rng.uniform(0.7, 1.3, size=tasks)
        rounds_b = tokens / (8.5 * difficulty * np.exp(rng.normal(0, 0.15, tasks)))
        rounds_c = tokens / (8.5 * (1 - limit) * difficulty * np.exp(rng.normal(0, 0.15, tasks)))
        sums = np.stack([tokens, rounds_b, tokens, rounds_c])
        for n in range(16, tasks + 1, look_every):
            result = confseq.paired_log_ratio(sums[:, :n])
            assert result is not None
            log_change, se = result
            worse_low = -math.expm1(log_change + radius(se))  # type: ignore[operator]
            if worse_low > limit:
                fails += 1
                break
    return fails / sequences


def test_continuous_monitoring_keeps_the_false_fail_rate_with_the_mixture_and_not_with_fixed_n_intervals() -> None:
    sequential = _false_fail_rate(lambda se: confseq.mixture_radius(se, 0.02, 0.05))
    peeking = _false_fail_rate(lambda se: 1.96 * se)
    assert sequential <= 0.05  # nominal 2.5% on this side; the Monte-Carlo error over 300 sequences is about 0.9%
    assert peeking > 2 * max(sequential, 0.025)
