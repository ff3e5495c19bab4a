"""The baseline registry: appends only, atomic rewrites, current = latest entry of a target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dfserve.baselines import FILENAME, BaselineRegistry, entry
from dfserve.errors import UserError


def test_empty_registry_has_no_current(tmp_path: Path) -> None:
    registry = BaselineRegistry(tmp_path)
    assert registry.current("t") is None
    assert registry.history() == []


def test_latest_entry_of_a_target_is_current_and_history_is_kept(tmp_path: Path) -> None:
    registry = BaselineRegistry(tmp_path)
    registry.append(entry("t", "zlab", "run-1", "zlab"))
    registry.append(entry("other", "x", "run-1", "x"))
    registry.append(entry("t", "inhouse-4000", "run-2", "inhouse", "v/verdict.json"))
    current = registry.current("t")
    assert current is not None and current.drafter == "inhouse-4000" and current.verdict == "v/verdict.json"
    assert [e.drafter for e in registry.history("t")] == ["zlab", "inhouse-4000"]
    assert len(registry.history()) == 3
    assert not list(tmp_path.glob(f".{FILENAME}.*"))  # no temp file left behind


def test_a_corrupt_registry_is_a_user_error_not_an_overwrite(tmp_path: Path) -> None:
    (tmp_path / FILENAME).write_text(json.dumps({"entries": [{"target": 1}]}))
    registry = BaselineRegistry(tmp_path)
    with pytest.raises(UserError, match=rf"{FILENAME}: entries\.0\.target: "):
        registry.append(entry("t", "zlab", "run-1", "zlab"))
    assert json.loads((tmp_path / FILENAME).read_text()) == {"entries": [{"target": 1}]}
    # a history hidden behind a second, empty list of entries: a JSON reader keeps one of the two
    hidden = '{"entries": [], "offline": [], "entries": []}'
    (tmp_path / FILENAME).write_text(hidden)
    with pytest.raises(UserError, match=r"key 'entries' given twice in one object"):
        registry.current("t")
    assert (tmp_path / FILENAME).read_text() == hidden
