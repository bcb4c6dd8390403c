"""What a location string is: the one place in the project that tells a local path from a URL.

A *location* is a local path (``/data/x``, ``rel/x``, ``file:///data/x``) or a URL of a backend
the project reads: ``s3://bucket/key``, ``http(s)://host/path``, ``hf://datasets/<org>/<name>``.
A string that looks like a URL (``scheme://``) is never silently a local path: ``kind`` refuses
a scheme it does not know, naming the string and the schemes it takes. Code elsewhere asks these
functions instead of spelling ``startswith("s3://")`` or ``"://" in`` itself
(``tests/test_formats_ownership.py`` enforces it), so a new backend is one entry in ``KINDS``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from urllib.parse import urlsplit

__all__ = [
    "KINDS",
    "has_scheme",
    "is_local",
    "is_remote",
    "is_s3",
    "is_hf",
    "is_http",
    "join",
    "join_norm",
    "kind",
    "local_path",
    "parent",
    "scheme",
    "split_s3",
    "split_scheme",
    "without_file_scheme",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# scheme -> kind. "" is a plain path.
KINDS: dict[str, str] = {"": "local", "file": "local", "s3": "s3", "http": "http", "https": "http", "hf": "hf"}
_EXAMPLES = {"local": "a local path (or file://)", "s3": "s3://bucket/prefix", "http": "http(s)://host/path",
             "hf": "hf://datasets/<org>/<name>[@<revision>]"}


def scheme(location: str | os.PathLike[str]) -> str:
    """The URL scheme of ``location``, lower case; ``""`` for a plain path."""
    text = os.fspath(location)
    m = _SCHEME.match(text) if isinstance(text, str) else None
    return m.group(1).lower() if m else ""


def has_scheme(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is spelled as a URL (``scheme://...``, ``file://`` included)."""
    return scheme(location) != ""


def kind(location: str | os.PathLike[str], *, allowed: Collection[str] | None = None,
         what: str = "location") -> str:
    """``"local"``, ``"s3"``, ``"http"`` or ``"hf"``.

    ValueError for a scheme the project does not read, and for a kind outside ``allowed``
    (``what`` names the setting in the message: ``"--output-dir"``, ``"source root"``)."""
    text = os.fspath(location)
    s = scheme(text)
    found = KINDS.get(s)
    takes = [k for k in KINDS.values() if allowed is None or k in allowed]
    if found is None or (allowed is not None and found not in allowed):
        use = " or ".join(_EXAMPLES[k] for k in dict.fromkeys(takes))
        why = "is not a scheme the project reads" if found is None else "is not a place this takes"
        raise ValueError(f"{what} {_shown(text)!r}: use {use} ({s}:// {why})")
    return found


def is_local(location: str | os.PathLike[str]) -> bool:
    """A plain path or ``file://`` (``False`` for any other scheme, known or not)."""
    return scheme(location) in ("", "file")


def is_remote(location: str | os.PathLike[str]) -> bool:
    """Spelled as a URL other than ``file://`` (whether or not the scheme is one we read)."""
    return not is_local(location)


def is_s3(location: str | os.PathLike[str]) -> bool:
    return scheme(location) == "s3"


def is_hf(location: str | os.PathLike[str]) -> bool:
    return scheme(location) == "hf"


def is_http(location: str | os.PathLike[str]) -> bool:
    return scheme(location) in ("http", "https")


def local_path(location: str | os.PathLike[str]) -> str:
    """The path a local location names (``file://`` decoded); ValueError for a URL."""
    text = os.fspath(location)
    s = scheme(text)
    if s == "file":
        from urllib.request import url2pathname  # here: urllib.request pulls in http.client and ssl

        return url2pathname(urlsplit(text).path)
    if s:
        raise ValueError(f"{_shown(text)!r} is a {s}:// URL, not a local path")
    return text


def without_file_scheme(location: str) -> str:
    """A ``file://`` URL as its path; anything else (a path, another URL) unchanged."""
    return local_path(location) if scheme(location) == "file" else location


def split_s3(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``). Not urlsplit: keys may contain '?' and '#'."""
    if not is_s3(url):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"s3 URL {url!r} names no bucket: use s3://bucket/prefix")
    return bucket, key.strip("/")


def split_scheme(location: str) -> tuple[str, str]:
    """(scheme, what follows ``scheme://``) of a URL; ``("", location)`` for a plain path."""
    s = scheme(location)
    return (s, location[len(s) + 3:]) if s else ("", location)


def join_norm(base: str, rel: str) -> str:
    """``rel`` (``/``-separated, maybe with ``..``) under ``base``, normalized: ``s3://b/x/y`` +
    ``../z`` -> ``s3://b/x/z`` (object stores take ``./`` literally); a path joins as a path."""
    if is_remote(base):
        import posixpath

        s, rest = split_scheme(base)
        netloc, _, path = rest.partition("/")
        return f"{s}://{netloc}{posixpath.normpath(posixpath.join('/' + path, rel))}"
    return os.path.normpath(os.path.join(base, rel))


def join(base: str, leaf: str) -> str:
    """``leaf`` inside ``base`` in ``base``'s own syntax: ``/`` for a URL, ``os.path.join`` for a path."""
    return f"{base.rstrip('/')}/{leaf}" if has_scheme(base) else os.path.join(base, leaf)


def parent(location: str) -> str:
    """The folder holding ``location`` (a URL keeps its scheme and host)."""
    return location.rsplit("/", 1)[0] if has_scheme(location) else os.path.dirname(location)


def _shown(text: str) -> str:
    # Never echo user info (user:secret@) or a query string that may carry a token.
    from .source import redact_url

    return redact_url(text) if has_scheme(text) else text
