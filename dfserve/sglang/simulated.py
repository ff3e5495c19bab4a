"""dfserve's own keys in SGLang's protocol, written only by dfserve's simulator (`dfserve.deploy.sim`) and read
by clients so that simulated data is never mistaken for real: the marker of a simulated engine, and the send and
due times of a stream's chunks (--record-chunk-times). SGLang never sends them."""

from __future__ import annotations

from dataclasses import dataclass

from dfserve.errors import ProtocolError
from dfserve.sglang.wire import event_json, float_field, json_bytes, times_field

SIM_CHUNK_SENT_KEY = "dfserve_sim_chunk_sent_unix_s"
"""meta_info key, written only by dfserve's simulator, with the wall-clock time it sent each chunk of a stream."""


SIM_CHUNK_DUE_KEY = "dfserve_sim_chunk_due_unix_s"
"""Beside SIM_CHUNK_SENT_KEY: when the simulator's model scheduled each chunk; sent minus due is its own lateness."""


SIM_TIMES_COMMENT = b": dfserve-sim-times "
"""Starts the SSE comment a simulated OpenAI stream ends with under --record-chunk-times (its final chunk has no
`meta_info` to carry them): a JSON object with SIM_CHUNK_SENT_KEY, SIM_CHUNK_DUE_KEY and `queue_time`. Comments
are ignored by SSE clients, so the stream stays what an OpenAI client expects."""


SIM_MARKER_KEY = "dfserve_simulated"
"""Key in `/server_info` (and every simulated `meta_info`) that marks an engine as dfserve's simulator."""


@dataclass(frozen=True)
class SimStreamTimes:
    """A simulated stream's chunk times (--record-chunk-times): when each chunk was sent and due, and how long the
    request queued; the engine received it at `due_unix_s[0]` minus its prefill minus `queue_time_s`."""

    sent_unix_s: tuple[float, ...]
    due_unix_s: tuple[float, ...]
    queue_time_s: float


def parse_sim_times_comment(events: bytes) -> SimStreamTimes | None:
    """The chunk times a simulated OpenAI stream ended with, from its last events; None when there are none."""
    start = events.rfind(b"\n" + SIM_TIMES_COMMENT) + 1
    if start == 0 and not events.startswith(SIM_TIMES_COMMENT):
        return None
    end = events.find(b"\n", start)
    payload = events[start + len(SIM_TIMES_COMMENT) : end if end >= 0 else len(events)]
    obj = event_json(payload.decode("utf-8", "replace"), "sim times comment")
    sent = times_field(obj.get(SIM_CHUNK_SENT_KEY), SIM_CHUNK_SENT_KEY)
    due = times_field(obj.get(SIM_CHUNK_DUE_KEY), SIM_CHUNK_DUE_KEY)
    queue = float_field(obj, "queue_time")
    if sent is None or due is None or queue is None:
        raise ProtocolError("sim times comment: sent, due and queue_time are all required")
    return SimStreamTimes(sent, due, queue)


def sim_times_comment(times: SimStreamTimes) -> bytes:
    """The SSE comment that carries a simulated OpenAI stream's chunk times, inserted before `data: [DONE]`."""
    return SIM_TIMES_COMMENT + json_bytes({SIM_CHUNK_SENT_KEY: times.sent_unix_s, SIM_CHUNK_DUE_KEY: times.due_unix_s,
                                           "queue_time": times.queue_time_s}) + b"\n\n"
