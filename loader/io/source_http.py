"""``http://`` and ``https://`` byte ranges over urllib3 (the same library botocore uses)."""

from __future__ import annotations

import errno
import http.client
import os
import threading
from collections.abc import Mapping

import urllib3
from urllib3.exceptions import HTTPError, MaxRetryError, ResponseError

from .config import StreamConfig
from .errors import ObjectChangedError, StreamError, TransientError
from .source import Opened, parse_content_range, range_header, read1_into, redact_url

_TRANSPORT_ERRORS = (HTTPError, http.client.HTTPException, OSError)
_RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})

# One pool per process: pooled sockets must not be shared across a fork (DataLoader workers).
_pools: dict[int, urllib3.PoolManager] = {}
_pools_lock = threading.Lock()


def _pool() -> urllib3.PoolManager:
    pid = os.getpid()
    with _pools_lock:
        if pid not in _pools:
            _pools.clear()
            # maxsize: connections kept per host. The read-ahead runs up to read_ahead_connections
            # (32) ranged GETs to one bucket endpoint at once; past maxsize, urllib3 discards a
            # connection when its GET ends and the next one connects again.
            _pools[pid] = urllib3.PoolManager(num_pools=32, maxsize=64)
        return _pools[pid]


class _UrllibBody:
    def __init__(self, resp: urllib3.BaseHTTPResponse, url: str):
        self._resp = resp
        self._url = url
        self._done = False
        # urllib3 reads an undecoded body through http.client's response; its readinto lands the
        # bytes in the caller's buffer (recv_into), where urllib3's own readinto allocates a
        # bytes object per call and copies it.
        fp = getattr(resp, "_fp", None)
        self._fp = fp if isinstance(fp, http.client.HTTPResponse) else None

    def read1(self, n: int) -> bytes:
        try:
            data = self._resp.read1(n)
        except _TRANSPORT_ERRORS as e:
            raise TransientError(f"{self._url}: {type(e).__name__}: {e}") from e
        if not data:
            self._done = True
        return data

    def readinto(self, view: memoryview) -> int:
        """``read1`` into ``view``: one socket read at most, straight into it. This is
        http.client's ``read1`` over ``readinto1``, with its length bookkeeping, and closed at
        the announced end as urllib3 closes it (which hands the connection back on ``close``).
        http.client's ``readinto`` would wait for the whole view, and a failure midway would lose
        the bytes that had come (a reopen starts at the byte reached)."""
        resp = self._fp
        if resp is None or resp.chunked or resp.fp is None:
            return read1_into(self, view)
        n = len(view) if resp.length is None else min(len(view), resp.length)
        try:
            got = resp.fp.readinto1(view[:n])
        except _TRANSPORT_ERRORS as e:
            raise TransientError(f"{self._url}: {type(e).__name__}: {e}") from e
        if resp.length is not None:
            resp.length -= got
        if not got or resp.length == 0:  # the body's end (or the server's): close() keeps the connection
            resp._close_conn()
            self._done = True
        return got

    def close(self) -> None:
        # A fully read body leaves a reusable keep-alive connection; an abandoned one does not.
        if not self._done:
            self._resp.close()
        self._resp.release_conn()


class HttpSource:
    """One object behind a URL on any server that honours (or ignores) ``Range``."""

    def __init__(self, url: str, config: StreamConfig, *, headers: Mapping[str, str] | None = None,
                 display_url: str | None = None, send_if_match: bool = False):
        self._target = url
        self._headers = dict(headers or {})
        self._send_if_match = send_if_match
        self._timeout = urllib3.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s)
        self.url = display_url or redact_url(url)

    def open(self, start: int, end: int | None, if_match: str | None) -> Opened | None:
        headers = {**self._headers, "Range": range_header(start, end), "Accept-Encoding": "identity"}
        # If-Match is sent only where the URL names the object itself (a presigned S3 URL): behind a
        # redirect (the Hub's resolve -> CDN) the first hop may judge it against a different ETag.
        # RetryingStream compares the ETag of each answer in any case.
        if if_match and self._send_if_match:
            headers["If-Match"] = if_match
        # urllib3 follows redirects and drops Authorization on a cross-host hop; every other kind
        # of retry belongs to RetryingStream, which reopens at the right offset.
        retries = urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=5,
                                raise_on_status=False)
        try:
            resp = _pool().request("GET", self._target, headers=headers, retries=retries,
                                   timeout=self._timeout, preload_content=False, decode_content=False)
        except MaxRetryError as e:
            if isinstance(e.reason, ResponseError):  # too many redirects
                raise StreamError(f"{self.url}: {e.reason}") from None
            raise TransientError(f"{self.url}: {type(e.reason).__name__}: {e.reason}") from None
        except _TRANSPORT_ERRORS as e:
            raise TransientError(f"{self.url}: {type(e).__name__}: {e}") from e

        status = resp.status
        if status in (200, 206):
            return self._opened(resp, start)
        resp.drain_conn()
        resp.release_conn()
        if status == 416:
            # Asked for bytes at or past the end: an empty remainder, not an error.
            return None
        if status in (404, 410):
            raise FileNotFoundError(errno.ENOENT, f"not found (HTTP {status})", self.url)
        if status in (401, 403):
            raise PermissionError(errno.EACCES, f"access denied (HTTP {status}); check the credentials", self.url)
        if status == 412:
            raise ObjectChangedError(f"{self.url}: the object changed while it was being read (HTTP 412)")
        if status in _RETRYABLE_STATUS:
            raise TransientError(f"{self.url}: HTTP {status}")
        raise StreamError(f"{self.url}: unexpected HTTP {status} for a ranged GET")

    def _opened(self, resp: urllib3.BaseHTTPResponse, start: int) -> Opened:
        length = resp.headers.get("Content-Length")
        length_i = int(length) if length and length.isdigit() else None
        etag = resp.headers.get("ETag")
        body = _UrllibBody(resp, self.url)
        if resp.status == 206:
            cr = parse_content_range(resp.headers.get("Content-Range"))
            if cr is not None:
                return Opened(body, cr[0], cr[1], cr[2], etag)
            return Opened(body, start, None if length_i is None else start + length_i, None, etag)
        # 200: the server ignored Range and sends the whole object from byte 0.
        return Opened(body, 0, length_i, length_i, etag)

