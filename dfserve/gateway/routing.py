"""Which arm serves a request, and which replica of it: pure functions over weights, keys and health.

- split: a weighted random choice with an injected, seeded `random.Random`;
- sticky: weighted rendezvous hashing of a routing key, so one conversation always lands on one arm, the shares
  still follow the weights, and changing a weight moves only the keys it must; a request without a key has no
  conversation to keep and is split at random by weight;
- shadow: the primary arm serves, the others receive a mirrored copy (the caller skips, and counts, mirrors to arms
  that are down).

An arm with no healthy replica is "down": with `shed` its share goes to the arms that are up, otherwise the request
is still routed to it and answered 503, so an outage is visible instead of silently skewing the split.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate


class UnknownArm(ValueError):
    """A request pinned itself to an arm the config does not have."""


@dataclass(frozen=True)
class Decision:
    """Where one request goes: the arm that answers the client, and arms that get a mirrored copy."""

    arm: str
    mirrors: tuple[str, ...] = ()


class WeightedChoice:
    """A weighted random choice among names, with the cumulative table built once."""

    def __init__(self, weights: Mapping[str, float]) -> None:
        self._names = [name for name, weight in weights.items() if weight > 0]
        if not self._names:
            raise ValueError("no arm has a positive weight")
        self._cumulative = list(accumulate(weights[name] for name in self._names))

    def choose(self, rng: random.Random) -> str:
        point = rng.random() * self._cumulative[-1]
        return self._names[min(bisect.bisect_right(self._cumulative, point), len(self._names) - 1)]


def _unit_hash(key: str, name: str) -> float:
    """A stable hash of (key, arm) in (0, 1): the same on every host and every process, for any key a client's JSON
    can spell (a lone surrogate escape included)."""
    digest = hashlib.blake2b(f"{name}\x00{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 1) / (2**64 + 1)


def sticky_choice(key: str, weights: Mapping[str, float]) -> str:
    """Weighted rendezvous hashing: the arm with the highest `-weight / ln(h(key, arm))` wins.

    Each arm wins a share of keys equal to its share of the weights; an arm's weight change only moves keys to or
    from that arm.
    """
    best_name, best_score = None, -math.inf
    for name, weight in weights.items():
        if weight <= 0:
            continue
        score = -weight / math.log(_unit_hash(key, name))
        if score > best_score:
            best_name, best_score = name, score
    if best_name is None:
        raise ValueError("no arm has a positive weight")
    return best_name


class Router:
    """Routing decisions for one routing config; rebuilt (not mutated) when the admin API replaces the config."""

    def __init__(
        self,
        mode: str,
        weights: Mapping[str, float],
        *,
        primary: str | None = None,
        shadow_fraction: float = 1.0,
        shed: bool = False,
    ) -> None:
        self.mode = mode
        self.weights = dict(weights)
        self.primary = primary
        self.shadow_fraction = shadow_fraction
        self.shed = shed
        self._choice = WeightedChoice(weights) if mode != "shadow" else None

    def decide(
        self, rng: random.Random, key: str | None = None, down: frozenset[str] = frozenset(), pinned: str | None = None
    ) -> Decision:
        """Pick the arm for one request. `down` names arms that have no healthy replica right now.

        A `pinned` arm (the client's `x-dfserve-arm` header) wins in every mode, weight 0 included, and is never
        mirrored: a paired load test sends each request to the arm it measures, while live traffic keeps its split.
        """
        if pinned is not None:
            if pinned not in self.weights:
                raise UnknownArm(f"x-dfserve-arm: no arm named {pinned!r} (arms: {', '.join(self.weights)})")
            return Decision(pinned)
        if self.mode == "shadow":
            assert self.primary is not None
            mirror = rng.random() < self.shadow_fraction
            others = tuple(name for name in self.weights if name != self.primary)
            return Decision(self.primary, others if mirror else ())
        weights = self.weights
        if self.shed and down:
            up = {name: w for name, w in weights.items() if name not in down}
            if any(w > 0 for w in up.values()):
                weights = up
        if self.mode == "sticky" and key is not None:
            return Decision(sticky_choice(key, weights))
        if weights is self.weights:
            assert self._choice is not None
            return Decision(self._choice.choose(rng))
        return Decision(WeightedChoice(weights).choose(rng))


    def sole_arm(self) -> str | None:
        """The arm every unpinned request is answered by, if there is one: the primary in shadow mode, else the only
        arm with a weight above 0; None while traffic is split between arms."""
        if self.mode == "shadow":
            return self.primary
        serving = [name for name, weight in self.weights.items() if weight > 0]
        return serving[0] if len(serving) == 1 else None


def pick_replica(in_flight: Sequence[int], healthy: Sequence[bool], exclude: frozenset[int], start: int) -> int | None:
    """The healthy, not yet tried replica with the fewest requests in flight; ties go round-robin from `start`."""
    n = len(in_flight)
    best, best_load = None, math.inf
    for offset in range(n):
        index = (start + offset) % n
        if healthy[index] and index not in exclude and in_flight[index] < best_load:
            best, best_load = index, in_flight[index]
    return best
