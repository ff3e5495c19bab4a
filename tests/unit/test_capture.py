"""Capture without sockets: the redaction policy, the writer's files, modes, bounds and drops, and the reader that
refuses an incomplete or tampered capture."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from dfserve.capture import writer as writer_module
from dfserve.capture.format import MANIFEST, CapturePolicy, CaptureRecord
from dfserve.capture.gateway import CaptureObserver
from dfserve.capture.read import read_capture
from dfserve.capture.redact import kept_headers, redact, sampling_of, text_hash
from dfserve.capture.replay import capture_holes, load_capture_tasks
from dfserve.capture.writer import Captured, CaptureWriter
from dfserve.errors import FieldError, UserError
from dfserve.gateway.observers import Exchanged, Observers
from dfserve.metrics import ObserverMetrics

CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a list"}],
        "temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "user": "alice", "stream": True}
NATIVE = {"text": "def f():", "sampling_params": {"temperature": 0, "max_new_tokens": 32, "seed": 3}, "stream": True}


def policy(tmp_path: Path, **fields: object) -> CapturePolicy:
    return CapturePolicy(**{"dir": tmp_path / "capture", **fields})  # type: ignore[arg-type]


def captured(body: dict[str, object], path: str = "/generate", at: float = 0.0) -> Captured:
    return Captured(path, json.dumps(body).encode(), [(b"authorization", b"Bearer k"), (b"cookie", b"s=1"),
                                                      (b"x-api-key", b"k"), (b"proxy-authorization", b"p"),
                                                      (b"api-key", b"azure"), (b"x-goog-api-key", b"g"),
                                                      (b"content-length", b"9"), (b"x-team", b"infra"),
                                                      (b"user-agent", b"t")], 1.7e9 + at, at)


def write(tmp_path: Path, bodies: list[dict[str, object]], **fields: object) -> CaptureWriter:
    writer = CaptureWriter.open(policy(tmp_path, **fields), clock=lambda: 0.0)
    for i, body in enumerate(bodies):
        writer.observe(captured(body, at=i * 0.5))
    writer.close()
    return writer


def test_a_deeply_nested_body_the_writer_wrote_is_read_back(tmp_path: Path) -> None:
    """A response_format schema 210 levels deep was written, then made the whole capture unreadable (pydantic's
    JSON reader stops at 200 levels, its writer does not)."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range(105):  # two levels each
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": schema}
    writer = CaptureWriter.open(policy(tmp_path), clock=lambda: 0.0)
    writer.observe(Captured("/v1/chat/completions", json.dumps(body).encode(), [], 1.7e9, 0.0, request=body))
    assert writer.close().counts.written == 1
    assert [record.body for record in read_capture(tmp_path / "capture")[1]] == [body]


# --- redaction policy ---------------------------------------------------------------------------------------------

def test_credentials_never_kept_and_configured_headers_dropped() -> None:
    headers = captured(NATIVE).headers
    assert kept_headers(headers) == (("x-team", "infra"), ("user-agent", "t"))
    assert kept_headers(headers, ["X-Team"]) == (("user-agent", "t"),)
    proxies = [(b"X-Forwarded-Access-Token", b"t"), (b"x-amzn-oidc-accesstoken", b"t"), (b"x-amzn-oidc-data", b"j"),
               (b"x-auth-token", b"t"), (b"x-litellm-api-key", b"k"), (b"x-portkey-api-key", b"k"), (b"api_key", b"k"),
               (b"x-session-secret", b"s"), (b"accept", b"text/event-stream")]
    assert kept_headers(proxies) == (("accept", "text/event-stream"),)  # what proxies in front add


def test_sampling_is_read_where_each_route_sets_it() -> None:
    assert sampling_of("native", NATIVE) == {"temperature": 0, "max_new_tokens": 32, "seed": 3}
    assert sampling_of("chat", CHAT) == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64}


def test_keep_is_the_body_untouched(tmp_path: Path) -> None:
    assert redact("chat", CHAT, policy(tmp_path)) == (CHAT, (), True)


def test_hash_replaces_every_message_text_and_says_it_cannot_replay(tmp_path: Path) -> None:
    body, fields, replayable = redact("chat", CHAT, policy(tmp_path, redact="hash"))
    assert [m["content"] for m in body["messages"]] == [text_hash("be brief"), text_hash("sort a list")]
    assert "sort a list" not in json.dumps(body) and body["user"] == text_hash("alice")
    assert (fields, replayable) == (("messages[].content", "user"), False)
    assert body["temperature"] == 0.7 and CHAT["messages"][1]["content"] == "sort a list"  # type: ignore[index]
    agent = {"messages": [{"role": "user", "name": "alice", "content": "fix it"},
                          {"role": "assistant", "content": None, "reasoning_content": "the key is in .env",
                           "tool_calls": [{"id": "t", "type": "function",
                                           "function": {"name": "read", "arguments": '{"path": "/home/alice/.env"}'}}]}],
             "tools": [{"type": "function", "function": {"name": "read"}}]}
    hashed, fields, _ = redact("chat", agent, policy(tmp_path, redact="hash"))
    assert not any(secret in json.dumps(hashed) for secret in ("alice", "fix it", ".env"))
    assert fields == ("messages[].content", "messages[].name", "messages[].reasoning_content",
                      "messages[].tool_calls[].function.arguments")
    assert hashed["tools"] == agent["tools"]  # the tools a deployment offers are not a user's words
    completion, fields, _ = redact("completions", {"prompt": "def f(", "suffix": "return secret"},
                                   policy(tmp_path, redact="hash"))
    assert "secret" not in json.dumps(completion) and fields == ("prompt", "suffix")
    native, fields, _ = redact("native", {**NATIVE, "input_ids": [1, 2]}, policy(tmp_path, redact="hash"))
    assert native["text"] == text_hash("def f():") and native["input_ids"] == text_hash([1, 2])
    assert fields == ("text", "input_ids")
    legacy = {"messages": [{"role": "assistant", "reasoning": "alice's key", "function_call": {
        "name": "read", "arguments": '{"path": "/home/alice/.env"}'}}], "metadata": {"user_id": "alice"}}
    hashed, fields, _ = redact("chat", legacy, policy(tmp_path, redact="hash"))
    assert "alice" not in json.dumps(hashed) and hashed["messages"][0]["function_call"]["name"] == "read"
    assert fields == ("messages[].reasoning", "messages[].function_call.arguments", "metadata")
    media, fields, _ = redact("native", {**NATIVE, "image_data": "data:image/png;base64,QUxJQ0U="},
                              policy(tmp_path, redact="hash"))
    assert "QUxJQ0U" not in json.dumps(media) and fields == ("text", "image_data")
    lone, _, _ = redact("native", {**NATIVE, "text": "a\ud800"}, policy(tmp_path, redact="hash"))  # a client's escape
    assert lone["text"].startswith("sha256:") and lone["text"] != text_hash("a")


def test_drop_removes_named_fields_and_a_dropped_prompt_or_setting_cannot_replay(tmp_path: Path) -> None:
    """A request without its prompt, or without one of its sampling settings (replayed, it would run at the run's
    flags), is not the request captured."""
    body, fields, replayable = redact("native", NATIVE, policy(tmp_path, redact="drop",
                                                               drop_fields=("sampling_params.seed", "absent")))
    assert body["sampling_params"] == {"temperature": 0, "max_new_tokens": 32}
    assert (fields, replayable) == (("sampling_params.seed",), False)
    _, fields, replayable = redact("chat", CHAT, policy(tmp_path, redact="drop", drop_fields=("user", "messages")))
    assert (fields, replayable) == (("user", "messages"), False)
    _, fields, replayable = redact("chat", CHAT, policy(tmp_path, redact="drop", drop_fields=("user", "temperature")))
    assert (fields, replayable) == (("user", "temperature"), False)
    _, fields, replayable = redact("chat", CHAT, policy(tmp_path, redact="drop", drop_fields=("user",)))
    assert (fields, replayable) == (("user",), True)


@pytest.mark.parametrize(("fields", "message"), [({"redact": "drop"}, "needs drop_fields"),
                                                 ({"drop_fields": ("user",)}, "only with redact: drop"),
                                                 ({"fraction": 0.0}, "greater than 0")])
def test_policy_refuses_what_it_cannot_mean(tmp_path: Path, fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        policy(tmp_path, **fields)


# --- the writer ---------------------------------------------------------------------------------------------------

def test_records_hold_route_body_arrival_settings_and_headers(tmp_path: Path) -> None:
    writer = CaptureWriter.open(policy(tmp_path), clock=lambda: 10.0, wall=lambda: 1.7e9)
    writer.observe(captured(NATIVE, at=10.25))
    writer.observe(captured(CHAT, "/v1/chat/completions", at=11.0))
    writer.observe(captured(NATIVE, "/health", at=11.5))
    writer.observe(Captured("/generate", b"not json", [], 0.0, 12.0))
    manifest = writer.close()
    _, records = read_capture(tmp_path / "capture")
    assert [(r.seq, r.route, r.offset_s, r.body) for r in records] == [(0, "native", 0.25, NATIVE),
                                                                      (1, "chat", 1.0, CHAT)]
    assert records[0].arrival_unix_s == 1.7e9 + 10.25 and records[0].sampling == NATIVE["sampling_params"]
    assert records[1].headers == (("x-team", "infra"), ("user-agent", "t"))
    assert "Bearer" not in (tmp_path / "capture" / manifest.segments[0].name).read_text()
    assert (manifest.complete, manifest.counts.written, manifest.counts.not_a_route, manifest.counts.unreadable) == (
        True, 2, 1, 1)


def test_a_body_the_gateway_decoded_is_taken_as_decoded_and_left_as_it_was(tmp_path: Path) -> None:
    decoded = json.loads(json.dumps(CHAT))
    writer = CaptureWriter.open(policy(tmp_path, redact="hash"), clock=lambda: 0.0)
    writer.observe(Captured("/v1/chat/completions", b"{not decoded again", [], 0.0, 0.0, decoded))
    writer.close()
    _, (record,) = read_capture(tmp_path / "capture")
    assert record.sampling["temperature"] == 0.7 and record.body["messages"][1]["content"] != "sort a list"
    assert decoded == CHAT  # the hash policy changed its own copy


def test_a_line_is_byte_for_byte_the_records_own_json() -> None:
    fields = {"seq": 7, "route": "chat", "path": "/v1/chat/completions", "arrival_unix_s": 1.7e9 + 0.123456,
              "offset_s": 1e-7, "sampling": {"temperature": 0.7, "stop": ["\n"]},
              "headers": (("x-team", "infra é"),), "redaction": "hash", "redacted": ("messages[].content",),
              "body": json.loads('{"messages": [{"role": "user", "content": "h\\u00e9 \\u2028 NaN"}], "n": 1e300, '
                                 '"big": 123456789012345678901234567890, "none": null, "Infinity": 1}'),
              "replayable": False}
    line = writer_module.record_line(**fields)
    assert line == (CaptureRecord(**fields).model_dump_json() + "\n").encode()  # type: ignore[arg-type]
    assert CaptureRecord.model_validate_json(line).redacted == ("messages[].content",)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_body_with_a_number_json_cannot_hold_is_a_request_not_recorded(tmp_path: Path, number: str) -> None:
    """Python's JSON reads a client's NaN; written as null it replayed as unset, a request the client never sent
    (and one the server refused live, served on replay)."""
    writer = CaptureWriter.open(policy(tmp_path), clock=lambda: 0.0)
    body = f'{{"text": "a", "sampling_params": {{"temperature": {number}}}}}'.encode()
    writer.observe(Captured("/generate", body, [], 0.0, 0.0))
    writer.observe(captured(NATIVE, at=1.0))
    manifest = writer.close()
    assert (manifest.counts.written, manifest.counts.unreadable) == (1, 1)
    assert [record.body for record in read_capture(tmp_path / "capture")[1]] == [NATIVE]


def test_files_are_0600_and_the_folder_0700_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o277)  # would leave new files read-only to their owner
    try:
        write(tmp_path, [NATIVE, NATIVE])
    finally:
        os.umask(previous)
    folder = tmp_path / "capture"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert modes == {MANIFEST: 0o600, "segment-000001.jsonl": 0o600}


def test_a_capture_folder_is_never_reused_and_closing_twice_is_harmless(tmp_path: Path) -> None:
    writer = write(tmp_path, [NATIVE])
    assert writer.close().complete
    with pytest.raises(FieldError, match=r"dir: .* exists"):
        CaptureWriter.open(policy(tmp_path))


def test_a_dropped_field_is_written_nowhere_its_sampling_settings_included(tmp_path: Path) -> None:
    chat = {**CHAT, "stop": ["SECRET-STOP"], "seed": 42}
    native = {**NATIVE, "sampling_params": {**NATIVE["sampling_params"], "stop": ["SECRET-STOP"]}}  # type: ignore[dict-item]
    writer = CaptureWriter.open(policy(tmp_path, redact="drop", drop_fields=("stop", "seed", "sampling_params.stop")),
                                clock=lambda: 0.0)
    writer.observe(captured(chat, path="/v1/chat/completions"))
    writer.observe(captured(native))
    writer.close()
    data = b"".join(p.read_bytes() for p in (tmp_path / "capture").glob("segment-*"))
    assert b"SECRET-STOP" not in data and b'"seed":42' not in data
    chat_record, native_record = read_capture(tmp_path / "capture")[1]
    assert chat_record.sampling["temperature"] == 0.7 and native_record.sampling["max_new_tokens"] == 32


def test_sampling_is_deterministic_for_a_seed_and_near_the_fraction(tmp_path: Path) -> None:
    def kept(seed: int, name: str) -> list[str]:
        writer = CaptureWriter.open(CapturePolicy(dir=tmp_path / name, fraction=0.25, seed=seed))
        for i in range(400):
            writer.observe(captured({"text": str(i)}))
        manifest = writer.close()
        assert manifest.counts.sampled_out + manifest.counts.written == 400
        return [r.body["text"] for r in read_capture(tmp_path / name)[1]]

    first, again, other = kept(1, "a"), kept(1, "b"), kept(2, "c")
    assert first == again and first != other
    assert 60 <= len(first) <= 140


def test_rotation_bounds_segments_and_bytes_and_then_stops(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    body = {"text": "x" * 900}
    with caplog.at_level(logging.WARNING, "dfserve.capture"):
        writer = write(tmp_path, [body] * 40, max_bytes=3 * 4096, max_segments=3)
    manifest = writer.close()
    folder = tmp_path / "capture"
    segments = sorted(folder.glob("segment-*"))
    assert len(segments) == len(manifest.segments) == 3
    assert all(p.stat().st_size <= 4096 for p in segments)
    assert sum(p.stat().st_size for p in segments) <= 3 * 4096
    counts = manifest.counts
    assert counts.written == sum(s.records for s in manifest.segments) and counts.written < 40
    assert counts.written + counts.dropped_over_bound == 40
    assert manifest.stopped is not None and "max_bytes" in manifest.stopped
    assert [r.seq for r in read_capture(folder)[1]] == list(range(counts.written))
    assert len([r for r in caplog.records if "stopped" in r.getMessage()]) == 1


def test_a_request_still_running_when_the_capture_stopped_ends_its_window(tmp_path: Path) -> None:
    """The writer sees requests as they end: one that arrived among those it holds and ended after the bound stopped
    it is lost, so the capture is whole only up to its arrival, and a replay takes the requests before it; it was
    called complete, then refused as holed (every capture with a long request in flight at its bound)."""
    body = {"text": "x" * 900}
    manifests = {}
    for name, late in (("after", False), ("within", True)):
        writer = CaptureWriter.open(policy(tmp_path, max_bytes=4096, max_segments=1, dir=tmp_path / name),
                                    clock=lambda: 0.0)
        for i in range(8):  # within: a batch after the lost request is no hole, as it is not replayed anyway
            writer.observe(captured({"text": ["x" * 449, "y" * 449]} if late and i == 2 else body, at=float(i)))
        if late:
            writer.observe(captured(body, at=1.5))  # a long request: arrived second, ended last
        manifests[name] = writer.close()
    after, within = manifests["after"].counts, manifests["within"].counts
    assert after.written == within.written and 2 < after.written < 8
    assert (after.dropped_over_bound, after.dropped_in_window) == (8 - after.written, 0)
    assert (within.dropped_over_bound, within.dropped_in_window) == (8 - within.written, 1)
    assert (manifests["after"].lost_from_offset_s, manifests["within"].lost_from_offset_s) == (None, 1.5)
    assert capture_holes(manifests["after"]) is None and capture_holes(manifests["within"]) is None
    whole, shortened = (load_capture_tasks(f"capture:{tmp_path / name}") for name in ("after", "within"))
    assert whole.arrivals_s == tuple(float(i) for i in range(after.written)) and whole.shortened is None
    assert shortened.arrivals_s == (0.0, 1.0) and shortened.incomplete is None and shortened.shortened == (
        f"replays its first 2 of {within.written} requests, those that arrived before 1.5 s: a request that arrived "
        "then was still running when it stopped, and was lost")


def test_a_request_the_capture_could_not_record_is_a_hole(tmp_path: Path) -> None:
    """A lone surrogate in a prompt (which SGLang's JSON decoder takes) cannot be written back out: the replay
    lacks that request, and says so."""
    writer = CaptureWriter.open(policy(tmp_path), clock=lambda: 0.0)
    for at, body in enumerate((NATIVE, {"text": "\ud800"}, NATIVE)):
        writer.observe(captured(body, at=at))
    manifest = writer.close()
    assert (manifest.counts.written, manifest.counts.unreadable) == (2, 1)
    assert capture_holes(manifest) == "the capture lost 1 of its requests between the 2 it holds (1 it could not record)"


def test_a_record_larger_than_a_segment_is_dropped_and_counted(tmp_path: Path) -> None:
    manifest = write(tmp_path, [{"text": "x" * 5000}, NATIVE], max_bytes=4096, max_segments=1).close()
    assert (manifest.counts.dropped_too_large, manifest.counts.written) == (1, 1)


def test_a_failing_disk_never_raises_into_observe_and_is_logged_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real_append = writer_module._Segment.append
    calls = 0

    def full_after_two(segment: writer_module._Segment, line: bytes) -> None:
        nonlocal calls
        calls += 1
        if calls > 2:
            os.write(segment.fd, line[:10])  # a torn line, as a full disk leaves it
            raise OSError(errno.ENOSPC, "No space left on device")
        real_append(segment, line)

    monkeypatch.setattr(writer_module._Segment, "append", full_after_two)
    writer = CaptureWriter.open(policy(tmp_path))
    with caplog.at_level(logging.WARNING, "dfserve.capture"):
        for _ in range(6):
            writer.observe(captured(NATIVE))
        manifest = writer.close()
    counts = manifest.counts
    assert (counts.written, counts.dropped_write_error, counts.dropped_after_error) == (2, 1, 3)  # 1 lost, 3 after
    assert manifest.stopped is not None and "No space left" in manifest.stopped
    assert len(read_capture(tmp_path / "capture")[1]) == 2  # the lines before the failure are kept, whole
    assert len([r for r in caplog.records if "No space left" in r.getMessage()]) == 1


def test_a_disk_that_fills_under_the_segments_still_gets_a_true_manifest_from_the_reserve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk has no room for the manifest's rewrite either: without the room reserved at the start, the whole
    capture read as unfinished, and nothing of it could be replayed. Here the disk is full until the reserve is
    given back."""
    real_write = writer_module._write_all
    writer = CaptureWriter.open(policy(tmp_path))
    reserve = tmp_path / "capture" / writer_module.RESERVE
    full = False

    def filling(fd: int, data: bytes) -> None:
        if full and reserve.exists():
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, data)

    monkeypatch.setattr(writer_module, "_write_all", filling)
    for _ in range(3):
        writer.observe(captured(NATIVE))
    writer.flush()
    full = True
    for _ in range(3):
        writer.observe(captured(NATIVE))
    writer.flush()
    manifest = writer.close()
    assert manifest.complete and manifest.stopped is not None and "No space left" in manifest.stopped
    assert (manifest.counts.written, manifest.counts.dropped_write_error) == (3, 3)
    assert len(read_capture(tmp_path / "capture")[1]) == 3
    assert sorted(p.name for p in (tmp_path / "capture").iterdir()) == ["manifest.json", "segment-000001.jsonl"]


def test_a_write_that_fails_mid_batch_leaves_whole_lines_and_a_true_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = writer_module._write_all
    failing = False

    def torn_write(fd: int, data: bytes) -> None:
        if failing and "segment-" in os.readlink(f"/proc/self/fd/{fd}"):
            os.write(fd, data[: len(data) // 2 + 1])  # the batch's first lines whole, the next one torn
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, data)

    monkeypatch.setattr(writer_module, "_write_all", torn_write)
    writer = CaptureWriter.open(policy(tmp_path), clock=lambda: 0.0)
    for i in range(2):
        writer.observe(captured(NATIVE, at=i))
    writer.flush()  # the first batch is on disk
    failing = True
    for i in range(2, 6):
        writer.observe(captured({**NATIVE, "text": f"batch {i}"}, at=i))
    writer.flush()
    manifest = writer.close()
    assert (manifest.counts.written, manifest.counts.dropped_write_error) == (2, 4)
    manifest_read, records = read_capture(tmp_path / "capture")  # checks each segment's size and sha256
    assert [r.seq for r in records] == [0, 1] and manifest_read.segments[0].records == 2
    assert (tmp_path / "capture" / manifest.segments[0].name).read_bytes().endswith(b"}\n")


def test_every_request_of_a_batch_is_written_once_and_in_order(tmp_path: Path) -> None:
    writer = CaptureWriter.open(policy(tmp_path, max_bytes=16 * 8192, max_segments=16), clock=lambda: 0.0)
    for i in range(200):
        writer.observe(captured({**NATIVE, "text": f"request {i}"}, at=i))
    manifest = writer.close()
    _, records = read_capture(tmp_path / "capture")
    assert [r.body["text"] for r in records] == [f"request {i}" for i in range(200)]
    assert [r.seq for r in records] == list(range(200)) and len(manifest.segments) > 1  # batches cross segments


def test_a_full_queue_drops_without_blocking_and_the_manifest_counts_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Behind the gateway's observer seam: while the capture's thread is held, the loop's hand-offs never wait,
    and the client requests its full queue dropped (not their shadow copies) are counted in the manifest."""
    release = threading.Event()
    real_line = CaptureWriter._line

    def slow_line(self: CaptureWriter, item: Captured, offset_s: float) -> bytes | None:
        release.wait(10)
        return real_line(self, item, offset_s)

    monkeypatch.setattr(CaptureWriter, "_line", slow_line)
    observer = CaptureObserver(CaptureWriter.open(policy(tmp_path)))
    seam = Observers(ObserverMetrics.build(CollectorRegistry()))
    seam.add("capture", observer, queue_size=2)
    body = json.dumps(NATIVE).encode()
    with caplog.at_level(logging.WARNING, "dfserve"):
        started = time.perf_counter()
        for i in range(20):
            for mirror in (False, True):
                seam.finished(cast(Exchanged, Finished(mirror, "POST", "/generate", b"x-team: infra\r\n", body, i)))
        elapsed = time.perf_counter() - started
        release.set()
        seam.close()
    manifest, _ = read_capture(tmp_path / "capture")
    assert elapsed < 5  # the thread held every write for up to 10 s; the hand-offs waited for none of them
    assert manifest.counts.dropped_queue_full >= 15
    assert manifest.counts.written + manifest.counts.dropped_queue_full == manifest.counts.observed == 20
    assert [r.getMessage() for r in caplog.records] == [  # once, by the seam: not again by the writer
        "observer capture missed an exchange (its queue is full); counted in dfserve_gateway_observer_failures_total, "
        "logged once"]


# --- the reader ---------------------------------------------------------------------------------------------------

@pytest.fixture
def two_segments(tmp_path: Path) -> Path:
    write(tmp_path, [{"text": "x" * 900}] * 6, max_bytes=2 * 4096, max_segments=2)
    return tmp_path / "capture"


def test_an_intact_capture_reads_back(two_segments: Path) -> None:
    manifest, records = read_capture(two_segments)
    assert len(manifest.segments) == 2 and len(records) == 6


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1])


def _edit(path: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b'"x', b'"y', 1))


def _add(path: Path) -> None:
    (path.parent / "segment-000009.jsonl").write_bytes(path.read_bytes())


@pytest.mark.parametrize(("tamper", "message"), [
    (_truncate, r"segment-000001.jsonl: 2 lines in \d+ bytes, manifest.json says 3 .*truncated"),
    (_edit, "segment-000001.jsonl: sha256 differs"),
    (_add, "segment-000009.jsonl is not in manifest.json"),
    (Path.unlink, "segment-000001.jsonl: No such file"),
])
def test_a_truncated_edited_added_or_missing_segment_is_refused(two_segments: Path, tamper: object,
                                                                message: str) -> None:
    tamper(two_segments / "segment-000001.jsonl")  # type: ignore[operator]
    with pytest.raises(UserError, match=message):
        read_capture(two_segments)


def test_a_manifest_whose_counts_are_not_its_segments_is_refused(two_segments: Path) -> None:
    """`written: 100` over segments of 6 records read as a whole capture, its holes unsaid."""
    path = two_segments / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["counts"]["written"] = 100
    path.write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"manifest.json counts 100 written, its segments hold 6 \(edited\)$"):
        read_capture(two_segments)


def test_a_kept_record_that_says_it_cannot_be_replayed_is_refused_as_edited(tmp_path: Path) -> None:
    """It was refused as "its prompt was dropped (redact: drop )", which no policy did."""
    write(tmp_path, [NATIVE])
    segment = tmp_path / "capture" / "segment-000001.jsonl"
    data = segment.read_bytes().replace(b'"replayable":true', b'"replayable":false')
    segment.write_bytes(data)
    path = tmp_path / "capture" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["segments"][0].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))  # resealed
    path.write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="redaction is keep, but the record says it was redacted or cannot be replayed"):
        read_capture(tmp_path / "capture")


def test_an_unclosed_capture_is_refused(tmp_path: Path) -> None:
    writer = CaptureWriter.open(policy(tmp_path))
    try:
        with pytest.raises(UserError, match="not complete"):
            read_capture(tmp_path / "capture")
    finally:
        writer.close()


def test_a_record_line_is_checked_against_the_format() -> None:
    with pytest.raises(ValueError, match="extra"):
        CaptureRecord.model_validate({"seq": 0, "route": "native", "path": "/generate", "arrival_unix_s": 0,
                                      "offset_s": 0, "sampling": {}, "headers": [], "body": {}, "redaction": "keep",
                                      "replayable": True, "surprise": 1})


# --- the gateway's observer ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Finished:
    mirror: bool
    method: str
    path: str
    headers: bytes
    body: bytes
    start_s: float
    request: dict[str, Any] | None = None


def test_the_observer_keeps_client_requests_with_their_arrival_and_not_mirrors(tmp_path: Path) -> None:
    observer = CaptureObserver(CaptureWriter.open(policy(tmp_path), clock=lambda: 40.0), wall=lambda: 1000.0,
                               clock=lambda: 50.0)
    lines = b"authorization: Bearer k\r\nx-team: infra\r\ncontent-type: application/json\r\n"
    body = json.dumps(NATIVE).encode()
    observer.observe(Finished(False, "POST", "/generate", lines, body, 48.5))
    observer.observe(Finished(True, "POST", "/generate", lines, body, 48.5))
    observer.observe(Finished(False, "GET", "/generate", lines, b"", 49.0))
    observer.close()
    manifest, records = read_capture(tmp_path / "capture")
    assert manifest.complete and len(records) == 1
    record = records[0]
    assert (record.offset_s, record.arrival_unix_s) == (8.5, 998.5)
    assert record.headers == (("x-team", "infra"), ("content-type", "application/json"))


def test_the_observers_options_are_the_policy_and_a_bad_one_names_its_field(tmp_path: Path) -> None:
    observer = CaptureObserver.from_options({"dir": str(tmp_path / "c"), "fraction": 0.5, "redact": "hash",
                                             "max_bytes": 1 << 20, "max_segments": 4})
    observer.close()
    assert read_capture(tmp_path / "c")[0].policy.redact == "hash"
    with pytest.raises(FieldError, match=r"^capture\.fraction: Input should be less than or equal to 1"):
        CaptureObserver.from_options({"dir": str(tmp_path / "d"), "fraction": 2})
    with pytest.raises(FieldError, match=r"^capture\.max_segment: Extra inputs"):
        CaptureObserver.from_options({"dir": str(tmp_path / "d"), "max_segment": 2})
    with pytest.raises(FieldError, match=r"^capture\.dir: .* exists; a capture folder is never reused"):
        CaptureObserver.from_options({"dir": str(tmp_path / "c")})
    with pytest.raises(FieldError, match=r"^capture\.queue_size: an observers entry's queue is sized by the entry's"):
        CaptureObserver.from_options({"dir": str(tmp_path / "e"), "queue_size": 8})
    assert not (tmp_path / "e").exists()
