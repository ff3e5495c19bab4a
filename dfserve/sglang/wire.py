"""What both sides of SGLang's protocol share: compact JSON as SGLang sends it, the SSE end marker, and JSON
decoding that fails as a `ProtocolError` naming what was read.

SSE events are decoded by pydantic-core's parser (Rust): two to three times as fast as `json.loads` on SGLang's
events, which a load tester and a recording gateway decode by the thousand a second. What it refuses, `json.loads`
decides, so an event is read exactly when `json.loads` reads it (a lone surrogate escaped in a string, deep
nesting up to the recursion limit), and never raises more than a `ProtocolError`."""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import from_json

from dfserve.errors import ProtocolError


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON, as SGLang sends it; a lone surrogate (which JSON may escape but UTF-8 cannot carry,
    read from an answer that escaped one) keeps its escape."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":")).encode()


SSE_DONE = b"data: [DONE]\n\n"


DONE = "[DONE]"


def decode_json(body: bytes | str | Any, what: str) -> Any:
    if not isinstance(body, bytes | str):
        return body
    try:
        return json.loads(body)
    except ValueError as exc:  # also an integer of over 4300 digits
        raise ProtocolError(f"{what}: invalid JSON ({exc})") from None


def printable(text: str) -> str:
    """`text` as a UTF-8 document can hold it: JSON can escape half a surrogate pair, which no UTF-8 can encode, so
    a lone surrogate becomes its escape (`\\ud800`); anything else is kept."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def printable_json(obj: Any) -> Any:
    """A decoded JSON document with every string (keys too) `printable`: a server's document, kept in a record."""
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, dict):
        return {printable(key): printable_json(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [printable_json(item) for item in obj]
    return obj


def event_json(data: str, what: str) -> dict[str, Any]:
    try:
        obj = from_json(data)
    except (ValueError, TypeError):
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:  # ValueError: also an integer of over 4300 digits
            raise ProtocolError(f"{what}: invalid JSON in SSE data ({exc})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: SSE data is not an object")
    return obj


MAX_COUNT = 2**40
"""Past any count of tokens a server reports, and within what a float holds exactly."""
MAX_GENERATED = 2**22
"""More tokens (or verify rounds) than any server generates for one request (4M): a count past it is a broken or
hostile answer, and figures derived from it would be nonsense, one per-token latency sample for each claimed
token."""


def int_field(obj: dict[str, Any], key: str, default: int | None = None, where: str = "meta_info",
              most: int = MAX_COUNT) -> int:
    """A count: an integer from 0 to `most`."""
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        if value is None and default is not None:
            return default
        raise ProtocolError(f"{where}.{key}: expected an integer, got {value!r}")
    if not 0 <= value <= most:
        raise ProtocolError(f"{where}.{key}: expected a count from 0 to {most}, got {value!r}")
    return value


def times_field(value: Any, key: str) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not set(map(type, value)) <= _NUMBERS:  # a simulated stream's every event: fast
        raise ProtocolError(f"meta_info.{key}: expected a list of numbers, got {value!r}")
    try:
        times = tuple(map(float, value))
    except OverflowError:
        times = (math.inf,)
    if not all(map(math.isfinite, times)):  # a record could not hold it (JSON has no NaN)
        raise ProtocolError(f"meta_info.{key}: expected finite numbers, got {value!r}"[:200])
    return times


_LAX_BOOL = TypeAdapter(bool)


def lax_bool(value: Any) -> bool | None:
    """A flag as SGLang's OpenAI request models (pydantic, lax) read it: `"true"`, `1`, `"yes"` are true; None for
    what they refuse."""
    if isinstance(value, bool):
        return value
    try:
        return _LAX_BOOL.validate_python(value)
    except ValidationError:
        return None


_NUMBERS = {int, float}
"""What JSON numbers decode to (`bool` is a type of its own, so true and false are refused)."""


def float_field(obj: dict[str, Any], key: str, where: str = "meta_info") -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{where}.{key}: expected a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ProtocolError(f"{where}.{key}: expected a finite number, got {value!r}"[:200])
    return number
