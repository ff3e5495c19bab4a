"""Pure parts of the load tester: task sets, schedules, and figures derived from raw timestamps."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from dfserve.cli import main
from dfserve.errors import FieldError, UserError
from dfserve.loadtest import records as rec
from dfserve.loadtest.config import RunConfig
from dfserve.loadtest.records import RequestRecord, read_records
from dfserve.loadtest.runner import _open_loop
from dfserve.loadtest.schedule import LoadShape, poisson_offsets
from dfserve.tasks import TaskSet, load_tasks
from tests.synthetic import run_config


def test_humaneval_is_read_offline_with_all_164_problems() -> None:
    tasks = load_tasks("humaneval")
    assert len(tasks.tasks) == 164
    assert tasks.tasks[0].id == "HumanEval/0"
    assert tasks.tasks[0].prompt is not None and "def " in tasks.tasks[0].prompt
    assert tasks.sha256 == load_tasks("humaneval").sha256


def test_jsonl_tasks_prompt_and_messages(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"id": "a", "prompt": "def f():"}) + "\n\n"
        + json.dumps({"id": 7, "messages": [{"role": "user", "content": "write f"}]}) + "\n"
    )
    tasks = load_tasks(str(path))
    assert [t.id for t in tasks.tasks] == ["a", "7"]
    assert tasks.tasks[1].as_text() == "user: write f"
    assert tasks.tasks[0].as_messages() == [{"role": "user", "content": "def f():"}]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"id": "a"}'], "exactly one of 'prompt' or 'messages'"),
        (['{"prompt": "x"}'], "field 'id'"),
        (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], "appears more than once"),
        (["{not json"], "invalid JSON"),
        (['{"id": "a", "messages": [{"role": "user"}]}'], "'messages' must be"),
    ],
)
def test_bad_task_files_name_the_problem(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=message):
        load_tasks(str(path))


def test_missing_task_file_is_a_user_error() -> None:
    with pytest.raises(FieldError, match="is neither 'humaneval' nor an existing JSONL file"):
        load_tasks("/nonexistent/tasks.jsonl")


def test_sequence_is_seeded_covers_every_task_per_pass_and_reaches_the_count() -> None:
    tasks = load_tasks("humaneval")
    order = tasks.sequence(400, seed=3)
    assert len(order) == 400
    assert order == tasks.sequence(400, seed=3)
    assert order != tasks.sequence(400, seed=4)
    assert len({t.id for t in order[:164]}) == 164  # one whole pass before any repeat
    assert max(Counter(t.id for t in order).values()) == 3


def test_sequence_rejects_zero() -> None:
    with pytest.raises(FieldError, match="num_requests: must be at least 1"):
        TaskSet("x", load_tasks("humaneval").tasks).sequence(0, 0)


def test_load_shapes_validate() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        LoadShape(kind="closed")
    with pytest.raises(ValueError, match="rate"):
        LoadShape(kind="poisson", concurrency=4)
    assert LoadShape(kind="closed", concurrency=4).offsets(10) is None


def test_constant_offsets_are_evenly_spaced() -> None:
    offsets = LoadShape(kind="constant", rate=200.0).offsets(5)
    assert offsets == pytest.approx([0.0, 0.005, 0.01, 0.015, 0.02])


def test_poisson_offsets_are_seeded_and_hold_the_rate() -> None:
    shape = LoadShape(kind="poisson", rate=200.0, seed=7)
    offsets = shape.offsets(20001)
    assert offsets == LoadShape(kind="poisson", rate=200.0, seed=7).offsets(20001)
    assert offsets is not None and offsets[0] == 0.0
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(200.0, rel=1e-12)  # the run's rate, exactly
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert len(set(gaps)) == len(gaps)  # no repeated gap sequence (one generator, not one per worker)
    mean = sum(gaps) / len(gaps)
    spread = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert 0.95 < spread / mean < 1.05  # exponential gaps: standard deviation equals the mean
    assert sum(g < mean for g in gaps) / len(gaps) == pytest.approx(1 - math.exp(-1), abs=0.02)
    assert poisson_offsets(10.0, 1, random.Random(0)) == [0.0]
    assert poisson_offsets(10.0, 0, random.Random(0)) == []


def _record(**kw: object) -> RequestRecord:
    base: dict[str, object] = dict(arm="a", index=0, task_id="t", dispatched_s=0.0, sent_s=1.0,
                                   first_token_s=1.1, end_s=1.5, chunk_times_s=[1.1, 1.2, 1.4],
                                   chunk_tokens=[1, 4, 5], completion_tokens=10, spec_verify_ct=2,
                                   acceptance="exact", finish_reason="length", output_sha256="x")
    base.update(kw)
    return RequestRecord.model_validate(base)


def test_latency_figures_come_from_raw_timestamps() -> None:
    r = _record()
    assert rec.ttft_s(r) == pytest.approx(0.1)
    assert rec.e2e_s(r) == pytest.approx(0.5)
    assert rec.tpot_s(r) == pytest.approx(0.3 / 9)
    assert rec.itl_per_chunk_s(r) == pytest.approx([0.1, 0.2])
    # 0.1 s split over the 4 tokens of the second chunk, 0.2 s over the 5 of the third: one sample per token.
    assert rec.itl_per_token_s(r) == pytest.approx([0.025] * 4 + [0.04] * 5)
    assert rec.request_accept_length(r) == pytest.approx(5.0)
    assert rec.round_tokens(r) == [4, 5]
    assert rec.wait_s(r) == 0.0
    assert rec.wait_s(_record(scheduled_s=0.5, dispatched_s=0.8)) == pytest.approx(0.3)


def test_a_chunk_read_with_the_next_carries_its_date() -> None:
    assert rec.read_with_next(_record()) == [False, False]
    assert rec.read_with_next(_record(chunk_times_s=[1.2, 1.2, 1.4, 1.4])) == [True, False, True]
    assert rec.read_with_next(_record(chunk_times_s=[1.1])) == []


def test_a_chunk_that_merged_rounds_adds_none_to_the_per_round_histogram() -> None:
    """A client that fell behind gets SGLang's latest state only: three rounds (4, 2, 3 tokens) arrive as two
    chunks (4, then 2 + 3). Counting chunks as rounds would show a round of 5 that never ran."""
    merged = _record(chunk_times_s=[1.1, 1.2, 1.4], chunk_tokens=[1, 4, 5], spec_verify_ct=3)
    assert rec.round_tokens(merged) == []
    assert rec.request_accept_length(merged) == pytest.approx(10 / 3)  # exact all the same: tokens over rounds
    prefill_merged = _record(chunk_times_s=[1.1, 1.4], chunk_tokens=[5, 5], spec_verify_ct=2)
    assert rec.round_tokens(prefill_merged) == []


def test_estimated_and_unknown_acceptance() -> None:
    chat = _record(acceptance="estimated", chunk_tokens=None, spec_verify_ct=None)
    assert rec.request_accept_length(chat) == pytest.approx(10 / 3)
    assert rec.itl_per_token_s(chat) == []
    assert rec.round_tokens(chat) == []
    assert rec.request_accept_length(_record(acceptance="unknown", spec_verify_ct=None)) is None


def test_failed_requests_have_no_latency_or_acceptance() -> None:
    failed = _record(error_kind="disconnect", error_message="cut", output_sha256=None)
    assert not failed.ok
    assert rec.e2e_s(failed) is None and rec.tpot_s(failed) is None
    assert rec.request_accept_length(failed) is None and rec.verify_rounds(failed) is None


def test_records_round_trip_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    first, second = _record(index=0), _record(index=1, warmup=True)
    path.write_text(first.model_dump_json() + "\n" + second.model_dump_json() + "\n" + '{"arm": "a", "ind')
    loaded = list(read_records(path))
    assert loaded == [first, second]
    assert rec.measured_records(loaded) == [first]
    path.write_text('{"arm": 1}\n' + first.model_dump_json() + "\n")
    with pytest.raises(UserError, match=":1:"):
        list(read_records(path))


def test_records_are_lines_ended_by_lf_only_and_a_complete_bad_last_line_is_no_torn_one(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    record = _record(index=0, task_id="t\u2028\x85\x0c")  # line breaks to str.splitlines, not to JSON lines
    path.write_text(record.model_dump_json() + "\n", encoding="utf-8")
    assert list(read_records(path)) == [record]
    path.write_bytes(record.model_dump_json().encode() + b"\n\xff\n")  # ended by its LF: written whole, then spoiled
    with pytest.raises(UserError, match=":2: not a request record"):
        list(read_records(path))


def test_a_run_config_naming_one_arm_twice_is_refused() -> None:
    config = run_config("r")
    twice = config.model_dump()
    twice["arms"][1]["name"] = "zlab"
    with pytest.raises(ValueError, match="arm 'zlab' named more than once"):
        RunConfig.model_validate(twice)


def test_records_refuse_unknown_fields() -> None:
    with pytest.raises(ValueError, match="extra"):
        _record(surprise=1)


def test_request_headers_from_the_command_line() -> None:
    from dfserve.loadtest.cli import request_headers

    assert request_headers(("X-Team: drafters", "X-Empty:"), "k") == (
        ("X-Team", "drafters"), ("X-Empty", ""), ("Authorization", "Bearer k"))
    for bad, message in (("X-Bad", "is not NAME: VALUE"), ("X Bad: 1", "is not NAME: VALUE"),
                         ("X-A: caf\u00e9", "non-ASCII"), ("X-A: 1\r\nX-B: 2", "CR, LF")):
        with pytest.raises(UserError, match=message):
            request_headers((bad,), None)
    with pytest.raises(UserError, match="give one"):
        request_headers(("authorization: Bearer x",), "k")
    with pytest.raises(UserError, match="--api-key"):
        request_headers((), "a key")


def test_a_tasks_file_with_a_byte_that_is_not_utf8_is_one_line_naming_file_and_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    with pytest.raises(FieldError, match=r"tasks: .*tasks\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 27\)"):
        load_tasks(str(path))
    for command in (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "1"],
                    ["eval", "run", "--target", str(tmp_path / "target"), "--drafter", "zlab"]):
        with pytest.raises(SystemExit) as exited:
            main([*command, "--tasks", str(path)])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith("dfserve: error: --tasks: ") and "tasks.jsonl:2: not UTF-8 text" in err


@pytest.mark.parametrize(("line", "said"), [
    (b"[" * 100_000, "tasks.jsonl:1: invalid JSON (an integer of over 4300 digits, or nested too deeply)"),
    (b'{"id": ' + b"9" * 5000 + b', "prompt": "x"}', "tasks.jsonl:1: invalid JSON (an integer of over 4300 digits"),
    (b'{"id": "\\ud800", "prompt": "x"}', "tasks.jsonl:1: a string holds a lone surrogate"),
    (b'{"id": "a", "messages": [{"role": "user", "content": "\\udfff"}]}', "tasks.jsonl:1: a string holds a lone"),
    (b'{"id": "a", "prompt": "x", "id": "b"}', "tasks.jsonl:1: key 'id' given twice in one object"),
    (b'{"id": "a", "messages": [{"role": "user", "content": "x", "role": "system"}]}', "key 'role' given twice"),
])
def test_a_tasks_line_python_cannot_hold_as_text_is_one_line_naming_it(tmp_path: Path, line: bytes, said: str) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(line + b"\n")
    with pytest.raises(FieldError) as caught:
        load_tasks(str(path))
    assert caught.value.field == "tasks" and said in str(caught.value)


def test_a_surrogate_pair_escape_is_text(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": "a", "prompt": "smile \\ud83d\\ude00"}\n')
    assert load_tasks(str(path)).tasks[0].prompt == "smile \U0001f600"


def test_a_cut_or_corrupt_gzip_tasks_file_is_one_line_not_an_abort(tmp_path: Path) -> None:
    whole = gzip.compress(b'{"id": "a", "prompt": "x"}\n' * 50)
    for name, data in (("cut", whole[:20]), ("corrupt", whole[:10] + b"\xff" * 20 + whole[30:])):
        path = tmp_path / f"{name}.jsonl.gz"
        path.write_bytes(data)
        with pytest.raises(FieldError, match=rf"tasks: .*{name}\.jsonl\.gz: a truncated or corrupt gzip file"):
            load_tasks(str(path))
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_bytes(b'{"id": "a", "prompt": "x"}\n')
    with pytest.raises(FieldError, match=r"^tasks: .*plain\.jsonl\.gz: not a gzip file \(its name ends in \.gz\)$"):
        load_tasks(str(plain))


def test_an_open_loop_ends_at_its_duration_bound_not_at_its_next_arrival() -> None:
    """A trace's next request due an hour (or forever) after a 0.2 s bound: the run ends at the bound."""
    async def run(next_offset_s: float) -> float:
        t0 = time.perf_counter()
        await _open_loop([], [], [0], 0, [next_offset_s], None, t0, t0 + 0.2, lambda: False)
        return time.perf_counter() - t0

    assert asyncio.run(run(3600.0)) < 1.0
    assert asyncio.run(run(math.inf)) < 1.0
