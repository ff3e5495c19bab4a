"""Which checkpoints are candidates, when they are complete and which is scored next: pure, no clock or files."""

from __future__ import annotations

import pytest

from dfserve.eval.watch_discovery import Ready, Seen, Stability, choose, is_temporary, step_from_name


@pytest.mark.parametrize(("path", "step"), [
    ("step_1000/checkpoint.pt", 1000),
    ("step-250/model.safetensors", 250),
    ("checkpoint-4000", 4000),
    ("drafter_step1200.pt", 1200),
    ("run3/global_step77/weights.pt", 77),
    ("ckpt_12.safetensors", 12),
    ("iter-5/checkpoint.pt", 5),
    ("epoch=0-step=1000.ckpt", 1000),
    ("latest.pt", None),
    ("model.safetensors", None),
    ("steps.pt", None),
])
def test_the_step_comes_from_the_innermost_mention_in_the_path(path: str, step: int | None) -> None:
    assert step_from_name(path) == step


@pytest.mark.parametrize(("path", "temporary"), [
    ("step_1/checkpoint.pt.tmp", True),
    ("step_1.tmp/checkpoint.pt", True),
    ("tmp-step_2/checkpoint.pt", True),
    (".step_3.pt", True),
    ("step_4.pt.partial", True),
    ("step_5.safetensors.part", True),
    ("step_6/checkpoint.pt", False),
    ("checkpoint-7/model.safetensors", False),
])
def test_unpublished_names_are_never_candidates(path: str, temporary: bool) -> None:
    assert is_temporary(path) is temporary


def _seen(key: str, size: int, mtime: int = 1) -> Seen:
    return Seen(key, False, size, mtime)


def test_complete_means_unchanged_over_two_polls_never_on_first_sight() -> None:
    stability = Stability()
    assert stability.observe([_seen("a.pt", 10), _seen("b.pt", 5)]) == []
    assert stability.observe([_seen("a.pt", 10), _seen("b.pt", 7)]) == [_seen("a.pt", 10)]  # b still growing
    assert stability.observe([_seen("a.pt", 10), _seen("b.pt", 7)]) == [_seen("a.pt", 10), _seen("b.pt", 7)]
    # rewritten in place with the same size: the modification time says it changed
    assert stability.observe([_seen("a.pt", 10, mtime=2), _seen("b.pt", 7)]) == [_seen("b.pt", 7)]


def test_an_empty_file_is_never_complete_and_a_vanished_one_is_forgotten() -> None:
    stability = Stability()
    stability.observe([_seen("a.pt", 0)])
    assert stability.observe([_seen("a.pt", 0)]) == []
    stability.observe([_seen("c.pt", 3)])
    stability.observe([])
    assert stability.observe([_seen("c.pt", 3)]) == []  # seen again: a new first sighting


def test_newest_first_skips_the_older_pending_ones_every_checkpoint_scores_all_in_order() -> None:
    ready = [Ready("s300", 300), Ready("s100", 100), Ready("s200", 200), Ready("s50", 50)]
    chosen, skipped = choose(ready, done={"s50"}, every=False)
    assert chosen == [Ready("s300", 300)] and skipped == [Ready("s100", 100), Ready("s200", 200)]
    chosen, skipped = choose(ready, done={"s50"}, every=True)
    assert chosen == [Ready("s100", 100), Ready("s200", 200), Ready("s300", 300)] and skipped == []
    assert choose([Ready("s100", 100)], done=set(), every=False) == ([Ready("s100", 100)], [])
    beside = [Ready("step_300/optimizer.pt", 300), Ready("step_300/model.pt", 300), Ready("step_200/model.pt", 200)]
    assert choose(beside, done=set(), every=False) == (  # the model was skipped for its optimizer's state
        [Ready("step_300/model.pt", 300), Ready("step_300/optimizer.pt", 300)], [Ready("step_200/model.pt", 200)])
    assert choose(ready, done={"s50", "s100", "s200", "s300"}, every=False) == ([], [])
