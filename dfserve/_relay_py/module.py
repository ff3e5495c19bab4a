"""What the twin's sections share, as module.c and relay.h hold them for the C: its exceptions, and numbers read
as C reads them."""

from __future__ import annotations

import operator


class BadChunk(ValueError):
    """A chunked body that breaks HTTP/1.1's framing."""


class EventTooLarge(ValueError):
    """An event still incomplete past the relay's `max_event_bytes`."""


def seconds(value: object) -> float:
    """A number as C reads one (`PyFloat_AsDouble`): by `__float__`, else `__index__`; never from a string."""
    if type(value) is float:
        return value
    if hasattr(type(value), "__float__"):
        return float(value)  # type: ignore[arg-type]
    return float(operator.index(value))  # type: ignore[arg-type]  # a TypeError for anything else
