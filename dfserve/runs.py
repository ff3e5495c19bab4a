"""Immutable run directories: created once, written atomically, never reopened for writing.

The lesson behind this module: an evaluation once overwrote an earlier baseline's results. Here a run directory is
made with `mkdir` (which fails if it exists), whole files are written to a temporary name and renamed into place,
and streamed records are appended to a file the run itself created.
"""

from __future__ import annotations

import os
import platform
import secrets
import socket
import sys
import tempfile
from collections.abc import Iterable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import IO

from pydantic import BaseModel

from dfserve.errors import UserError


def utc_now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def new_run_id(prefix: str = "run") -> str:
    """Unique, and sorted by name in creation order (to the microsecond: two starts can share a second)."""
    return f"{prefix}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S.%fZ')}-{secrets.token_hex(3)}"


def create_run_dir(out: Path, name: str | None = None, prefix: str = "run") -> Path:
    """Make a new, empty run directory under `out`; an existing name is an error, never reused."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / (name or new_run_id(prefix))
    try:
        path.mkdir()
    except FileExistsError:
        raise UserError(f"--name: run directory {path} already exists; runs are never overwritten") from None
    return path


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write a whole file or nothing: temp file in the same folder, fsync, rename. Refuses to replace a file."""
    if path.exists():
        raise FileExistsError(f"{path} exists; run files are written once")
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, path)  # fails if `path` appeared meanwhile, unlike rename
    finally:
        os.unlink(tmp)


def write_model(path: Path, model: BaseModel) -> None:
    write_atomic(path, model.model_dump_json(indent=2) + "\n")


class JsonlAppender:
    """Appends one JSON line per record and flushes it, so a crash loses at most what was in flight."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: IO[str] = path.open("x", encoding="utf-8")  # "x": the file must be new

    def append(self, model: BaseModel) -> None:
        self.write_lines((model.model_dump_json() + "\n",))

    def write_lines(self, lines: Iterable[str]) -> None:
        """Append lines already serialised (each ending in a newline) with one flush."""
        self._handle.write("".join(lines))
        self._handle.flush()

    def close(self) -> None:
        if not self._handle.closed:
            os.fsync(self._handle.fileno())
            self._handle.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def package_versions(*names: str) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


class Provenance(BaseModel):
    """Where and with what a file was produced."""

    created_at: str
    host: str
    python: str
    platform: str
    argv: list[str]
    versions: dict[str, str]

    @classmethod
    def here(cls) -> Provenance:
        return cls(
            created_at=utc_now_iso(),
            host=socket.gethostname(),
            python=sys.version.split()[0],
            platform=platform.platform(),
            argv=list(sys.argv),
            versions=package_versions("dfserve", "aiohttp", "numpy"),
        )
