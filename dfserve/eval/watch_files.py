"""The watch's file work on a trainer's checkpoint folder, which it only ever reads: what is there (`scan`), whether
a complete-looking candidate loads and which step it holds (`probe`), and its staging beside the watch's runs
(`stage`: hard links, or a copy when asked, never a write into the checkpoint folder).

    seen = scan(Path("/checkpoints"))
    step = probe(Path("/checkpoints/step_1000/checkpoint.pt")).step
    staged = stage(Path("/checkpoints/step_1000/checkpoint.pt"), Path("watch/staged/step-000001000.pt"), "link")
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dfserve.errors import FieldError
from dfserve.eval.watch_discovery import Seen, is_temporary, is_weights

StageMode = Literal["link", "copy"]
STEP_KEYS = ("step", "global_step", "iteration", "train_step")
"""Where trainers store the step in a checkpoint (a torch dict's top level, safetensors metadata)."""
_MAX_DEPTH = 3


def scan(root: Path) -> list[Seen]:
    """Every candidate under `root`: a folder with a config.json and weights is one candidate (a Hugging Face
    checkpoint), any other weights file is one; temporary names are left out."""
    found: list[Seen] = []
    _walk(root, root, 0, found)
    return found


def _walk(root: Path, folder: Path, depth: int, found: list[Seen]) -> None:
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return
    names = {e.name for e in entries}
    if folder != root and "config.json" in names and any(is_weights(n) for n in names):
        if (seen := _folder(root, folder)) is not None:
            found.append(seen)
        return
    for entry in entries:
        relative = str(Path(entry.path).relative_to(root))
        if is_temporary(relative):
            continue
        try:
            if entry.is_dir(follow_symlinks=False) and depth < _MAX_DEPTH:
                _walk(root, Path(entry.path), depth + 1, found)
            elif entry.is_file(follow_symlinks=False) and is_weights(entry.name):
                stat = entry.stat()
                found.append(Seen(relative, False, stat.st_size, stat.st_mtime_ns))
        except FileNotFoundError:  # rotated away by the trainer between listing and stat
            continue


def _folder(root: Path, folder: Path) -> Seen | None:
    size = mtime = 0
    try:
        for path in _files(folder):
            stat = path.stat()
            size += stat.st_size
            mtime = max(mtime, stat.st_mtime_ns)
    except FileNotFoundError:
        return None
    return Seen(str(folder.relative_to(root)), True, size, mtime)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not is_temporary(str(p.relative_to(folder))))


@dataclass(frozen=True)
class Probe:
    step: int | None
    """The step stored in the checkpoint, when the trainer stored one."""


def probe(path: Path) -> Probe:
    """Load the candidate whole (every tensor read): a file still being written or cut short fails here.
    Raises FieldError('checkpoint') with what failed."""
    try:
        if path.is_dir():
            return _probe_folder(path)
        return _probe_file(path)
    except FieldError:
        raise
    except Exception as exc:  # torch and safetensors raise many kinds for a damaged file
        raise FieldError("checkpoint", f"{path} does not load ({exc.__class__.__name__}: "
                         f"{str(exc).splitlines()[0][:160] if str(exc) else 'no detail'})") from None


def _probe_file(path: Path) -> Probe:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                handle.get_tensor(name)
            return Probe(_step_in(handle.metadata() or {}))
    import torch

    loaded = torch.load(path, map_location="cpu", weights_only=True)
    return Probe(_step_in(loaded) if isinstance(loaded, dict) else None)


def _probe_folder(folder: Path) -> Probe:
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise FieldError("checkpoint", f"{folder / 'config.json'} is not readable JSON ({exc})") from None
    step = None
    for path in _files(folder):
        if is_weights(path.name):
            step = _probe_file(path).step if step is None else step
    state = folder / "trainer_state.json"
    if state.is_file():
        step = _step_in(json.loads(state.read_text())) if step is None else step
    return Probe(step)


def _step_in(container: dict[str, Any]) -> int | None:
    for key in STEP_KEYS:
        value = container.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.isdigit():
            return int(value)
    return None


def stage(source: Path, staged: Path, mode: StageMode) -> Path:
    """`source` (a file or a folder) placed at `staged` by hard links, or copied when `mode` is 'copy' (a
    checkpoint volume mounted read-only is another file system: no link can cross it). Only `staged`'s side is
    written; a staging cut short leaves nothing under `staged`'s name."""
    if staged.exists():
        return staged
    staged.parent.mkdir(parents=True, exist_ok=True)
    partial = staged.with_name(f".{staged.name}.staging")
    if partial.is_dir():  # left by a staging cut short
        shutil.rmtree(partial)
    elif partial.exists():
        partial.unlink()
    try:
        if source.is_dir():
            for path in _files(source):
                target = partial / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                _place(path, target, mode)
        else:
            _place(source, partial, mode)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise FieldError("stage", f"{staged.parent} is on another file system than {source}; a hard link is "
                             "impossible (stage by copy instead)") from None
        raise FieldError("stage", f"cannot stage {source} at {staged} ({exc.strerror})") from None
    os.replace(partial, staged)
    return staged


def _place(source: Path, target: Path, mode: StageMode) -> None:
    if mode == "link":
        os.link(source, target)
    else:
        shutil.copyfile(source, target)
