"""The send times a simulated native stream carries in its final chunk (`--record-chunk-times`): SGLang's stream
encoder, extended by the key only the simulator writes (`dfserve.sglang.simulated`)."""

from __future__ import annotations

from collections.abc import Sequence

from dfserve.sglang.server import NativeStreamEncoder
from dfserve.sglang.simulated import SIM_CHUNK_SENT_KEY


class StampedStreamEncoder(NativeStreamEncoder):
    """A `NativeStreamEncoder` that also adds the stream's send times to the last event it sends."""

    def __init__(self, incremental: bool) -> None:
        super().__init__(incremental)
        self._sent = b""
        self._sent_count = 0

    def with_sent_times(self, event: bytes, sent_unix_s: Sequence[float]) -> bytes:
        """`event` with SIM_CHUNK_SENT_KEY added last to its `meta_info` (the event's last key).

        The simulator encodes a final chunk before it is due and adds the send times as it sends it; times encoded
        by `encode_sent_times` beforehand are reused, so only the last one is formatted then.
        """
        end = b"}}\n\n"
        if not event.endswith(end):
            raise ValueError("not a native event whose last key is meta_info")
        self.encode_sent_times(sent_unix_s)
        return b"".join((event[: -len(end)], b',"', SIM_CHUNK_SENT_KEY.encode(), b'":[', self._sent, b"]", end))

    def encode_sent_times(self, sent_unix_s: Sequence[float]) -> None:
        """Format the send times not formatted yet (a stream's times only grow); each float costs a third of a µs."""
        new = ",".join(map(float.__repr__, sent_unix_s[self._sent_count :])).encode()
        self._sent = self._sent + b"," + new if self._sent and new else self._sent or new
        self._sent_count = len(sent_unix_s)
