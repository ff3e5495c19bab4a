"""`CaptureWriter`: the gateway's capture observer hands it each request it saw (`observe`, on the observer's
thread, off the event loop); it redacts and serializes them, and `flush` writes each batch into bounded segments.

A capture must never fail or slow a client's request: the gateway's observer seam drops an exchange that finds the
capture's queue full (and tells the writer, `missed`: the seam logs it); when writing failed (ENOSPC, EACCES), or
the capture reached its bound, the request is counted as dropped; each kind of drop is logged once and counted in
the manifest.

The bound stops the capture rather than dropping the oldest segments: a capture is a window of traffic to replay,
and its arrival offsets are measured from its start, so it stays one unbroken window from its first request; a
reader never finds a segment deleted under it. To capture a later window, start a new capture folder. The writer
sees requests as they end, not as they arrive: once it stopped, a request that arrived before the last one it holds
(a long one, still running) is lost from its window, counted apart (`dropped_in_window`) from those after it, and
the whole window ends at the first of them (`lost_from_offset_s`).

Files are created 0600 (set with fchmod, whatever the umask), the folder 0700.

    writer = CaptureWriter.open(CapturePolicy(dir=Path("capture"), fraction=0.1))
    writer.observe(Captured("/generate", body, headers, time.time(), time.perf_counter()))
    writer.flush()   # the batch's lines, in one write
    writer.close()   # writes the last segment and marks the manifest complete
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic_core import to_json

from dfserve.capture.format import (
    MANIFEST,
    CaptureCounts,
    CaptureManifest,
    CapturePolicy,
    CaptureRecord,
    SegmentInfo,
    segment_name,
)
from dfserve.capture.redact import kept_headers, redact, sampling_of
from dfserve.errors import FieldError
from dfserve.sglang import ROUTES, Api

log = logging.getLogger("dfserve.capture")

ROUTE_OF: dict[str, Api] = {path: api for api, path in ROUTES.items()}  # type: ignore[misc]
FILE_MODE = 0o600


@dataclass(frozen=True, slots=True)
class Captured:
    """One request as the gateway saw it: what an observer hands the writer."""

    path: str
    body: bytes
    headers: Sequence[tuple[bytes | str, bytes | str]]
    arrival_unix_s: float
    arrival_perf_s: float
    """`time.perf_counter()` at arrival: the replay's offsets come from this clock, not the wall clock."""
    request: Mapping[str, Any] | None = None
    """The body already decoded (the gateway's, `Exchanged.request`): not decoded again, nor changed."""


_RECORD_FIELDS = tuple(CaptureRecord.model_fields.items())


def record_line(**fields: Any) -> bytes:
    """A `CaptureRecord` line, byte for byte as `model_dump_json` writes it, of fields the writer built itself:
    not validated again (that costs twice the writing; the reader validates every line). `ValueError` for a body
    with a number JSON cannot hold (a client's NaN or Infinity, which Python's JSON reads): written as null, it
    would replay as unset, a request the client never sent."""
    line = to_json({name: fields[name] if name in fields else field.get_default()
                    for name, field in _RECORD_FIELDS}, inf_nan_mode="constants") + b"\n"
    if (b"NaN" in line or b"Infinity" in line) and not _finite(fields.get("body")):
        raise ValueError("a number JSON cannot hold (NaN or Infinity)")
    return line


def _finite(body: object) -> bool:
    try:
        json.dumps(body, allow_nan=False)
    except ValueError:
        return False
    return True


def create_private(path: Path) -> int:
    """A new file open for writing, mode 0600 whatever the umask; an existing file is an error."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


RESERVE = ".manifest-reserve"
RESERVE_BYTES = 64 << 10
MANIFEST_BYTES_PER_SEGMENT = 1 << 10
"""The reserve (`CaptureWriter._reserve`) holds twice what the manifest takes at most: its old and new copies."""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Segment:
    """An open segment: lines are appended to `pending` and written, each batch at once, by `flush`; the file, its
    sha256 and `written` only ever hold whole lines."""

    def __init__(self, directory: Path, number: int) -> None:
        self.name = segment_name(number)
        self.path = directory / self.name
        self.fd = create_private(self.path)
        self.records = 0
        self.bytes = 0
        """Lines and bytes appended, pending ones included (what the segment's bound counts)."""
        self.written = 0
        """Bytes on disk, whole lines."""
        self.pending: list[bytes] = []
        self.digest = hashlib.sha256()

    def append(self, line: bytes) -> None:
        self.pending.append(line)
        self.records += 1
        self.bytes += len(line)

    def flush(self) -> None:
        """Write the pending lines; on an OSError the file may hold part of them (`cut_back` removes it)."""
        if self.pending:
            data = b"".join(self.pending)
            _write_all(self.fd, data)
            self.digest.update(data)
            self.written += len(data)
            self.pending.clear()

    def cut_back(self) -> None:
        """After a failed write: the file back to its whole lines, the next write after them."""
        os.ftruncate(self.fd, self.written)
        os.lseek(self.fd, self.written, os.SEEK_SET)

    def drop_pending(self) -> int:
        """Forget the lines not written; how many they were."""
        lost = len(self.pending)
        self.records -= lost
        self.bytes = self.written
        self.pending.clear()
        return lost

    def close(self) -> SegmentInfo:
        assert not self.pending, "flush before close"
        os.fsync(self.fd)
        os.close(self.fd)
        return SegmentInfo(name=self.name, records=self.records, bytes=self.written, sha256=self.digest.hexdigest())

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)


class CaptureWriter:
    """Writes one capture folder, called from one thread at a time (the gateway's observer thread), but for
    `missed`, which the event loop calls: it only adds to a count (and may log its warning twice, at worst)."""

    def __init__(self, policy: CapturePolicy, *, clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time) -> None:
        self.policy = policy
        self._t0 = clock()
        self._started_unix_s = wall()
        self._rng = random.Random(policy.seed)
        self._observed = 0
        self._sampled_out = 0
        self._queue_full = 0
        self._counts: dict[str, int] = dict.fromkeys(CaptureCounts.model_fields, 0)
        self._segments: list[SegmentInfo] = []
        self._segment: _Segment | None = None
        self._stopped: str | None = None
        self._stop_kind = ""
        self._last_offset_s = -1.0
        """The arrival offset of the latest request it holds: where its window ends once it stopped."""
        self._lost_from_s: float | None = None
        """The arrival of the first request that ended after the stop though it arrived within the window."""
        self._logged: set[str] = set()
        self._seq = 0

    @classmethod
    def open(cls, policy: CapturePolicy, **clocks: Any) -> CaptureWriter:
        """Create the capture folder (it must not exist: a capture is never appended to) and start writing."""
        writer = cls(policy, **clocks)
        try:
            policy.dir.parent.mkdir(parents=True, exist_ok=True)
            policy.dir.mkdir(0o700)
            os.chmod(policy.dir, 0o700)
            writer._write_manifest(complete=False)
            writer._reserve()
        except FileExistsError:
            raise FieldError("dir", f"{policy.dir} exists; a capture folder is never reused") from None
        except OSError as exc:
            raise FieldError("dir", f"cannot write {policy.dir}: {exc.strerror or exc}") from None
        return writer

    def observe(self, captured: Captured) -> None:
        """Sample one request and keep its line for `flush`; never raises for the capture's own failures."""
        self._observed += 1
        if self._rng.random() >= self.policy.fraction:
            self._sampled_out += 1
            return
        self._take(captured)

    def missed(self) -> None:
        """A request was dropped before it reached the writer (the observer's queue was full): counted in the
        manifest. Called on the event loop; only ever adds to a count the writer reads. The gateway's observer seam
        logs it, once."""
        self._queue_full += 1

    def flush(self) -> None:
        """Write the batch's lines to the open segment, in one write."""
        if self._segment is None:
            return
        try:
            self._segment.flush()
        except OSError as exc:
            self._salvage()
            self._stop("dropped_after_error", f"cannot write: {exc.strerror or exc}")

    def close(self) -> CaptureManifest:
        """Write what is pending, close the last segment and mark the capture complete (logged, not raised, when
        the manifest cannot be written: the capture then reads as incomplete)."""
        if self._segment is not None:
            try:
                self._close_segment()
            except OSError as exc:
                self._salvage()
                self._stop("dropped_after_error", f"cannot close a segment: {exc.strerror or exc}")
        try:
            return self._write_manifest(complete=True)
        except OSError as exc:
            self._log_once("manifest", f"capture {self.policy.dir}: cannot write {MANIFEST}: {exc.strerror or exc}")
            return self._manifest(complete=False)

    @property
    def counts(self) -> CaptureCounts:
        return CaptureCounts(**{**self._counts, "observed": self._observed + self._queue_full,
                                "sampled_out": self._sampled_out, "dropped_queue_full": self._queue_full})

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message)

    def _take(self, captured: Captured) -> None:
        offset_s = max(0.0, captured.arrival_perf_s - self._t0)
        if self._stopped is not None:
            self._drop_after_stop(offset_s)
            return
        try:
            line = self._line(captured, offset_s)
        except (ValueError, TypeError) as exc:  # a body pydantic cannot write back out: this request only
            self._counts["unreadable"] += 1
            self._log_once("unreadable", f"capture {self.policy.dir}: a request could not be recorded ({exc})")
            return
        if line is not None:
            self._append(line, offset_s)

    def _drop_after_stop(self, offset_s: float) -> None:
        """Count a request the stopped capture does not hold; one that arrived before the last it holds ends the
        whole window there."""
        if offset_s < self._last_offset_s:
            self._counts["dropped_in_window"] += 1
            self._lost_from_s = min(offset_s, self._lost_from_s if self._lost_from_s is not None else offset_s)
        else:
            self._counts[self._stop_kind] += 1

    def _line(self, captured: Captured, offset_s: float) -> bytes | None:
        route = ROUTE_OF.get(captured.path)
        if route is None:
            self._counts["not_a_route"] += 1
            return None
        body: object = captured.request
        if body is None:
            try:
                body = json.loads(captured.body)
            except ValueError:  # invalid UTF-8 among them
                body = None
        if not isinstance(body, dict):
            self._counts["unreadable"] += 1
            return None
        kept, redacted, replayable = redact(route, body, self.policy)
        return record_line(
            seq=self._seq, route=route, path=captured.path, arrival_unix_s=captured.arrival_unix_s,
            offset_s=offset_s, sampling=sampling_of(route, kept),
            headers=kept_headers(captured.headers, self.policy.drop_headers), body=kept,
            redaction=self.policy.redact, redacted=redacted,
            replayable=replayable)

    def _append(self, line: bytes, offset_s: float) -> None:
        limit = self.policy.segment_bytes
        if len(line) > limit:
            self._counts["dropped_too_large"] += 1
            self._log_once("too_large", f"capture {self.policy.dir}: a request larger than a segment "
                           f"({limit} bytes) was dropped (dropped_too_large)")
            return
        try:
            if self._segment is not None and self._segment.bytes + len(line) > limit:
                self._close_segment()
                if len(self._segments) >= self.policy.max_segments:
                    self._stop("dropped_over_bound", f"reached max_bytes {self.policy.max_bytes} in "
                               f"{self.policy.max_segments} segments")
                    self._drop_after_stop(offset_s)
                    return
                self._write_manifest(complete=False)
            if self._segment is None:
                self._segment = _Segment(self.policy.dir, len(self._segments) + 1)
            self._segment.append(line)
            self._counts["written"] += 1
            self._seq += 1
            self._last_offset_s = max(self._last_offset_s, offset_s)
        except OSError as exc:
            self._counts["dropped_write_error"] += 1
            self._salvage()
            self._stop("dropped_after_error", f"cannot write: {exc.strerror or exc}")

    def _salvage(self) -> None:
        """After a failed write, keep the open segment's whole lines (cut back to the last one written, then the
        pending ones written once more, or dropped and counted if they fail again) as a closed segment; where even
        that fails, remove it and count its records as dropped."""
        segment = self._segment
        if segment is None:
            return
        try:
            segment.cut_back()
            try:
                segment.flush()
            except OSError:
                segment.cut_back()
                lost = segment.drop_pending()
                self._counts["written"] -= lost
                self._counts["dropped_write_error"] += lost
            self._close_segment()
        except OSError:
            self._segment = None
            segment.discard()
            self._counts["written"] -= segment.records
            self._counts["dropped_write_error"] += segment.records

    def _close_segment(self) -> None:
        assert self._segment is not None
        self._segment.flush()
        segment, self._segment = self._segment, None
        self._segments.append(segment.close())

    def _stop(self, kind: str, reason: str) -> None:
        self._stopped, self._stop_kind = reason, kind
        self._log_once(kind, f"capture {self.policy.dir}: stopped, {reason}; later requests are dropped and "
                       f"counted ({kind}, or dropped_in_window where they arrived before the last it holds)")
        with contextlib.suppress(OSError):
            self._write_manifest(complete=False)

    def _manifest(self, complete: bool) -> CaptureManifest:
        return CaptureManifest(started_unix_s=self._started_unix_s, policy=self.policy,
                               segments=tuple(self._segments), complete=complete, stopped=self._stopped,
                               counts=self.counts, lost_from_offset_s=self._lost_from_s).sealed()

    def _reserve(self) -> None:
        """Room on disk for the manifest's last rewrites, taken at the start: a disk that fills under the segments
        would otherwise leave no room to say what they hold, and the whole capture would read as unfinished."""
        fd = create_private(self.policy.dir / RESERVE)
        try:  # bytes no file system compresses away, where zeros or a preallocation may take no room
            _write_all(fd, os.urandom(RESERVE_BYTES + MANIFEST_BYTES_PER_SEGMENT * self.policy.max_segments))
        finally:
            os.close(fd)

    def _write_manifest(self, complete: bool) -> CaptureManifest:
        """Written whole or not at all (a new file renamed over the old); where the disk is full, once more after
        the reserve is given back, which is let go too once the capture is complete."""
        manifest = self._manifest(complete)
        data = manifest.model_dump_json(indent=2).encode()
        try:
            self._replace_manifest(data)
        except OSError as exc:
            reserve = self.policy.dir / RESERVE
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not reserve.exists():
                raise
            reserve.unlink()
            self._replace_manifest(data)
        if complete:
            (self.policy.dir / RESERVE).unlink(missing_ok=True)
        return manifest

    def _replace_manifest(self, data: bytes) -> None:
        path = self.policy.dir / MANIFEST
        tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        fd = create_private(tmp)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        os.replace(tmp, path)
