"""`dfserve demo`'s two modes: an option of one given to the other is refused by its field, never ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from dfserve.demo import check_options, demo
from dfserve.errors import FieldError, command_flags

COUNTS = {"num_requests": 8, "concurrency": 2, "max_new_tokens": 16}


@pytest.mark.parametrize(("offline", "given", "cache", "counts", "field", "line"), [
    (True, ["keep_running", "seed"], None, COUNTS, "keep_running", "--keep-running: not an option of --offline"),
    (False, [], Path("models"), COUNTS, "cache", "--cache: only --offline keeps models"),
    (False, [], None, {**COUNTS, "max_new_tokens": 0}, "max_new_tokens", "--max-new-tokens: must be at least 1"),
])
def test_an_option_of_the_other_mode_or_a_count_below_one_is_a_field_error(
        offline: bool, given: list[str], cache: Path | None, counts: dict[str, int], field: str, line: str) -> None:
    with pytest.raises(FieldError) as refused:
        check_options(offline, given, cache, counts)
    assert refused.value.field == field and "--" not in str(refused.value)
    assert refused.value.render(command_flags(demo)).startswith(line)


def test_options_that_fit_their_mode_pass() -> None:
    check_options(True, [], Path("models"), COUNTS)
    check_options(False, ["seed"], None, COUNTS)
