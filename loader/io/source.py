"""The seam between ``RetryingStream`` and one transport: open a byte range, get a body back."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit


class Body(Protocol):
    def read1(self, n: int) -> bytes:
        """Return 1..n bytes as soon as any arrive; b"" at the end of the body.

        Transport failures are raised as ``TransientError``.
        """

    def close(self) -> None: ...


def read_body_into(body: Body, view: memoryview) -> int:
    """Up to ``len(view)`` bytes of ``body`` into ``view``; 0 at the end of the body. A body
    with its own ``readinto`` (an HTTP body) puts them there with no bytes object in between;
    any other hands one ``read1`` over, copied in."""
    readinto = getattr(body, "readinto", None)
    return readinto(view) if readinto is not None else read1_into(body, view)


def read1_into(body: Body, view: memoryview) -> int:
    """One ``read1`` of ``body``, copied into ``view``."""
    data = body.read1(len(view))
    view[: len(data)] = data
    return len(data)


@dataclass
class Opened:
    """One response body and what the server said about it."""

    body: Body
    start: int              # absolute offset of the body's first byte (0 if the Range was ignored)
    end: int | None         # absolute offset one past the body's last byte, if the server said
    size: int | None        # total object size, if the server said
    etag: str | None        # object identity, if the protocol gives one


class RangeSource(Protocol):
    """One remote object. ``open`` raises FileNotFoundError / PermissionError (fail fast),
    ``ObjectChangedError`` (when ``if_match`` no longer holds), ``TransientError`` (reopen
    later) or ``StreamError`` (give up)."""

    url: str  # safe to print: no credentials, no query string

    def open(self, start: int, end: int | None, if_match: str | None) -> Opened | None:
        """Open ``[start, end)`` (``end=None``: to the end). None: ``start`` is at or past the end."""


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``bytes a-b/total`` -> (a, b + 1, total or None); None when absent or unparsable."""
    m = _CONTENT_RANGE.fullmatch((value or "").strip())
    if not m:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)) + 1, total


def range_header(start: int, end: int | None) -> str:
    return f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"


def redact_url(url: str) -> str:
    """Drop userinfo and query values: both can carry credentials (basic auth, presigned URLs)."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = "<redacted>" if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
