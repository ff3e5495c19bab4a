"""Acceptance model: how many drafts one verify round accepts, and what that means for a request. Pure and seeded.

A prompt's difficulty (a number in [0, 1) taken from a hash of the prompt) is the same for every drafter, so an easy
task is easy for all of them. It raises each conditional probability to the power ``2 ** (2 * difficulty - 1)``
(between 0.5 and 2): easy prompts accept longer runs, hard ones shorter.

    >>> model = RoundModel.build(load_profile("zlab"), difficulty=0.5)
    >>> 8 < model.expected_tokens < 10
    True
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from dataclasses import dataclass, field

import numpy as np

from dfserve.deploy.sim.profiles import DrafterProfile


def prompt_difficulty(prompt: str) -> float:
    """A stable number in [0, 1) for a prompt; the same prompt is equally hard for every drafter and every run."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8, person=b"difficulty").digest()
    return int.from_bytes(digest, "big") / 2**64


def difficulty_exponent(difficulty: float) -> float:
    return float(2 ** (2 * difficulty - 1))


@dataclass(frozen=True)
class RoundModel:
    """One prompt's acceptance under one drafter: survival S_j = P(at least j drafts accepted), j = 1..B-1."""

    block_size: int
    survival: tuple[float, ...]
    _thresholds: list[float] = field(init=False, repr=False, compare=False)

    @classmethod
    def build(cls, profile: DrafterProfile, difficulty: float) -> RoundModel:
        exponent = difficulty_exponent(difficulty)
        survival = np.cumprod(np.asarray(profile.conditional_accept, dtype=float) ** exponent)
        return cls(block_size=profile.block_size, survival=tuple(float(s) for s in survival))

    def __post_init__(self) -> None:
        # Ascending thresholds for bisect: the number of S_j > u is the number of -S_j < -u.
        object.__setattr__(self, "_thresholds", [-s for s in self.survival])

    def sample_accepted(self, rng: random.Random) -> int:
        """Accepted drafts in one round (0..B-1), from one uniform draw by inverting the survival function."""
        return bisect.bisect_left(self._thresholds, -rng.random())

    @property
    def expected_tokens(self) -> float:
        """Expected tokens per round, bonus included: 1 + Σ_j S_j."""
        return 1.0 + sum(self.survival)

    def token_distribution(self) -> np.ndarray:
        """P(round emits t tokens) for t = 1..B, as an array indexed t-1."""
        survival = np.concatenate(([1.0], np.asarray(self.survival), [0.0]))
        return survival[:-1] - survival[1:]


def request_accept_length_moments(model: RoundModel, completion_tokens: int) -> tuple[float, float]:
    """Mean and variance of one request's `completion_tokens / spec_verify_ct` when it generates exactly
    `completion_tokens` tokens: the first comes from prefill, the rest from verify rounds, the last round truncated.

    Exact (a dynamic programme over tokens still to generate), so tests can put a confidence interval on a sample.
    """
    remaining = completion_tokens - 1
    if remaining <= 0:
        raise ValueError("a request needs at least one verify round: completion_tokens >= 2")
    step = model.token_distribution()
    alive = np.zeros(remaining)
    alive[0] = 1.0  # index n: n tokens produced after prefill and still short of `remaining`
    mean = second = 0.0
    rounds = 0
    while alive.sum() > 1e-15:
        rounds += 1
        moved = np.convolve(alive, step)  # index n + t - 1 holds mass that now has n + t tokens
        produced = np.concatenate(([0.0], moved))
        finished = float(produced[remaining:].sum())
        alive = produced[:remaining]
        ratio = completion_tokens / rounds
        mean += finished * ratio
        second += finished * ratio * ratio
    return mean, second - mean * mean


def confidence_interval(means: list[float], variances: list[float], z: float = 1.96) -> tuple[float, float]:
    """Interval for the sample mean of independent requests with the given exact means and variances."""
    n = len(means)
    centre = sum(means) / n
    half = z * math.sqrt(sum(variances)) / n
    return centre - half, centre + half
