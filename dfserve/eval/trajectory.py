"""Acceptance along the online trajectory, computed from drafts scored at every anchor of a greedy reference: pure.

Offline equals online at temperature 0. With `z` = prompt + the target's greedy output, the round whose last
verified token is `z[a]` (its anchor) commits `τ = accepted + 1` tokens, where `accepted` is the number of leading
drafts equal to `z[a+1], z[a+2], ...` and the +1 is the bonus token. The first round's anchor is the first generated
token `z[P]` (prefill produced it); the next anchor is `a + τ`. Generation stops at the reference's last token
`z[last]` (its end-of-sequence token or the `max_new_tokens`-th token), so a round never commits past it: τ is
capped at `last - a`, as z-lab's `dflash_generate` and SGLang's output length cap it::

    rounds = trajectory(first=P, last=len(z) - 1, accepted=accepted_per_anchor)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Round:
    anchor: int
    tau: int
    capped: bool
    """τ was cut by the end of the reference, not by a rejected draft."""


def leading_matches(draft: Sequence[int], reference: Sequence[int]) -> int:
    """Drafts accepted by a greedy verifier: the length of the common prefix of the draft and the reference."""
    accepted = 0
    for drafted, wanted in zip(draft, reference, strict=False):
        if drafted != wanted:
            break
        accepted += 1
    return accepted


def trajectory(first: int, last: int, accepted: Mapping[int, int] | Sequence[int], offset: int = 0) -> list[Round]:
    """The rounds of online greedy decoding from anchor `first` until token `last` is committed; `accepted[a -
    offset]` holds the drafts accepted at anchor `a`."""
    rounds = []
    anchor = first
    while anchor < last:
        room = last - anchor
        tau = accepted[anchor - offset] + 1
        rounds.append(Round(anchor, min(tau, room), tau > room))
        anchor += min(tau, room)
    return rounds


@dataclass
class PositionTally:
    """Per block position 1..B-1: drafts equal to the reference, unconditionally and given every earlier one was."""

    seen: list[int]
    hits: list[int]
    seen_after_hits: list[int]
    hits_after_hits: list[int]

    @classmethod
    def empty(cls, positions: int) -> PositionTally:
        return cls([0] * positions, [0] * positions, [0] * positions, [0] * positions)

    def add(self, matches: Sequence[bool]) -> None:
        """One anchor's matches at positions 1, 2, ... (only those with a reference token)."""
        prefix = True
        for index, match in enumerate(matches):
            self.seen[index] += 1
            self.hits[index] += match
            if prefix:
                self.seen_after_hits[index] += 1
                self.hits_after_hits[index] += match
            prefix = prefix and match

    def merge(self, other: PositionTally) -> None:
        for mine, theirs in ((self.seen, other.seen), (self.hits, other.hits),
                             (self.seen_after_hits, other.seen_after_hits), (self.hits_after_hits, other.hits_after_hits)):
            for index, value in enumerate(theirs):
                mine[index] += value
