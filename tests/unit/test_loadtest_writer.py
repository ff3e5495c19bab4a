"""The record writer: order, flushing before the end, failures surfaced, the loop's switch interval restored."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from dfserve.loadtest.client import Finished, Sent, derive
from dfserve.loadtest.records import RequestRecord, read_records
from dfserve.loadtest.writer import SWITCH_INTERVAL_S, RecordWriter
from dfserve.runs import JsonlAppender


def record(index: int) -> RequestRecord:
    return RequestRecord(arm="a", index=index, task_id=f"t{index}", dispatched_s=float(index))


def test_records_are_written_observed_and_returned_in_submit_order(tmp_path: Path) -> None:
    seen: list[int] = []
    path = tmp_path / "requests.jsonl"
    with JsonlAppender(path) as appender:
        writer = RecordWriter(record, appender, [lambda r: seen.append(r.index)])
        for index in (5, 2, 9, *range(100, 400)):
            writer.submit(index)
        records = writer.close()
    expected = [5, 2, 9, *range(100, 400)]
    assert [r.index for r in records] == expected
    assert seen == expected
    assert [r.index for r in read_records(path)] == expected


def test_a_record_is_on_disk_while_the_writer_still_runs(tmp_path: Path) -> None:
    """What a crash would find: the line of a finished request, flushed without waiting for the end of the run."""
    path = tmp_path / "requests.jsonl"
    with JsonlAppender(path) as appender:
        writer = RecordWriter(record, appender, [])
        writer.submit(7)
        deadline = time.monotonic() + 10
        while not path.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        on_disk = [r.index for r in read_records(path)]
        writer.close()
    assert on_disk == [7]


def test_batches_are_derived_off_the_submitting_thread(tmp_path: Path) -> None:
    threads: set[int] = set()

    def derive_here(index: int) -> RequestRecord:
        threads.add(threading.get_ident())
        return record(index)

    with JsonlAppender(tmp_path / "requests.jsonl") as appender:
        writer = RecordWriter(derive_here, appender, [])
        for index in range(50):
            writer.submit(index)
        writer.close()
    assert threads and threading.get_ident() not in threads


def test_a_failure_in_the_thread_is_raised_by_close_and_the_switch_interval_restored(tmp_path: Path) -> None:
    before = sys.getswitchinterval()

    def broken(index: int) -> RequestRecord:
        raise ValueError(f"cannot derive {index}")

    with JsonlAppender(tmp_path / "requests.jsonl") as appender:
        writer = RecordWriter(broken, appender, [])
        assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_S))
        writer.submit(3)
        with pytest.raises(ValueError, match="cannot derive 3"):
            writer.close()
    assert sys.getswitchinterval() == before


SENT = Sent("a", "t1", 0, False, None, 0.0, 0.1, 0.5)


def test_derive_classifies_a_refused_request_from_its_body() -> None:
    body = b'{"object": "error", "message": "queue full", "type": "BadRequestError", "code": 503}'
    r = derive("chat", 0.0, Finished(SENT, 503, [(0.3, body)], None))
    assert (r.error_kind, r.http_status) == ("http_status", 503)
    assert r.error_message is not None and "queue full" in r.error_message


def test_derive_keeps_the_chunks_of_a_cancelled_stream() -> None:
    piece = b'data: {"text": "a", "meta_info": {"prompt_tokens": 3, "completion_tokens": 1, "finish_reason": null}}\n\n'
    r = derive("native", 0.0, Finished(SENT, 200, [(0.3, piece)], ("cancelled", "stopped")))
    assert r.error_kind == "cancelled"
    assert r.chunk_times_s == [0.3]
