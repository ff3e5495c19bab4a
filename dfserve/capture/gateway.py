"""The gateway's side of capture: an observer of finished exchanges that hands each client request to a
`CaptureWriter`.

The gateway tells its observers of every exchange once it is over, on a thread of their own; this observer keeps
the client's request (not its shadow mirrors, which are copies of it) with the time it arrived: the gateway's
`perf_counter` stamp of the request having been read (the replay's offsets), and the wall clock derived from it
(provenance). It reads only the fields it names (`FinishedExchange`), so the gateway's own record type fits it.

It is the gateway's observer kind `capture` (the config's `capture:` block, `--capture DIR`, or an entry of
`observers:` with these options). A request the gateway retried on another replica is still one exchange, so it is
captured once.

    observer = CaptureObserver.from_options({"dir": "/var/lib/dfserve/capture", "fraction": 0.1})
    observer.observe(exchanged)   # from the gateway's observer thread, a batch at a time
    observer.flush()              # after each batch: its lines in one write
    observer.close()              # the gateway stops: the last segment is closed, the manifest marked complete
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError

from dfserve.capture.format import CapturePolicy
from dfserve.capture.writer import Captured, CaptureWriter
from dfserve.errors import FieldError
from dfserve.gateway.observers import register


class FinishedExchange(Protocol):
    """What capture reads of an exchange the gateway finished."""

    @property
    def mirror(self) -> bool: ...
    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def headers(self) -> bytes:
        """Header lines as passed upstream (`name: value\\r\\n` each), credentials included: capture drops them."""
    @property
    def body(self) -> bytes: ...
    @property
    def start_s(self) -> float:
        """When the client's request had been read, on `time.perf_counter`'s clock."""
    @property
    def request(self) -> Mapping[str, Any] | None:
        """The body as the gateway decoded it, if it did."""


def header_pairs(lines: bytes) -> list[tuple[bytes, bytes]]:
    pairs = []
    for line in lines.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            pairs.append((name.strip(), value.strip()))
    return pairs


def is_captured(exchanged: FinishedExchange) -> bool:
    """A client's request with a body to replay: not a shadow mirror (a copy of one)."""
    return not exchanged.mirror and exchanged.method == "POST"


def captured(exchanged: FinishedExchange, now_unix_s: float, now_perf_s: float) -> Captured | None:
    """What the writer keeps of an exchange; None for one not captured (`is_captured`)."""
    if not is_captured(exchanged):
        return None
    arrival_unix_s = now_unix_s - (now_perf_s - exchanged.start_s)
    return Captured(exchanged.path, exchanged.body, header_pairs(exchanged.headers), arrival_unix_s, exchanged.start_s,
                    exchanged.request)


class CaptureObserver:
    """A gateway observer that captures client requests (`observe`, `flush`, `close`, as the gateway's observers
    have, and `missed`, so that the manifest counts what the observer's full queue dropped)."""

    def __init__(self, writer: CaptureWriter, *, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.writer = writer
        self._wall = wall
        self._clock = clock

    @classmethod
    def of_policy(cls, policy: CapturePolicy) -> CaptureObserver:
        try:
            return cls(CaptureWriter.open(policy))
        except FieldError as exc:
            raise FieldError(f"capture.{exc.field}", exc.message) from None

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> CaptureObserver:
        """From an `observers:` entry's options (`CapturePolicy`'s fields, but for `queue_size`: the entry's own
        sizes the queue); `FieldError` naming the field."""
        if "queue_size" in options:
            raise FieldError("capture.queue_size", "an observers entry's queue is sized by the entry's own "
                             "queue_size, not by its options")
        try:
            policy = CapturePolicy.model_validate(dict(options))
        except ValidationError as exc:
            first = exc.errors()[0]
            raise FieldError(".".join(["capture", *map(str, first["loc"])]), first["msg"]) from None
        return cls.of_policy(policy)

    def observe(self, exchanged: FinishedExchange) -> None:
        item = captured(exchanged, self._wall(), self._clock())
        if item is not None:
            self.writer.observe(item)

    def missed(self, exchanged: FinishedExchange) -> None:
        if is_captured(exchanged):
            self.writer.missed()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


register("capture")(CaptureObserver.from_options)
