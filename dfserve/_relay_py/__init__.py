"""The pure-Python twin of the C extension `dfserve._relay`: the same API and the same behaviour, byte for byte,
for installs where the extension could not be built (no compiler); `dfserve.relay_core` picks one.

It costs more CPU per chunk (the reason the extension exists: dfserve/relay_c/relay.h), nothing else: the
gateway and the load tester work the same on either, and tests/unit/test_relay_differential.py runs both on the
same inputs, broken framing included. One module per C source, so the twins read side by side: `module`
(module.c: the exceptions), `frame` (frame.c), `marks` (marks.c: `read_marks`), `members` (members.c: members cut
out of events, and where events end), `bins` (bins.c), `event_relay` (event_relay.c: `EventRelay`), `dechunker`
(dechunker.c: `Dechunker`) and `reader` (reader.c: `StampedReader`).
"""

from dfserve._relay_py.dechunker import Dechunker
from dfserve._relay_py.event_relay import EventRelay
from dfserve._relay_py.frame import LAST_CHUNK, frame
from dfserve._relay_py.marks import read_marks
from dfserve._relay_py.module import BadChunk, EventTooLarge
from dfserve._relay_py.reader import StampedReader

__all__ = ["LAST_CHUNK", "BadChunk", "Dechunker", "EventRelay", "EventTooLarge", "StampedReader", "frame",
           "read_marks"]
