"""From a drafter's scores at every anchor to its records and figures: pure, no torch.

Per anchor: which block positions match the reference, how many drafts each method accepts (vanilla: the leading
matches; DDTree: the reference's walk on the tree of each budget), and, where a method's online trajectory makes a
round, that round's τ. Per drafter: τ = Σ tokens / Σ rounds per method with a 95% bootstrap interval over tasks
(the same resampling `dfserve compare` uses), the per-task τ, the histogram of τ, and the per-position accuracy
over every scored anchor, unconditional and given the earlier positions matched::

    records = anchor_records("zlab", task, tokens, prompt_len, scores, budgets=(4, 8))
    summary = summarize_drafter("zlab", records, task_ids, methods, block_size=16)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from dfserve.eval.ddtree import build_tree, walk
from dfserve.eval.records import (
    VANILLA,
    AnchorRecord,
    DrafterSummary,
    Figure,
    MethodSummary,
    PositionCurve,
    ddtree_method,
)
from dfserve.eval.trajectory import PositionTally, leading_matches, trajectory
from dfserve.verdict import stats

if TYPE_CHECKING:  # scoring needs torch; these figures do not
    from dfserve.eval.scoring import AnchorScores

BOOTSTRAP_DRAWS = 2000


def anchor_records(drafter: str, task: str, tokens: Sequence[int], prompt_len: int, scores: AnchorScores,
                   budgets: Sequence[int]) -> list[AnchorRecord]:
    """One record per scored anchor of one task; `tokens` is prompt + reference, `scores` covers anchors
    `prompt_len .. len(tokens) - 2` in order."""
    last = len(tokens) - 1
    depth = scores.drafts.shape[1]
    methods = [VANILLA, *(ddtree_method(b) for b in budgets)]
    accepted: dict[str, list[int]] = {m: [] for m in methods}
    matches: list[str] = []
    for row, anchor in enumerate(scores.anchors.tolist()):
        reference = list(tokens[anchor + 1:min(anchor + 1 + depth, last + 1)])
        draft = scores.drafts[row].tolist()
        matches.append("".join("1" if d == r else "0" for d, r in zip(draft, reference, strict=False)))
        accepted[VANILLA].append(leading_matches(draft, reference))
        for budget in budgets:
            tree = build_tree(scores.top_logprobs[row], scores.top_ids[row], budget)
            accepted[ddtree_method(budget)].append(walk(tree, reference))
    rounds = {m: {r.anchor: r.tau for r in trajectory(prompt_len, last, accepted[m], offset=prompt_len)}
              for m in methods}
    return [
        AnchorRecord(drafter=drafter, task=task, anchor=anchor, matches=matches[row],
                     accepted={m: accepted[m][row] for m in methods},
                     rounds={m: rounds[m][anchor] for m in methods if anchor in rounds[m]})
        for row, anchor in enumerate(scores.anchors.tolist())
    ]


def method_totals(records: Sequence[AnchorRecord], task_ids: Sequence[str], method: str
                  ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Tokens committed and rounds made by one method's trajectory, per task (in `task_ids` order)."""
    position = {t: i for i, t in enumerate(task_ids)}
    tokens = np.zeros(len(task_ids))
    rounds = np.zeros(len(task_ids))
    for record in records:
        tau = record.rounds.get(method)
        if tau is not None:
            tokens[position[record.task]] += tau
            rounds[position[record.task]] += 1
    return tokens, rounds


def tau_figure(tokens: NDArray[np.float64], rounds: NDArray[np.float64], seed: int = 0) -> Figure:
    """Σ tokens / Σ rounds with its 95% interval from resampling tasks."""
    kept = rounds > 0
    tokens, rounds = tokens[kept], rounds[kept]
    if not kept.any():
        return Figure(estimate=float("nan"), low=float("nan"), high=float("nan"), n=0)
    estimate = float(tokens.sum() / rounds.sum())
    weights = stats.cluster_weights(len(tokens), BOOTSTRAP_DRAWS, np.random.default_rng(seed))
    interval = stats.percentile_interval(estimate, stats.weighted_ratio(weights, tokens, rounds), len(tokens))
    return Figure(estimate=estimate, low=interval.low, high=interval.high, n=int(rounds.sum()))


def _method_summary(records: Sequence[AnchorRecord], task_ids: Sequence[str], method: str,
                    block_size: int) -> MethodSummary:
    tokens, rounds = method_totals(records, task_ids, method)
    tau = tau_figure(tokens, rounds)
    histogram = [0] * (block_size + 1)
    capped = 0
    for record in records:
        if (value := record.rounds.get(method)) is not None:
            histogram[value] += 1
            capped += value < record.accepted[method] + 1
    per_task = {t: float(tokens[i] / rounds[i]) for i, t in enumerate(task_ids) if rounds[i]}
    with_rounds = int((rounds > 0).sum())
    return MethodSummary(
        method=method, tau=tau, accepted_drafts=tau.estimate - 1,
        tau_task_mean=float(np.mean(list(per_task.values()))) if per_task else float("nan"),
        tau_as_sglang=float((tokens.sum() + with_rounds) / rounds.sum()) if rounds.sum() else float("nan"),
        tokens=int(tokens.sum()), rounds=int(rounds.sum()), capped_rounds=capped, per_task=per_task,
        histogram=histogram,
    )


def position_curve(records: Sequence[AnchorRecord], positions: int) -> PositionCurve:
    tally = PositionTally.empty(positions)
    for record in records:
        tally.add([m == "1" for m in record.matches])

    def share(hits: list[int], seen: list[int]) -> list[float | None]:
        return [h / s if s else None for h, s in zip(hits, seen, strict=True)]

    return PositionCurve(accuracy=share(tally.hits, tally.seen), n=tally.seen,
                         accuracy_after_hits=share(tally.hits_after_hits, tally.seen_after_hits),
                         n_after_hits=tally.seen_after_hits)


def summarize_drafter(drafter: str, records: Sequence[AnchorRecord], task_ids: Sequence[str],
                      methods: Sequence[str], block_size: int) -> DrafterSummary:
    return DrafterSummary(
        drafter=drafter, anchors=len(records),
        methods=tuple(_method_summary(records, task_ids, m, block_size) for m in methods),
        positions=position_curve(records, block_size - 1),
    )
