"""The per-read work (reads dated by the kernel, de-chunking, relaying whole events, token marks): the C extension
`dfserve._relay` where it was built, else its pure-Python twin `dfserve._relay_py`, which behaves the same at more
CPU per chunk.

Import these names from here, never from either module, so that an install without a compiler works. Which one
is in use is `ACCELERATED`; falling back says so once, on the `dfserve` logger, with the reason the extension did
not import.
"""

from __future__ import annotations

import logging

try:
    from dfserve._relay import (
        LAST_CHUNK,
        BadChunk,
        Dechunker,
        EventRelay,
        EventTooLarge,
        StampedReader,
        frame,
        read_marks,
    )

    ACCELERATED = True
except ImportError as exc:
    from dfserve._relay_py import (
        LAST_CHUNK,
        BadChunk,
        Dechunker,
        EventRelay,
        EventTooLarge,
        StampedReader,
        frame,
        read_marks,
    )

    ACCELERATED = False
    logging.getLogger("dfserve").warning(
        "the C relay (dfserve._relay) did not import (%s); using its pure-Python twin, which costs more CPU per "
        "chunk: reinstall dfserve where gcc and the Python headers are", exc)

__all__ = ["ACCELERATED", "LAST_CHUNK", "BadChunk", "Dechunker", "EventRelay", "EventTooLarge", "StampedReader", "frame",
           "read_marks"]
