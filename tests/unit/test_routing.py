"""Routing choices: weighted split within binomial bounds, sticky keys stable and weighted, shadow pairing, shedding,
and which arms are down."""

from __future__ import annotations

import math
import random
from typing import cast

import httpx
import pytest
from prometheus_client import CollectorRegistry

from dfserve.gateway.config import ArmConfig, HealthConfig, Limits
from dfserve.gateway.routing import Decision, Router, UnknownArm, WeightedChoice, pick_replica, sticky_choice
from dfserve.gateway.upstream import Upstream
from dfserve.metrics import DfserveMetrics


def within_binomial(count: int, n: int, p: float, z: float = 4.0) -> bool:
    return abs(count - n * p) <= z * math.sqrt(n * p * (1 - p))


def test_weighted_choice_follows_weights() -> None:
    rng = random.Random(1)
    choice = WeightedChoice({"baseline": 90, "candidate": 10, "off": 0})
    picks = [choice.choose(rng) for _ in range(20_000)]
    assert "off" not in picks
    assert within_binomial(picks.count("candidate"), len(picks), 0.1)


def test_weighted_choice_is_reproducible_with_a_seed() -> None:
    choice = WeightedChoice({"a": 1, "b": 1})
    assert [choice.choose(random.Random(7)) for _ in range(5)] == [choice.choose(random.Random(7)) for _ in range(5)]


def test_no_positive_weight_is_refused() -> None:
    with pytest.raises(ValueError):
        WeightedChoice({"a": 0})


def test_a_sticky_key_with_a_lone_surrogate_is_routed() -> None:
    """A client's JSON may escape a lone surrogate in `user`: the key is hashed, not refused with a 500."""
    weights = {"a": 1.0, "b": 1.0}
    assert sticky_choice("\ud800", weights) == sticky_choice("\ud800", weights) in weights
    assert {sticky_choice(f"\ud800{i}", weights) for i in range(64)} == {"a", "b"}


def test_sticky_keys_are_stable_and_shares_follow_weights() -> None:
    weights = {"baseline": 75, "candidate": 25}
    keys = [f"user-{i}" for i in range(8000)]
    first = [sticky_choice(k, weights) for k in keys]
    assert first == [sticky_choice(k, dict(reversed(weights.items()))) for k in keys]
    assert within_binomial(first.count("candidate"), len(keys), 0.25)


def test_sticky_weight_change_moves_only_the_keys_it_must() -> None:
    keys = [f"conv-{i}" for i in range(5000)]
    before = {k: sticky_choice(k, {"a": 50, "b": 50}) for k in keys}
    after = {k: sticky_choice(k, {"a": 50, "b": 50, "c": 25}) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "c" for k in moved), "keys only move to the new arm"
    assert within_binomial(len(moved), len(keys), 0.2)


def test_router_sticky_uses_key_and_falls_back_to_a_weighted_split_without_one() -> None:
    weights = {"a": 3, "b": 1}
    router = Router("sticky", weights)
    rng = random.Random(3)
    assert {router.decide(rng, "k1").arm for _ in range(50)} == {sticky_choice("k1", weights)}
    keyed = [router.decide(rng, f"user-{i}").arm for i in range(4000)]
    assert within_binomial(keyed.count("b"), len(keyed), 0.25)
    unkeyed = [router.decide(rng).arm for _ in range(4000)]
    assert within_binomial(unkeyed.count("b"), len(unkeyed), 0.25)


def test_shadow_serves_primary_and_mirrors_the_rest() -> None:
    router = Router("shadow", {"baseline": 1, "candidate": 1, "other": 1}, primary="baseline")
    assert router.decide(random.Random(0)) == Decision("baseline", ("candidate", "other"))
    sampled = Router("shadow", {"baseline": 1, "candidate": 1}, primary="baseline", shadow_fraction=0.25)
    rng = random.Random(5)
    mirrored = sum(bool(sampled.decide(rng).mirrors) for _ in range(4000))
    assert within_binomial(mirrored, 4000, 0.25)


def test_down_arm_keeps_its_share_unless_shedding() -> None:
    rng = random.Random(2)
    down = frozenset({"candidate"})
    strict = Router("split", {"baseline": 90, "candidate": 10})
    picks = [strict.decide(rng, down=down).arm for _ in range(4000)]
    assert within_binomial(picks.count("candidate"), len(picks), 0.1)
    shed = Router("split", {"baseline": 90, "candidate": 10}, shed=True)
    assert {shed.decide(rng, down=down).arm for _ in range(500)} == {"baseline"}
    sticky = Router("sticky", {"baseline": 90, "candidate": 10}, shed=True)
    assert {sticky.decide(rng, f"k{i}", down=down).arm for i in range(500)} == {"baseline"}
    everything_down = frozenset({"baseline", "candidate"})
    assert {shed.decide(rng, down=everything_down).arm for _ in range(500)} == {"baseline", "candidate"}


def test_pick_replica_least_loaded_healthy_untried() -> None:
    assert pick_replica([3, 1, 1], [True, True, True], frozenset(), 0) == 1
    assert pick_replica([3, 1, 1], [True, True, True], frozenset(), 2) == 2
    assert pick_replica([0, 1, 1], [False, True, True], frozenset({1}), 0) == 2
    assert pick_replica([0, 0], [False, True], frozenset({1}), 0) is None


@pytest.mark.parametrize("mode", ["split", "sticky", "shadow"])
def test_a_pinned_arm_wins_in_every_mode_even_at_weight_zero(mode: str) -> None:
    router = Router(mode, {"baseline": 100, "candidate": 0}, primary="baseline")
    rng = random.Random(3)
    assert {router.decide(rng, "user-1", pinned="candidate") for _ in range(50)} == {Decision("candidate")}


def test_pinning_an_unknown_arm_is_refused() -> None:
    router = Router("split", {"baseline": 1, "candidate": 1})
    with pytest.raises(UnknownArm, match="no arm named 'other'"):
        router.decide(random.Random(0), pinned="other")


def test_the_arms_down_follow_every_change_of_replica_health() -> None:
    """Ejection, re-admission and a new set of arms each show in `Upstream.down()`."""
    arms = {"a": ArmConfig(replicas=("http://127.0.0.1:1", "http://127.0.0.1:2"), weight=1),
            "b": ArmConfig(replicas=("http://127.0.0.1:3",), weight=1)}
    upstream = Upstream(cast(httpx.AsyncClient, None), arms, Limits(), HealthConfig(eject_after_failures=1),
                        DfserveMetrics.build(CollectorRegistry()))
    a, b = upstream.arms["a"], upstream.arms["b"]
    assert upstream.down() == frozenset()
    upstream._failed(a, a.replicas[0], "connect")
    assert upstream.down() == frozenset()  # one replica of a is still up
    upstream._failed(a, a.replicas[1], "health")  # the last healthy replica: only a health check ejects it
    upstream._failed(b, b.replicas[0], "health")
    assert upstream.down() == {"a", "b"}
    upstream._succeeded(a, a.replicas[1])
    assert upstream.down() == {"b"}
    upstream.set_arms({"a": arms["a"]})  # b is gone, a keeps its replicas' state
    assert upstream.down() == frozenset()
    upstream._failed(upstream.arms["a"], upstream.arms["a"].replicas[1], "health")
    assert upstream.down() == {"a"}


def test_the_sole_arm_is_the_one_unpinned_traffic_goes_to() -> None:
    assert Router("split", {"baseline": 90, "candidate": 10}).sole_arm() is None
    assert Router("split", {"baseline": 100, "candidate": 0}).sole_arm() == "baseline"
    assert Router("sticky", {"baseline": 0, "candidate": 1}).sole_arm() == "candidate"
    assert Router("shadow", {"baseline": 1, "candidate": 1}, primary="candidate").sole_arm() == "candidate"
