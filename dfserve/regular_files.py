"""Files read where a pipe or a device may have been put instead: a run's records, a drafter's weights, the files
a user names (gates, configs, captures, task lists)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO


def open_regular(path: Path) -> BinaryIO:
    """A file open for reading; `OSError` for anything but a regular file (a link is followed): a pipe or a device
    put where a file should be would block or never end."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    file = open(descriptor, "rb")  # the caller's to close
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        file.close()
        raise OSError(errno.EINVAL, "not a regular file")
    return file


def read_regular(path: Path) -> bytes:
    """The bytes of a regular file; `OSError` as `open_regular` raises it for anything else."""
    with open_regular(path) as file:
        return file.read()
