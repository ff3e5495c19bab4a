"""Members cut out of events by their key, without decoding (members.c), and where events end."""

from __future__ import annotations

_INLINE_SPACE = b" \t"
_SCALAR_ENDS = frozenset(b"}],\r\n \t")


def _value_end(buf: bytes, i: int) -> int:
    """One past the end of the JSON value at buf[i], or -1 where it does not end on its own line."""
    start, depth, length = i, 0, len(buf)
    while i < length:
        c = buf[i]
        if c == 34:  # '"'
            i += 1
            while i < length and buf[i] != 34 and buf[i] != 10:
                if buf[i] == 92:  # '\\'
                    i += 1
                i += 1
            if i >= length or buf[i] != 34:
                return -1
            if depth == 0:
                return i + 1
        elif c in b"{[":
            depth += 1
        elif depth == 0 and c in _SCALAR_ENDS:
            return i if i > start else -1  # a number or a literal ends here
        elif c in b"\r\n":
            return -1
        elif c in b"}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def event_end(buf: bytes, start: int) -> int:
    """One past the first blank line that ends at or after `start`; 0 if none."""
    low = max(start, 1)
    lf = buf.find(b"\n\n", low - 1)
    crlf = buf.find(b"\n\r\n", max(low - 2, 0))
    return min((end for end, at in ((lf + 2, lf), (crlf + 3, crlf)) if at >= 0), default=0)


def event_boundary(buf: bytes | bytearray, start: int, length: int | None = None) -> int:
    """Length of the longest prefix of buf[:length] that ends with a blank line ("\\n\\n" or "\\n\\r\\n"), looking
    only at lines that end at or after `start`; 0 if none."""
    low = max(start, 1)
    lf = buf.rfind(b"\n\n", low - 1, length)
    crlf = buf.rfind(b"\n\r\n", max(low - 2, 0), length)
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def _member_span(buf: bytes, at: int, key_length: int, floor: int) -> tuple[int, int] | None:
    """The bytes that cutting the member whose key starts at `at` removes: the member and one comma beside it, or
    the whole event where its object is left empty (nothing else was asked for). None: not a member to cut (its
    value does not end, or it is not inside an object), or one that reaches back before `floor`."""
    length = len(buf)
    value = at + key_length
    while value < length and buf[value] in _INLINE_SPACE:
        value += 1
    end = _value_end(buf, value)
    if end < 0:
        return None
    before, after = at, end
    while before > floor and buf[before - 1] in _INLINE_SPACE:
        before -= 1
    while after < length and buf[after] in _INLINE_SPACE:
        after += 1
    if before > floor and buf[before - 1] == 44:  # ','
        return before - 1, end
    if before <= floor or buf[before - 1] != 123 or after >= length:  # '{'
        return None
    if buf[after] == 44:
        after += 1
        while after < length and buf[after] in _INLINE_SPACE:
            after += 1
        return at, after
    if buf[after] != 125:  # '}'
        return None
    start, stop = event_boundary(buf, 0, at), event_end(buf, after + 1)
    return (start, stop) if start >= floor and stop > 0 else None


def strip_members(events: bytes, key: bytes) -> bytes:
    """`events` less each member whose key is `key` (`events` itself if nothing was cut)."""
    hit = events.find(key)
    if hit < 0:
        return events
    out: list[bytes] = []
    kept = 0  # events[kept:] is not yet copied or cut
    while hit >= 0:
        after = hit + len(key)
        span = _member_span(events, hit, len(key), kept)
        if span is not None:
            out.append(events[kept:span[0]])
            kept = span[1]
            after = max(after, kept)
        hit = events.find(key, after)
    if kept == 0:
        return events
    out.append(events[kept:])
    return b"".join(out)
