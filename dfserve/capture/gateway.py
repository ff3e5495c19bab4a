"""The gateway's side of capture: a request the gateway read becomes a `Captured` for `CaptureWriter.observe`.

The gateway's observer calls this with the request and the arrival stamps it took when the request's head came
in (wall clock for provenance, `perf_counter` for the replay's offsets); only POSTs are captured.

    writer = CaptureWriter.open(policy)
    observe = capture_observer(writer)
    observe(request, arrival_unix_s, arrival_perf_s)   # from the gateway's observer, off the hot path
"""

from __future__ import annotations

from collections.abc import Callable

from dfserve.capture.writer import Captured, CaptureWriter
from dfserve.gateway.server import Request

RequestObserver = Callable[[Request, float, float], None]


def captured(request: Request, arrival_unix_s: float, arrival_perf_s: float) -> Captured | None:
    """What the writer keeps of a gateway request; None for a request that carries no body to replay."""
    if request.method != "POST":
        return None
    return Captured(request.path, request.body, request.headers, arrival_unix_s, arrival_perf_s)


def capture_observer(writer: CaptureWriter) -> RequestObserver:
    def observe(request: Request, arrival_unix_s: float, arrival_perf_s: float) -> None:
        item = captured(request, arrival_unix_s, arrival_perf_s)
        if item is not None:
            writer.observe(item)

    return observe
