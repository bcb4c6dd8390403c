"""Exact byte ranges of dataset files: ``RangeFetcher`` and the seekable ``RangeFile`` over it.

Every read of the streaming reader (parquet footers and row groups, MP4 GOP spans) is one
``fetch(url, start, length)``: exactly ``length`` bytes or a named error. Remote reads go
through ``loader.io.open_url`` (``RetryingStream``: a dropped, stalled or short answer is
reopened at the exact byte reached). For ``http(s)://`` and ``hf://`` URLs the fetcher honours
the document's ``streaming_native_http_connections`` (requests in flight at once) and
``streaming_native_http_subranges`` (parallel sub-range requests per range). Local files are
read with ``os.pread``: no stream, no buffer, still counted.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

from loader.io import StreamConfig, StreamError, StreamStats, open_url, urls
from loader.io.config import Counters
from loader.io.seekable import SeekableReader
from loader.io.source import redact_url

__all__ = ["FetchCounters", "RangeFetcher", "RangeFile"]

_HTTP_SCHEMES = frozenset({"http", "https", "hf"})
# Below this a sub-range costs more in request latency than it gains in parallel transfer.
DEFAULT_MIN_SUBRANGE = 256 * 1024
# pyarrow reads a parquet footer as the last 64 KiB; small reads around it share one request.
DEFAULT_READAHEAD = 64 * 1024


@dataclass
class FetchCounters(Counters):
    """What a fetcher did: ``bytes_fetched`` and ``requests`` (one per range request, sub-ranges
    and local reads included) and ``retries`` (reopens after a failed or short read, from the
    streams' ``StreamStats``)."""

    bytes_fetched: int = 0
    requests: int = 0
    retries: int = 0


def _scheme(url: str) -> str:
    return urls.scheme(url)


class RangeFetcher:
    """Exact byte ranges of files under a dataset root (local, s3://, http(s)://, hf://), through
    ``loader.io.open_url`` (``RetryingStream``: retries with byte-exact resume).

    For http(s)/hf URLs: at most ``http_connections`` requests in flight at once per fetcher
    (None: unlimited) and each range split into ``http_subranges`` parallel sub-range requests
    (default 1), none shorter than ``min_subrange`` bytes. Thread-safe; picklable (a worker
    gets a fresh fetcher with the same settings and its own counters' values).
    """

    def __init__(self, *, config: StreamConfig | None = None, http_connections: int | None = None,
                 http_subranges: int = 1, counters: FetchCounters | None = None,
                 min_subrange: int = DEFAULT_MIN_SUBRANGE):
        if http_connections is not None and (isinstance(http_connections, bool) or http_connections < 1):
            raise ValueError(f"http_connections (streaming_native_http_connections) must be a positive "
                             f"integer or None for no limit, got {http_connections!r}")
        if isinstance(http_subranges, bool) or http_subranges < 1:
            raise ValueError(f"http_subranges (streaming_native_http_subranges) must be >= 1, "
                             f"got {http_subranges!r}")
        if min_subrange < 1:
            raise ValueError(f"min_subrange must be >= 1 byte, got {min_subrange!r}")
        self.config = config or StreamConfig()
        self.http_connections = http_connections
        self.http_subranges = int(http_subranges)
        self.min_subrange = int(min_subrange)
        self.counters = counters if counters is not None else FetchCounters()
        self._setup()

    def _setup(self) -> None:
        self._slots = (threading.BoundedSemaphore(self.http_connections)
                       if self.http_connections is not None else None)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in ("_slots", "_pool", "_pool_lock"):
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    def close(self) -> None:
        """Stop the sub-range threads (a fetcher still works after this; it starts new ones)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- public ---------------------------------------------------------------------------------

    def fetch(self, url: str, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of ``url``: exactly ``length`` of them, or an error
        naming the URL (credentials stripped). FileNotFoundError / PermissionError fail at once."""
        url = os.fspath(url)
        if start < 0 or length < 0:
            raise ValueError(f"{redact_url(url)}: start and length must be >= 0 (got {start}, {length})")
        if length == 0:
            return b""
        scheme = _scheme(url)
        if scheme in ("", "file"):
            return self._fetch_local(url, scheme, start, length)
        if scheme in _HTTP_SCHEMES:
            return self._fetch_http(url, start, length)
        return self._fetch_stream(url, start, length)

    def open_file(self, url: str, size: int, *, readahead: int = DEFAULT_READAHEAD,
                  preload: tuple[int, bytes] | None = None) -> RangeFile:
        """A seekable read-only file of ``size`` bytes over ``url`` for pyarrow (no request yet);
        ``preload`` (offset, bytes): bytes of it already fetched, served without a request."""
        return RangeFile(self, url, size, readahead=readahead, preload=preload)

    # -- backends -------------------------------------------------------------------------------

    def _fetch_local(self, url: str, scheme: str, start: int, length: int) -> bytes:
        path = urls.local_path(url)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            parts = []
            got = 0
            while got < length:
                chunk = os.pread(fd, length - got, start + got)
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
        finally:
            os.close(fd)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.counters.add(requests=1, bytes_fetched=len(data))
        if len(data) != length:
            raise _short(path, start, length, len(data))
        return data

    def _fetch_stream(self, url: str, start: int, length: int) -> bytes:
        stats = StreamStats()
        try:
            with open_url(url, start=start, length=length, config=self.config, stats=stats) as f:
                data = f.read(length)
        finally:
            self.counters.add(requests=1, retries=stats.retries)
        self.counters.add(bytes_fetched=len(data))
        if len(data) != length:
            raise _short(redact_url(url), start, length, len(data))
        return data

    def _fetch_http(self, url: str, start: int, length: int) -> bytes:
        n = max(1, min(self.http_subranges, length // self.min_subrange))
        if n == 1:
            return self._fetch_slot(url, start, length)
        # Equal parts, the first ones one byte longer: contiguous and covering the range exactly.
        base, extra = divmod(length, n)
        spans, offset = [], start
        for i in range(n):
            size = base + (i < extra)
            spans.append((offset, size))
            offset += size
        pool = self._subrange_pool()
        # The caller's thread reads the first part itself: with the others queued behind a
        # connection limit it still makes progress, and a fetch never waits on a pool slot alone.
        futures = [pool.submit(self._fetch_slot, url, s, size) for s, size in spans[1:]]
        try:
            parts = [self._fetch_slot(url, *spans[0])]
            parts += [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        return b"".join(parts)

    def _fetch_slot(self, url: str, start: int, length: int) -> bytes:
        with self._slots if self._slots is not None else nullcontext():
            return self._fetch_stream(url, start, length)

    def _subrange_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                # As many threads as connections may be open: more would only wait on the
                # semaphore. Nothing waits while holding a connection, so this cannot deadlock.
                workers = self.http_connections or 4 * self.http_subranges
                self._pool = ThreadPoolExecutor(max_workers=max(1, workers),
                                                thread_name_prefix="range-fetch")
            return self._pool


def _short(where: str, start: int, length: int, got: int) -> StreamError:
    return StreamError(
        f"{where}: asked for {length} bytes at offset {start}, the file ends after {got} of them; "
        "the file is shorter than the dataset's metadata says (it was replaced or truncated): "
        "re-upload it, or reload the dataset metadata")


class RangeFile(SeekableReader):
    """A read-only, seekable file of ``size`` bytes over ``url``: each read is one
    ranged fetch, except that a read shorter than ``readahead`` fetches ``readahead`` bytes and
    serves the next small reads from them (a parquet footer is parsed in one or two requests).

    Not for sharing between threads (it has a position); open one per reader.
    """

    def __init__(self, fetcher: RangeFetcher, url: str, size: int, *, readahead: int = DEFAULT_READAHEAD,
                 preload: tuple[int, bytes] | None = None):
        self._url = url
        super().__init__(size)
        self._fetcher = fetcher
        self._readahead = max(0, int(readahead))
        self._buf_start, self._buf = preload if preload is not None else (0, b"")

    @property
    def name(self) -> str:
        return redact_url(self._url)

    def _take(self, n: int) -> bytes:
        """The ``n`` bytes at the position, from the read-ahead buffer or one fetch."""
        offset = self._pos - self._buf_start
        if offset >= 0 and offset + n <= len(self._buf):
            return self._buf[offset:offset + n]
        if n < self._readahead:
            # Never across the end of the file: a shorter tail is all there is.
            want = min(self._readahead, self._size - self._pos)
            self._buf = self._fetcher.fetch(self._url, self._pos, want)
            self._buf_start = self._pos
            return self._buf[:n]
        return self._fetcher.fetch(self._url, self._pos, n)

    def close(self) -> None:
        self._buf = b""
        super().close()

    def __repr__(self) -> str:
        return f"<RangeFile {self.name} size={self._size} at {self._pos}>"
