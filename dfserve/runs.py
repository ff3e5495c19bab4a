"""Immutable run directories: created once, written atomically, never reopened for writing.

The lesson behind this module: an evaluation once overwrote an earlier baseline's results. Here a run directory is
made with `mkdir` (which fails if it exists), whole files are written to a temporary name and renamed into place,
and streamed records are appended to a file the run itself created.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import platform
import secrets
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import IO, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dfserve.deploy.hashes import file_sha256
from dfserve.errors import FieldError, UserError, describe_invalid
from dfserve.regular_files import read_regular


def utc_now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def new_run_id(prefix: str = "run") -> str:
    """Unique, and sorted by name in creation order (to the microsecond: two starts can share a second)."""
    return f"{prefix}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S.%fZ')}-{secrets.token_hex(3)}"


NAME_BYTES = 255
"""The longest file name Linux file systems take."""


def run_name(name: str) -> str:
    """`name` if it names a folder directly under the output folder: one path component, not hidden (temporary
    files and staged folders begin with a dot). A `FieldError` about `name` otherwise: `--name ../../x` must not
    write outside `--out`."""
    if not name:
        problem = "is empty"
    elif "/" in name or "\\" in name or "\0" in name:
        problem = "holds a path separator or NUL; it must be one folder name"
    elif name.startswith("."):
        problem = "begins with a dot ('..' leaves the output folder; other dotted names are hidden or temporary)"
    elif len(name.encode()) > NAME_BYTES:
        problem = f"is longer than {NAME_BYTES} bytes"
    else:
        return name
    raise FieldError("name", f"run name {name!r} {problem}")


def create_run_dir(out: Path, name: str | None = None, prefix: str = "run") -> Path:
    """Make a new, empty run directory under `out`; an existing name is an error, never reused."""
    path = out / (new_run_id(prefix) if name is None else run_name(name))
    out.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir()
    except FileExistsError:
        raise FieldError("name", f"run directory {path} already exists; runs are never overwritten") from None
    return path


SHARED_FILE_MODE = 0o644
SHARED_FOLDER_MODE = 0o755
"""What run files and staged folders (a converted drafter, a feature cache) are created with: read by other users
than their writer (an engine pod's uid, a colleague comparing runs), as files written plainly are under the usual
umask. Captures of live requests are not: they hold users' text (`capture.writer`)."""


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write a whole file or nothing: temp file in the same folder, fsync, rename. Refuses to replace a file."""
    if path.exists():
        raise FileExistsError(f"{path} exists; run files are written once")
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, SHARED_FILE_MODE)  # mkstemp's 0600 would keep a run or a drafter from the pods that read it
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, path)  # fails if `path` appeared meanwhile, unlike rename
    finally:
        os.unlink(tmp)


def write_model(path: Path, model: BaseModel) -> None:
    write_atomic(path, model.model_dump_json(indent=2) + "\n")


@contextlib.contextmanager
def staged_folder(final: Path) -> Iterator[Path]:
    """A folder that appears whole or not at all: written in a temporary sibling, renamed to `final` at the end.
    If another writer of the same content-addressed folder won the race, its folder is kept and this one dropped;
    on an error nothing is left behind."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    tmp.chmod(SHARED_FOLDER_MODE)
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def link_input(source: Path, staged: Path, field: str) -> Path:
    """Hard-link a large input (a 15 GB checkpoint) to `staged`, never copied; linking the same file again does
    nothing. Failures are about `field`, the input naming the folder `staged` lies in."""
    if staged.exists():
        if staged.samefile(source):
            return staged
        raise FieldError(field, f"{staged} already holds another file than {source}")
    try:
        os.link(source, staged)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise FieldError(field, f"{staged.parent} is on another file system than {source}; a hard link is "
                             "impossible and a copy is refused") from None
        raise FieldError(field, f"cannot hard-link {source} to {staged} ({exc.strerror})") from None
    return staged


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


M = TypeVar("M", bound=BaseModel)


def read_model(path: Path, model: type[M], missing: str) -> M:
    """A pydantic document from disk; a missing or malformed file is a `UserError` naming the file and field, and
    a document of another kind (an eval run's config where a load test's is read) is named as such, as is a key
    given twice in one object (JSON readers keep one of the two, each its own)."""
    try:
        data = read_regular(path)
        document = model.model_validate_json(data)
        if (twice := key_given_twice(data)) is not None:
            raise UserError(f"{path}: key {twice!r} given twice in one object (edited?)")
        return document
    except FileNotFoundError:
        raise UserError(missing) from None
    except OSError as exc:  # a folder where the file should be, say
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    except ValidationError as exc:
        wanted = model.model_fields.get("kind")
        found = _kind_of(data)
        if wanted is not None and isinstance(found, str) and found != wanted.default:
            raise UserError(f"{path}: kind is {found}, not {wanted.default} (another command's folder)") from None
        raise UserError(describe_invalid(exc, str(path))) from None


class _Twice(Exception):
    """A key given twice, found while parsing (`key_given_twice`)."""


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _Twice(key)
        seen.add(key)
    return dict(pairs)


def key_given_twice(data: bytes) -> str | None:
    """A key some object of the JSON document `data` gives twice, if any."""
    try:
        json.loads(data, object_pairs_hook=_unique)
    except _Twice as twice:
        return str(twice.args[0])
    except (ValueError, RecursionError):
        return None
    return None


def _kind_of(data: bytes) -> object:
    """The `kind` member of a JSON object, if `data` is one that has it."""
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return document.get("kind") if isinstance(document, dict) else None


S = TypeVar("S", bound="SealedSummary")


def fields_sha256(model: BaseModel, seal: str) -> str:
    """The seal of a document's own fields: sha256 of its JSON with the field `seal` (where the seal is kept) unset."""
    return hashlib.sha256(model.model_copy(update={seal: None}).model_dump_json().encode()).hexdigest()


class SealedSummary(BaseModel):
    """A run's summary.json: it holds the seals of the run's other files, and seals its own fields, so that turning
    `interrupted` off, or dropping a seal to edit what it sealed, shows. Like every seal here, it catches an edit,
    not a forger who computes it again."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    summary_sha256: str | None = Field(None, description="sha256 of this summary's other fields (`sealed`); None "
                                       "in a summary older than this seal")

    def sealed(self: S) -> S:
        """This summary with the seal of its own fields, as it is written."""
        return self.model_copy(update={"summary_sha256": self._fields_sha256()})

    def _fields_sha256(self) -> str:
        return fields_sha256(self, "summary_sha256")

    def unsealed(self, path: Path) -> str | None:
        """Why this summary, read from `path`, is not as its writer left it; None when it is."""
        where = f"{path.parent.name}/{path.name}"
        if self.summary_sha256 is None:
            return (f"{where} holds no sha256 of its own fields (written by an older dfserve, or edited): whether its "
                    "run was interrupted cannot be checked")
        if self.summary_sha256 != self._fields_sha256():
            return f"{where} is not as its writer left it (its fields' sha256 is not the one it holds): edited"
        return None


def unsealed(path: Path, sealed: str | None) -> str | None:
    """Why the records file at `path` is not as its writer left it, `sealed` being the sha256 its summary holds
    (`file_sha256` of it, taken when the summary was written): a record edited since, however its figures are kept,
    shows. None when it is as written."""
    if sealed is None:
        return (f"{path.parent.name}/summary.json holds no sha256 of {path.name} (written by an older dfserve, or "
                "edited): its records cannot be checked")
    if file_sha256(path) != sealed:
        return f"{path.parent.name}/{path.name} is not as its writer left it (its sha256 is not summary.json's): edited"
    return None


def read_jsonl(path: Path, model: type[M], what: str) -> Iterator[M]:
    """Read what a `JsonlAppender` wrote: lines end in LF only (a string may hold any other line break, U+2028
    say, as JSON lets it). A torn last line (a crash mid-write: no LF after it) is skipped; anything else
    malformed, bytes that are not UTF-8 included, is an error naming the line."""
    try:
        lines = read_regular(path).split(b"\n")
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield model.model_validate_json(line)
        except ValidationError as exc:
            if number == len(lines):
                return
            raise UserError(f"{path}:{number}: not {what} ({exc.errors()[0]['msg']})") from None


def package_versions(*names: str) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


SECRET_FLAGS = ("--api-key",)
"""Flags whose values never reach a file; `--header` keeps its name only."""


def redacted(argv: list[str]) -> list[str]:
    """A command line fit to be written down: secret flags' values and header values replaced by `***`."""
    out: list[str] = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        previous = out[-1] if out else ""
        if eq and flag in SECRET_FLAGS:
            arg = f"{flag}=***"
        elif eq and flag == "--header":
            arg = f"--header={value.partition(':')[0]}: ***"
        elif previous in SECRET_FLAGS:
            arg = "***"
        elif previous == "--header":
            arg = f"{arg.partition(':')[0]}: ***"
        out.append(arg)
    return out


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
            argv=redacted(sys.argv),
            versions=package_versions("dfserve", "httpx", "numpy"),
        )
