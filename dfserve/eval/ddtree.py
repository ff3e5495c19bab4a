"""DDTree on one drafted block: the best-first draft tree of a node budget, and how far a greedy reference walks it.

The rules are those of the reference implementation (liranringel/ddtree, `build_ddtree_tree` and
`follow_verified_tree`): a node is a tuple of ranks, one per depth, scored by the sum of the drafter's per-position
log-probabilities (temperature 1, even for greedy decoding); the `budget` best prefixes become nodes, popped from a
heap ordered by score and then by the rank tuple; each position keeps its top `min(budget, vocab)` tokens. With a
greedy reference the verifier walks the tree along the reference only, so the accepted drafts are the longest
prefix of the reference that is a path from the root::

    tree = build_tree(top_logprobs, top_ids, budget=8)
    accepted = walk(tree, reference)        # τ of the round = accepted + 1 (the bonus token)
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True)
class DraftTree:
    """Node 0 is the root (the last verified token); node i > 0 holds `tokens[i - 1]` under `parents[i - 1]`."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    children: tuple[dict[int, int], ...]


def build_tree(top_logprobs: NDArray[np.float32], top_ids: NDArray[np.int64], budget: int) -> DraftTree:
    """The tree of `budget` non-root nodes from per-position top-k log-probabilities and token ids (depth x rank,
    ranks sorted best first; at least `min(budget, vocab)` ranks per position)."""
    depth_limit = top_logprobs.shape[0]
    if budget <= 0 or depth_limit == 0:
        return DraftTree((), (), (), ({},))
    topk = min(budget, top_logprobs.shape[1])
    logprobs = top_logprobs[:, :topk].astype(np.float64)
    first = float(logprobs[0, 0])
    heap: list[tuple[float, tuple[int, ...], int, int, int, float]] = [(-first, (0,), 0, 1, 0, first)]
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    children: list[dict[int, int]] = [{}]
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        token = int(top_ids[depth - 1, rank])
        index = len(tokens) + 1
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
        children.append({})
        children[parent][token] = index
        if rank + 1 < topk:
            sibling = logw - float(logprobs[depth - 1, rank]) + float(logprobs[depth - 1, rank + 1])
            heapq.heappush(heap, (-sibling, (*ranks[:-1], rank + 1), parent, depth, rank + 1, sibling))
        if depth < depth_limit:
            child = logw + float(logprobs[depth, 0])
            heapq.heappush(heap, (-child, (*ranks, 0), index, depth + 1, 0, child))
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths), tuple(children))


def walk(tree: DraftTree, reference: Sequence[int]) -> int:
    """Drafts accepted when the verifier's greedy choices are `reference` (the tokens after the root, in order)."""
    node = 0
    accepted = 0
    for token in reference:
        following = tree.children[node].get(int(token))
        if following is None:
            break
        node = following
        accepted += 1
    return accepted
