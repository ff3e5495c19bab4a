"""Content hashes of model files, remembered per file identity so a 15 GB checkpoint or 54 GB of target weights is
read once per machine, not once per command::

    digest = file_sha256(Path("checkpoint.pt"), cache=Path("deployments/drafters/.hashes"))
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from dfserve.regular_files import open_regular


def file_sha256(path: Path, cache: Path | None = None, remember: bool = True) -> str:
    """SHA-256 of a file's content; remembered under `cache` per (device, inode, size, mtime) so 15 GB is read once."""
    key = _hash_key(path, cache)
    if key is not None and key.is_file():
        return key.read_text(encoding="utf-8").strip()
    digest = hashlib.sha256()
    with open_regular(path) as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    value = digest.hexdigest()
    if remember:
        remember_sha256(path, cache, value)
    return value


def _hash_key(path: Path, cache: Path | None) -> Path | None:
    stat = path.stat()
    return cache / f"{stat.st_dev}-{stat.st_ino}-{stat.st_size}-{stat.st_mtime_ns}.sha256" if cache else None


def remember_sha256(path: Path, cache: Path | None, value: str) -> None:
    key = _hash_key(path, cache)
    if key is None or key.is_file():
        return
    key.parent.mkdir(parents=True, exist_ok=True)
    tmp = key.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(value + "\n", encoding="utf-8")
    os.replace(tmp, key)


def folder_sha256(folder: Path, cache: Path | None = None) -> str:
    """One hash over a model folder: each config and weight file's name and content hash, in name order."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.suffix in (".json", ".safetensors"):
            digest.update(f"{path.name}\0{file_sha256(path, cache)}\n".encode())
    return digest.hexdigest()
