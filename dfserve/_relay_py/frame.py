"""HTTP/1.1 chunk framing (frame.c)."""

from __future__ import annotations

LAST_CHUNK = b"0\r\n\r\n"
"""The last chunk, which ends an HTTP/1.1 chunked body (no trailers)."""


def frame(body: bytes) -> bytes:
    """`body` as one HTTP/1.1 chunk."""
    if not isinstance(body, bytes):
        raise TypeError("frame() takes bytes")
    if not body:
        raise ValueError('frame(b"") would be the last chunk, which ends the body')
    return b"%x\r\n%b\r\n" % (len(body), body)
