"""Token marks read from JSON keys, without decoding (marks.c)."""

from __future__ import annotations

import re

_AFTER_KEY = re.compile(rb"[ \t\r\n]*")
_DIGITS = re.compile(rb"[0-9]*")
_COUNT_LIMIT = (2**63 - 1 - 9) // 10
"""Digits are taken while the value is below this, as C takes them into an int64 without overflow."""


def check_keys(keys: object) -> None:
    if not isinstance(keys, tuple) or not keys or not all(isinstance(key, bytes) and key for key in keys):
        raise TypeError("keys must be a non-empty tuple of bytes")


def _count(digits: bytes) -> int | None:
    """The integer the digits spell, or None beyond int64 (C's loop, digit by digit, only for long runs)."""
    if len(digits) <= 18:
        return int(digits)
    value, taken = 0, 0
    while taken < len(digits) and value < _COUNT_LIMIT:
        value = value * 10 + digits[taken] - 48
        taken += 1
    return value if taken == len(digits) else None


def count_marks(buf: bytes, keys: tuple[bytes, ...], cumulative: bool) -> int:
    found = -1 if cumulative else 0
    last_at = -1
    length = len(buf)
    for key in keys:
        hit = buf.find(key)
        while hit >= 0:
            after = hit + len(key)
            i = _AFTER_KEY.match(buf, after).end()  # type: ignore[union-attr]  # matches the empty string
            if not cumulative:
                found += i + 1 < length and buf[i] == 34 and buf[i + 1] != 34  # '"'
            elif i < length and 48 <= buf[i] <= 57 and hit >= last_at:
                value = _count(_DIGITS.match(buf, i).group())  # type: ignore[union-attr]
                if value is not None:
                    found, last_at = value, hit
            hit = buf.find(key, after)
    return found


def read_marks(events: bytes, keys: tuple[bytes, ...], cumulative: bool) -> int | None:
    """`cumulative`: the integer after the last of `keys` that has one (None if none); else how many of `keys` have
    a non-empty string value."""
    if not isinstance(events, bytes):
        raise TypeError("read_marks(events: bytes, keys: tuple[bytes, ...], cumulative)")
    check_keys(keys)
    found = count_marks(events, keys, bool(cumulative))
    return None if found < 0 else found
