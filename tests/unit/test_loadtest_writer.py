"""The record writer: frames in and out in order, batches flushed as they come, failures surfaced."""

from __future__ import annotations

import asyncio
import io
import os
import threading
from pathlib import Path

import pytest

from dfserve.loadtest.client import Finished, Sent, derive
from dfserve.loadtest.records import read_records
from dfserve.loadtest.writer import RecordWriter, RecordWriterError, frame, read_frames, write_records
from dfserve.runs import JsonlAppender

PIECE = b'data: {"text": "a", "meta_info": {"prompt_tokens": 3, "completion_tokens": 1, "finish_reason": null}}\n\n'


def finished(index: int, error: tuple[str, str] | None = ("cancelled", "stopped")) -> Finished:
    sent = Sent("a", f"t{index}", index, index < 2, None, 0.0, 0.1, 0.5, "native")
    return Finished(sent, 200, [(0.3, PIECE)], error)  # type: ignore[arg-type]


def test_a_frame_carries_a_finished_request_whole() -> None:
    original = finished(4)
    read, write = os.pipe()
    with os.fdopen(read, "rb") as source, os.fdopen(write, "wb") as sink:
        sink.write(frame(original))
        sink.flush()
        batch = read_frames(source)
    assert batch == [original]


def test_frames_come_back_in_order_in_batches_and_none_at_the_end() -> None:
    read, write = os.pipe()
    with os.fdopen(read, "rb") as source:
        with os.fdopen(write, "wb") as sink:
            sink.write(b"".join(frame(finished(n)) for n in range(5)))
        batches = []
        while (batch := read_frames(source)) is not None:
            batches.append([f.sent.index for f in batch])
    assert [n for batch in batches for n in batch] == list(range(5))


def test_a_frame_cut_short_ends_the_input_after_the_whole_ones() -> None:
    read, write = os.pipe()
    with os.fdopen(read, "rb") as source:
        with os.fdopen(write, "wb") as sink:
            sink.write(frame(finished(1)) + frame(finished(2))[:-3])
        assert [f.sent.index for f in read_frames(source) or []] == [1]
        assert read_frames(source) is None


def test_records_are_written_and_echoed_in_order(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    echo = io.BytesIO()
    read, write = os.pipe()
    with os.fdopen(read, "rb") as source, JsonlAppender(path) as appender:
        with os.fdopen(write, "wb") as sink:
            sink.write(frame(0.0) + b"".join(frame(finished(n)) for n in (7, 3, 9)))
        write_records(source, appender, echo)
    on_disk = list(read_records(path))
    assert [r.index for r in on_disk] == [7, 3, 9]
    assert on_disk == [derive(0.0, finished(n)) for n in (7, 3, 9)]
    assert echo.getvalue().decode() == path.read_text()


def test_each_batch_is_on_disk_before_the_next_arrives(tmp_path: Path) -> None:
    """What a crash would find: the line of a finished request, flushed while the writer waits for more."""
    path = tmp_path / "requests.jsonl"
    read, write = os.pipe()
    with os.fdopen(read, "rb") as source, os.fdopen(write, "wb") as sink, JsonlAppender(path) as appender:
        worker = threading.Thread(target=write_records, args=(source, appender, io.BytesIO()))
        worker.start()
        sink.write(frame(0.0) + frame(finished(1)))
        sink.flush()
        for _ in range(1000):
            if path.read_text():
                break
            threading.Event().wait(0.01)
        on_disk = [r.index for r in read_records(path)]
        sink.close()
        worker.join(10)
    assert on_disk == [1]


def test_an_echo_nobody_reads_does_not_stop_the_file(tmp_path: Path) -> None:
    class Gone(io.BytesIO):
        def write(self, data: object) -> int:
            raise BrokenPipeError

    path = tmp_path / "requests.jsonl"
    read, write = os.pipe()
    with os.fdopen(read, "rb") as source, JsonlAppender(path) as appender:
        with os.fdopen(write, "wb") as sink:
            sink.write(frame(0.0) + frame(finished(1)) + frame(finished(2)))
        write_records(source, appender, Gone())
    assert [r.index for r in read_records(path)] == [1, 2]


def test_times_are_made_relative_to_the_run_start_of_the_first_frame(tmp_path: Path) -> None:
    read, write = os.pipe()
    with os.fdopen(read, "rb") as source, JsonlAppender(tmp_path / "requests.jsonl") as appender:
        with os.fdopen(write, "wb") as sink:
            sink.write(frame(0.25) + frame(finished(1)))
        write_records(source, appender, io.BytesIO())
    assert [r.chunk_times_s for r in read_records(tmp_path / "requests.jsonl")] == [[pytest.approx(0.05)]]


SENT = Sent("a", "t1", 0, False, None, 0.0, 0.1, 0.5, "chat")


def test_derive_classifies_a_refused_request_from_its_body() -> None:
    body = b'{"object": "error", "message": "queue full", "type": "BadRequestError", "code": 503}'
    r = derive(0.0, Finished(SENT, 503, [(0.3, body)], None))
    assert (r.error_kind, r.http_status) == ("http_status", 503)
    assert r.error_message is not None and "queue full" in r.error_message


def test_derive_keeps_the_chunks_of_a_cancelled_stream() -> None:
    r = derive(0.0, finished(5))
    assert r.error_kind == "cancelled"
    assert r.chunk_times_s == [0.3]


@pytest.mark.parametrize("error", [None, ("timeout", "no complete answer within 1 s")])
def test_wire_round_trip(error: tuple[str, str] | None) -> None:
    original = finished(3, error)
    assert Finished.from_wire(original.wire()) == original


def test_a_writer_that_cannot_create_its_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gone" / "requests.jsonl"
    with pytest.raises(RecordWriterError) as refused:
        asyncio.run(RecordWriter.start(path, []))
    assert str(refused.value) == f"the record writer did not start: {path}: No such file or directory"
