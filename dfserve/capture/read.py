"""Read a capture folder back, trusting nothing: the manifest must say the capture is complete, every segment on
disk must be listed, and each listed segment must have the line count, size and sha256 the writer recorded when
it closed it, and together they must hold as many records as the manifest counts written; the manifest seals its
own fields (what it counts lost, its window). A truncated, edited,
added or missing segment is refused in one line naming it, as is a segment name that would reach outside the folder,
or a record whose redaction contradicts the manifest or its own `replayable` (a hashed capture made to look
replayable).

    manifest, records = read_capture(Path("capture"))
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import ValidationError

from dfserve.capture.format import MANIFEST, SEGMENT_PREFIX, CaptureManifest, CaptureRecord
from dfserve.errors import UserError, describe_invalid
from dfserve.regular_files import read_regular
from dfserve.runs import key_given_twice


def read_manifest(directory: Path) -> CaptureManifest:
    path = directory / MANIFEST
    try:
        data = read_regular(path)
        manifest = CaptureManifest.model_validate_json(data)
        if (twice := key_given_twice(data)) is not None:
            raise UserError(f"{path}: key {twice!r} given twice in one object (edited?)")
        return manifest
    except FileNotFoundError:
        raise UserError(f"capture {directory}: no {MANIFEST} (not a capture folder)") from None
    except OSError as exc:
        raise UserError(f"capture {directory}: cannot read {MANIFEST}: {exc.strerror}") from None
    except ValidationError as exc:
        raise UserError(describe_invalid(exc, str(path))) from None


def read_capture(directory: Path) -> tuple[CaptureManifest, list[CaptureRecord]]:
    """The manifest and every record, in arrival order, of a complete and intact capture."""
    manifest = read_manifest(directory)
    where = f"capture {directory}"
    if not manifest.complete:
        raise UserError(f"{where}: not complete ({MANIFEST} says the writer has not closed it; a capture still "
                        "being written, or one whose writer died)")
    for index, segment in enumerate(manifest.segments):
        if not _plain_name(segment.name):
            raise UserError(f"{where}: {MANIFEST}: segments.{index}.name: {segment.name!r} is not a file name in the "
                            "capture folder (edited)")
    listed = {segment.name for segment in manifest.segments}
    unlisted = sorted(p.name for p in directory.glob(f"{SEGMENT_PREFIX}*") if p.name not in listed)
    if unlisted:
        raise UserError(f"{where}: {unlisted[0]} is not in {MANIFEST} (added or left by a failed write)")
    records: list[CaptureRecord] = []
    for segment in manifest.segments:
        try:
            data = read_regular(directory / segment.name)
        except OSError as exc:
            raise UserError(f"{where}: {segment.name}: {exc.strerror} (listed in {MANIFEST})") from None
        lines = data.split(b"\n")
        if (len(data), len(lines) - 1) != (segment.bytes, segment.records) or lines[-1]:
            raise UserError(f"{where}: {segment.name}: {len(lines) - 1} lines in {len(data)} bytes, {MANIFEST} says "
                            f"{segment.records} in {segment.bytes} (truncated or edited)")
        if hashlib.sha256(data).hexdigest() != segment.sha256:
            raise UserError(f"{where}: {segment.name}: sha256 differs from {MANIFEST}'s (edited)")
        for number, line in enumerate(lines[:-1], start=1):
            try:
                record = CaptureRecord.model_validate(json.loads(line, parse_constant=_not_a_number))
            except ValidationError as exc:
                raise UserError(describe_invalid(exc, f"{directory / segment.name}:{number}")) from None
            except (ValueError, RecursionError) as exc:
                raise UserError(f"{directory / segment.name}:{number}: not a JSON record ({exc})") from None
            contradiction = _contradiction(record, manifest)
            if contradiction is not None:
                raise UserError(f"{where}: {segment.name}:{number}: {contradiction} (edited)")
            records.append(record)
    if [r.seq for r in records] != list(range(len(records))):
        raise UserError(f"{where}: records out of order or missing (seq is not 0, 1, 2, ...)")
    if manifest.counts.written != len(records):
        raise UserError(f"{where}: {MANIFEST} counts {manifest.counts.written} written, its segments hold "
                        f"{len(records)} (edited)")
    if (why := manifest.unsealed()) is not None:
        raise UserError(f"{where}: {MANIFEST} {why}")
    return manifest, records


def _not_a_number(constant: str) -> object:
    """The writer never writes NaN or Infinity: a line that holds one was edited."""
    raise ValueError(f"{constant} is not a JSON number")


def _plain_name(name: str) -> bool:
    """A segment is read as `directory / name`: anything but a bare file name could reach outside the folder."""
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _contradiction(record: CaptureRecord, manifest: CaptureManifest) -> str | None:
    """The writer records every line under the manifest's policy, and a hashed line as not replayable: a record
    that says otherwise would have hashes replayed as prompts."""
    if record.redaction != manifest.policy.redact:
        return f"redaction is {record.redaction} but {MANIFEST}'s policy is redact: {manifest.policy.redact}"
    if record.redaction == "hash" and record.replayable:
        return "replayable is true but redaction is hash: its user text is hashes, not prompts"
    if record.redaction == "keep" and (record.redacted or not record.replayable):
        return "redaction is keep, but the record says it was redacted or cannot be replayed"
    return None
