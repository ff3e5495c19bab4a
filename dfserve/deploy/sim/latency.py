"""Latency model: how long a prefill step and a verify round take, with seeded jitter and a time scale.

Defaults are a rough estimate for Qwen3.6-27B in bf16 on one RTX PRO 6000 (about 1.8 TB/s, a few hundred dense
bf16 TFLOP/s): reading 54 GB of weights costs ~27 ms per forward at any batch; each verified token adds ~0.18 ms of
compute (2 × 27e9 FLOP at ~300 TFLOP/s). A verify round of one request with a block of 16 thus takes ~30 ms, and
48 running requests take ~165 ms. Prefill runs as its own step (DFlash disables mixed chunked prefill in SGLang).

    >>> LatencyModel(LatencyParams(jitter=0), time_scale=1, rng=random.Random(0)).round_s(running=1, block=16)
    0.02988
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyParams:
    """Seconds at time scale 1."""

    round_fixed_s: float = 0.027
    round_per_token_s: float = 0.00018
    prefill_fixed_s: float = 0.027
    prefill_per_token_s: float = 0.00018
    jitter: float = 0.03
    """Standard deviation of the log of a multiplicative jitter factor (0 turns jitter off)."""


class LatencyModel:
    """Durations of the scheduler's steps; every random draw comes from the injected generator."""

    def __init__(self, params: LatencyParams, time_scale: float, rng: random.Random) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.params = params
        self.time_scale = time_scale
        self._rng = rng

    def _jittered(self, seconds: float) -> float:
        sigma = self.params.jitter
        factor = math.exp(self._rng.gauss(-sigma * sigma / 2, sigma)) if sigma > 0 else 1.0
        return round(seconds * factor * self.time_scale, 9)

    def prefill_s(self, prompt_tokens: int) -> float:
        """One prefill step over a batch holding `prompt_tokens` uncached prompt tokens in all."""
        p = self.params
        return self._jittered(p.prefill_fixed_s + p.prefill_per_token_s * prompt_tokens)

    def round_s(self, running: int, block: int) -> float:
        """One verify round of `running` requests, each verifying `block` tokens (1 without speculation)."""
        p = self.params
        return self._jittered(p.round_fixed_s + p.round_per_token_s * running * block)
