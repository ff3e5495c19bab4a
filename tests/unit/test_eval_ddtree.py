"""DDTree on constructed distributions with known trees, and against an exhaustive search of the best prefixes."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dfserve.eval.ddtree import DraftTree, build_tree, walk


def distributions(probs: list[list[float]], first_token: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Per-depth top-k log-probabilities from explicit probabilities (rank r at depth d is token first + 10d + r)."""
    logprobs = np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)
    ids = np.array([[first_token + 10 * d + r for r in range(len(row))] for d, row in enumerate(probs)])
    return logprobs, ids


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every node as its token path from the root."""
    found = set()
    for index in range(1, len(tree.tokens) + 1):
        path = []
        node = index
        while node:
            path.append(tree.tokens[node - 1])
            node = tree.parents[node - 1]
        found.add(tuple(reversed(path)))
    return found


def test_peaked_marginals_give_a_chain_of_the_budget() -> None:
    logprobs, ids = distributions([[0.97, 0.02, 0.01]] * 7)
    tree = build_tree(logprobs, ids, budget=4)
    assert tree.depths == (1, 2, 3, 4) and tree.parents == (0, 1, 2, 3)
    top1 = [int(ids[d, 0]) for d in range(7)]
    assert walk(tree, top1) == 4  # τ = budget + 1
    assert walk(build_tree(logprobs, ids, budget=30), top1) == 7  # capped by the block: B - 1 drafts


def test_a_close_second_at_position_one_enters_the_tree_before_a_deeper_first() -> None:
    """log 0.4 beats log 0.5 + log 0.7: the rank-1 sibling is the second node, so a reference taking it is accepted."""
    logprobs, ids = distributions([[0.5, 0.4, 0.1], [0.7, 0.2, 0.1], [0.7, 0.2, 0.1]])
    tree = build_tree(logprobs, ids, budget=2)
    assert paths(tree) == {(100,), (101,)}
    assert walk(tree, [101, 110, 120]) == 1
    assert walk(tree, [100, 110, 120]) == 1  # the chain stops at the budget
    assert walk(build_tree(logprobs, ids, budget=3), [100, 110, 120]) == 2


def test_budget_zero_accepts_nothing_and_a_miss_at_the_root_accepts_nothing() -> None:
    logprobs, ids = distributions([[0.6, 0.4]] * 3)
    assert walk(build_tree(logprobs, ids, budget=0), [100, 110, 120]) == 0
    assert walk(build_tree(logprobs, ids, budget=6), [999, 110, 120]) == 0


@pytest.mark.parametrize("seed", range(6))
def test_the_tree_holds_exactly_the_best_prefixes(seed: int) -> None:
    """Exhaustive check: the nodes are the `budget` highest-scoring rank tuples (score = sum of log-probabilities),
    closed under parents, each (parent, token) once, every parent one level up."""
    rng = np.random.default_rng(seed)
    depth, topk, budget = 4, 3, 9
    raw = rng.dirichlet(np.ones(8), size=depth)
    probs = -np.sort(-raw, axis=1)[:, :topk]
    logprobs, ids = distributions(probs.tolist())
    tree = build_tree(logprobs, ids, budget)
    prefixes = [ranks for length in range(1, depth + 1) for ranks in itertools.product(range(topk), repeat=length)]
    scored = sorted(prefixes, key=lambda r: -sum(math.log(probs[d, k]) for d, k in enumerate(r)))
    best = {tuple(int(ids[d, k]) for d, k in enumerate(r)) for r in scored[:budget]}
    assert paths(tree) == best
    assert len(tree.tokens) == budget
    for index, (parent, depth_of) in enumerate(zip(tree.parents, tree.depths, strict=True), start=1):
        assert depth_of == (tree.depths[parent - 1] + 1 if parent else 1)
        assert tree.children[parent][tree.tokens[index - 1]] == index


def test_node_count_is_the_budget_or_every_prefix() -> None:
    logprobs, ids = distributions([[0.6, 0.4]] * 2)
    assert len(build_tree(logprobs, ids, budget=100).tokens) == 2 + 4  # top-2 at two depths: 2 + 2·2 prefixes
