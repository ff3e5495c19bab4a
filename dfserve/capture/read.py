"""Read a capture folder back, trusting nothing: the manifest must say the capture is complete, every segment on
disk must be listed, and each listed segment must have the line count, size and sha256 the writer recorded when
it closed it. A truncated, edited, added or missing segment is refused in one line naming it.

    manifest, records = read_capture(Path("capture"))
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import ValidationError

from dfserve.capture.format import MANIFEST, SEGMENT_PREFIX, CaptureManifest, CaptureRecord
from dfserve.errors import UserError, describe_invalid


def read_manifest(directory: Path) -> CaptureManifest:
    path = directory / MANIFEST
    try:
        return CaptureManifest.model_validate_json(path.read_bytes())
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
    listed = {segment.name for segment in manifest.segments}
    unlisted = sorted(p.name for p in directory.glob(f"{SEGMENT_PREFIX}*") if p.name not in listed)
    if unlisted:
        raise UserError(f"{where}: {unlisted[0]} is not in {MANIFEST} (added or left by a failed write)")
    records: list[CaptureRecord] = []
    for segment in manifest.segments:
        try:
            data = (directory / segment.name).read_bytes()
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
                records.append(CaptureRecord.model_validate_json(line))
            except ValidationError as exc:
                raise UserError(describe_invalid(exc, f"{directory / segment.name}:{number}")) from None
    if [r.seq for r in records] != list(range(len(records))):
        raise UserError(f"{where}: records out of order or missing (seq is not 0, 1, 2, ...)")
    return manifest, records
