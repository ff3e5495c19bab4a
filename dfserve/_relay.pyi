"""Types of the C extension `dfserve._relay` (dfserve/relay_c/): those of its pure-Python twin, `dfserve._relay_py`,
whose API and behaviour it has exactly (tests/unit/test_relay_differential.py)."""

from dfserve._relay_py import LAST_CHUNK as LAST_CHUNK
from dfserve._relay_py import BadChunk as BadChunk
from dfserve._relay_py import Dechunker as Dechunker
from dfserve._relay_py import EventRelay as EventRelay
from dfserve._relay_py import EventTooLarge as EventTooLarge
from dfserve._relay_py import StampedReader as StampedReader
from dfserve._relay_py import frame as frame
from dfserve._relay_py import read_marks as read_marks
