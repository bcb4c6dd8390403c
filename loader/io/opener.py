"""``open_url``: one entry point for local paths, file://, s3://, http(s):// and hf:// URLs."""

from __future__ import annotations

import io
import os
from urllib.parse import urlsplit
from urllib.request import url2pathname

from . import urls
from .config import StreamConfig, StreamStats
from .local import open_local
from .retrying import RetryingStream
from .source import RangeSource
from .source_hf import hf_source
from .source_http import HttpSource
from .source_s3 import S3Source

# Big enough that tarfile's 10 KiB reads rarely reach the network, small enough per open stream.
_BUFFER_SIZE = 1 << 20


def open_url(url: str | os.PathLike[str], *, start: int = 0, length: int | None = None,
             config: StreamConfig | None = None, stats: StreamStats | None = None) -> io.BufferedIOBase:
    """Open ``length`` bytes (``None``: to the end) of ``url`` from byte ``start``, for reading.

    Remote objects come back as a buffered ``RetryingStream``; a missing object raises
    ``FileNotFoundError`` and a forbidden one ``PermissionError`` here, without retries.
    """
    if start < 0 or (length is not None and length < 0):
        raise ValueError(f"{url}: start and length must be >= 0 (got start={start}, length={length})")
    url = os.fspath(url)
    scheme = urls.scheme(url)
    if scheme in ("", "file"):
        path = url2pathname(urlsplit(url).path) if scheme else url
        return open_local(path, start, length, stats)
    config = config or StreamConfig()
    raw = RetryingStream(source_for(url, scheme, config), start=start, length=length,
                         config=config, stats=stats)
    try:
        raw.connect()
    except BaseException:
        raw.close()
        raise
    return io.BufferedReader(raw, buffer_size=_BUFFER_SIZE)


def source_for(url: str, scheme: str, config: StreamConfig) -> RangeSource:
    if scheme in ("http", "https"):
        return HttpSource(url, config)
    if scheme == "s3":
        # Not urlsplit: S3 keys may contain '?' and '#'.
        bucket, _, key = url[len("s3://"):].partition("/")
        return S3Source(bucket, key, config)
    if scheme == "hf":
        return hf_source(url, config)
    raise ValueError(
        f"unsupported URL scheme {scheme!r} in {url!r}: use a local path, file://, s3://, "
        "http(s):// or hf://datasets/<org>/<name>[@<revision>]/<path>"
    )
