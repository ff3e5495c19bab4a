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
import re
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
_SHARD = re.compile(r"-\d+-of-\d+\.[^.]+$")
"""A Hugging Face shard's name (`model-00001-of-00002.safetensors`); its folder's `*.index.json` names them all."""


class Incomplete(FieldError):
    """A candidate still being written (a sharded folder short of a shard or of its index): waited for, never
    called corrupt."""


class Gone(FieldError):
    """A candidate the trainer removed (rotated away) before the watch read or staged it all."""


def scan(root: Path) -> list[Seen]:
    """Every candidate under `root`: a folder with a config.json and safetensors weights is one candidate (a Hugging
    Face checkpoint), any other weights file is one (`step_N/checkpoint.pt` beside the trainer's config.json);
    temporary names are left out."""
    found: list[Seen] = []
    _walk(root, root, 0, found)
    return found


def _walk(root: Path, folder: Path, depth: int, found: list[Seen]) -> None:
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return
    names = {e.name for e in entries}
    if folder != root and "config.json" in names and any(n.lower().endswith(".safetensors") for n in names):
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
            elif (entry.is_file(follow_symlinks=False) and is_weights(entry.name)) or _linked_from_outside(root, entry):
                stat = entry.stat()
                found.append(Seen(relative, False, stat.st_size, stat.st_mtime_ns))
        except FileNotFoundError:  # rotated away by the trainer between listing and stat
            continue


def _linked_from_outside(root: Path, entry: os.DirEntry[str]) -> bool:
    """A link to a weights file outside the checkpoint folder is a checkpoint; one to a file inside (`latest.pt`) is
    another name of one the walk finds as itself."""
    if not entry.is_symlink() or not is_weights(entry.name) or not entry.is_file():
        return False
    return not Path(entry.path).resolve().is_relative_to(root.resolve())


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
    Raises FieldError('checkpoint') with what failed: Incomplete for a sharded folder short of a file (to wait
    for, not a damage), Gone for a candidate removed meanwhile."""
    try:
        if path.is_dir():
            return _probe_folder(path)
        return _probe_file(path)
    except FieldError:
        raise
    except Exception as exc:  # torch and safetensors raise many kinds for a damaged file
        if not path.exists():
            raise Gone("checkpoint", f"{path} was removed before it was read") from None
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
    _check_shards(folder)
    step = None
    for path in model_weights(folder):
        try:
            found = _probe_file(path).step
        except Exception as exc:  # torch and safetensors raise many kinds for a damaged file
            if not path.exists():
                raise
            raise FieldError("checkpoint", f"{path} does not load ({exc.__class__.__name__}: "
                             f"{str(exc).splitlines()[0][:160] if str(exc) else 'no detail'})") from None
        step = found if step is None else step
    state = folder / "trainer_state.json"
    if state.is_file():
        step = _step_in(json.loads(state.read_text())) if step is None else step
    return Probe(step)


def model_weights(folder: Path) -> list[Path]:
    """The files a model is loaded from in a folder, as transformers loads it: its safetensors, else its
    `pytorch_model*.bin`. A trainer's folder holds more (`optimizer.pt`, `rng_state.pth`, `training_args.bin`): not
    weights, some not loadable without running pickled code, and an optimizer's state is larger than the model."""
    files = [p for p in _files(folder) if p.parent == folder]
    return ([p for p in files if p.suffix == ".safetensors"]
            or [p for p in files if p.name.startswith("pytorch_model") and p.suffix == ".bin"])


def _check_shards(folder: Path) -> None:
    """A trainer writes a sharded folder's shards one by one and its index before or after them, each file steady
    on its own: whole only once an index is there and every shard it names is. Raises Incomplete until then."""
    top = [p for p in _files(folder) if p.parent == folder]
    indexes = [p for p in top if p.name.endswith(".index.json")]
    if not indexes:
        if shard := next((p.name for p in top if is_weights(p.name) and _SHARD.search(p.name)), None):
            raise Incomplete("checkpoint", f"{folder} holds the shard {shard} but no *.index.json yet")
        return
    for index in indexes:
        try:
            shards = json.loads(index.read_text())["weight_map"].values()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FieldError("checkpoint", f"{index} is not a shard index with a weight_map ({exc!r})") from None
        if not all(isinstance(name, str) for name in shards):
            raise FieldError("checkpoint", f"{index}: weight_map names a shard by something else than a file name")
        if missing := sorted({name for name in shards if not (folder / name).is_file()}):
            raise Incomplete("checkpoint", f"{folder}: {index.name} names {missing[0]}"
                             + (f" and {len(missing) - 1} more shards" if len(missing) > 1 else "") + ", not there yet")


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
    written; a staging cut short leaves nothing under `staged`'s name. One staged before is reused only while it
    still is its source file for file (a trainer replaces a checkpoint by renaming a new file over it, or adds the
    rest of a folder): else it is staged again. Raises Gone when `source` was removed."""
    if staged.exists():
        if _staged_from(source, staged, mode):
            return staged
        _discard(staged)
    staged.parent.mkdir(parents=True, exist_ok=True)
    partial = staged.with_name(f".{staged.name}.staging")
    _discard(partial)  # left by a staging cut short
    current = source
    try:
        if source.is_dir():
            for current in _files(source):
                target = partial / current.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                _place(current, target, mode)
        else:
            _place(source, partial, mode)
    except OSError as exc:
        _discard(partial)
        if not current.exists():
            raise Gone("checkpoint", f"{current} was removed before it was staged") from None
        if exc.errno == errno.EXDEV:
            raise FieldError("stage", f"{staged.parent} is on another file system than {source}; a hard link is "
                             "impossible (stage by copy instead)") from None
        raise FieldError("stage", f"cannot stage {source} at {staged} ({exc.strerror})") from None
    os.replace(partial, staged)
    return staged


def _staged_from(source: Path, staged: Path, mode: StageMode) -> bool:
    """Whether `staged` holds `source`'s files as they are now: the same files (linked) or the same sizes and
    modification times (copied, which keeps the source's)."""
    try:
        if not source.is_dir():
            return _same(source.stat(), staged.stat(), mode)
        ours = sorted(p for p in staged.rglob("*") if p.is_file())
        theirs = _files(source)
        return ([p.relative_to(staged) for p in ours] == [p.relative_to(source) for p in theirs]
                and all(_same(t.stat(), o.stat(), mode) for t, o in zip(theirs, ours, strict=True)))
    except FileNotFoundError:
        return False


def _same(source: os.stat_result, staged: os.stat_result, mode: StageMode) -> bool:
    if mode == "link":
        return os.path.samestat(source, staged)
    return (source.st_size, source.st_mtime_ns) == (staged.st_size, staged.st_mtime_ns)


def _discard(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _place(source: Path, target: Path, mode: StageMode) -> None:
    if mode == "link":
        os.link(source, target)
    else:
        stat = source.stat()  # before the bytes: a change while copying leaves the copy looking older
        shutil.copyfile(source, target)
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
