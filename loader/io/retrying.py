"""``RetryingStream``: one remote object read front to back, surviving drops, stalls and trickles.

The caller sees exactly the bytes ``[start, start + length)`` of the object, or a named error.
Every failure (reset, timeout, 5xx, a body that ends early) becomes a ranged reopen at the exact
offset reached, after a jittered back-off, until ``max_retries`` is spent. A response that ends
cleanly but short of what is wanted is followed by a request "for the rest" for free only when it
delivered bytes; one that delivered nothing is a failure like any other (otherwise a server
answering every range with an empty 206 would be asked again forever).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import random
import time

from .config import StreamConfig, StreamStats
from .errors import ObjectChangedError, RetryBudgetExceeded, StreamError, TransientError
from .source import Opened, RangeSource, read_body_into

_SKIP_CHUNK = 1 << 20
log = logging.getLogger(__name__)


def jitter_rng(seed: int, url: str) -> random.Random:
    """Back-off jitter depends only on (seed, url), so two runs of a job wait alike."""
    digest = hashlib.blake2b(f"{seed}\x00{url}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


class RetryingStream(io.RawIOBase):
    """A raw, forward-only stream over one remote object; ``open_url`` wraps it in a BufferedReader.

    ``retries`` spend the budget (a failed or short read); ``reconnects`` (throughput below the
    floor for a whole window) do not, since data was still flowing.
    """

    def __init__(self, source: RangeSource, *, start: int = 0, length: int | None = None,
                 config: StreamConfig | None = None, stats: StreamStats | None = None,
                 etag: str | None = None):
        """``etag``: the object's ETag as an earlier read of it saw it; every request of this
        stream is pinned to it (a replaced object fails as ``ObjectChangedError``)."""
        if start < 0 or (length is not None and length < 0):
            raise ValueError(f"{source.url}: start and length must be >= 0 (got {start}, {length})")
        self._source = source
        self._config = config or StreamConfig()
        self.stats = stats if stats is not None else StreamStats()
        self._pos = start
        self._end: int | None = None if length is None else start + length
        self._resp: Opened | None = None
        self._opened_at = start   # where the current response started: did it deliver anything?
        self._opened_once = False
        self._etag: str | None = etag
        self._size: int | None = None
        self._retries = 0
        self._consecutive_failures = 0
        self._rng = jitter_rng(self._config.seed, source.url)
        self._window_s = 0.0
        self._window_bytes = 0

    # -- io.RawIOBase -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._source.url

    @property
    def url(self) -> str:
        return self._source.url

    @property
    def etag(self) -> str | None:
        """The object's ETag as the first response gave it (or as pinned)."""
        return self._etag

    @property
    def size(self) -> int | None:
        """The object's whole size, once a response said it."""
        return self._size

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:  # type: ignore[override]
        """The next 1..len(buffer) bytes (0 at the end), straight into ``buffer`` where the body
        can put them there (an HTTP body: no bytes object in between)."""
        self._checkClosed()
        view = memoryview(buffer).cast("B")
        timed = self._config.min_throughput_bps > 0
        while True:
            if not len(view) or self._at_end():
                return 0
            try:
                if self._resp is None:
                    self._open()
                    continue
                want = len(view) if self._end is None else min(len(view), self._end - self._pos)
                t0 = time.monotonic() if timed else 0.0
                got = read_body_into(self._resp.body, view[:want])
                if not got:
                    self._body_ended()
                    continue
            except TransientError as e:
                self._failed(e)
                continue
            self._pos += got
            self._consecutive_failures = 0
            self.stats.add(bytes_read=got)
            if timed:
                self._watch_throughput(got, time.monotonic() - t0)
            return got

    def close(self) -> None:
        self._drop()
        super().close()

    def __repr__(self) -> str:
        return f"<RetryingStream {self._source.url} at {self._pos}>"

    # -- opening ------------------------------------------------------------------------------
    def connect(self) -> None:
        """Open the first response now, so a missing or forbidden object fails at open time."""
        while self._resp is None and not self._at_end():
            try:
                self._open()
            except TransientError as e:
                self._failed(e)

    def _at_end(self) -> bool:
        if self._end is not None and self._pos >= self._end:
            self._drop()
            return True
        return False

    def _open(self) -> None:
        self.stats.add(opens=1)
        opened = self._source.open(self._pos, self._end, self._etag)
        first = not self._opened_once
        self._opened_once = True
        if opened is None:  # the server says we are at or past the end
            if self._end is not None and not first:
                raise ObjectChangedError(
                    f"{self.url}: the object is now shorter than byte {self._end} (it was {self._size})")
            self._end = self._pos
            return
        self._resp = opened
        self._opened_at = self._pos
        try:
            self._check_identity(opened, first)
            if opened.size is not None:
                self._end = opened.size if self._end is None else min(self._end, opened.size)
            if opened.start > self._pos:
                raise StreamError(f"{self.url}: asked for byte {self._pos}, the server answered from {opened.start}")
            self._skip(self._pos - opened.start)
        except BaseException:
            self._drop()
            raise
        self._window_s, self._window_bytes = 0.0, 0

    def _check_identity(self, opened: Opened, first: bool) -> None:
        if first:
            if opened.etag and self._etag and opened.etag != self._etag:  # pinned by an earlier read
                raise ObjectChangedError(
                    f"{self.url}: the object changed while it was being read (ETag {self._etag} -> {opened.etag})")
            self._etag, self._size = opened.etag or self._etag, opened.size
            return
        if opened.etag and self._etag and opened.etag != self._etag:
            raise ObjectChangedError(
                f"{self.url}: the object changed while it was being read (ETag {self._etag} -> {opened.etag})")
        if opened.size is not None and self._size is not None and opened.size != self._size:
            raise ObjectChangedError(
                f"{self.url}: the object changed while it was being read (size {self._size} -> {opened.size})")

    def _skip(self, n: int) -> None:
        """The server ignored Range and started earlier: discard up to our offset."""
        assert self._resp is not None
        while n > 0:
            data = self._resp.body.read1(min(n, _SKIP_CHUNK))
            if not data:
                raise TransientError(f"{self.url}: body ended while skipping to byte {self._pos}")
            n -= len(data)
            self.stats.add(bytes_skipped=len(data))

    # -- failures -----------------------------------------------------------------------------
    def _body_ended(self) -> None:
        """Tell a clean end from a short read (the server ended the body before it said it would)."""
        resp = self._resp
        assert resp is not None
        if resp.end is not None and self._pos == resp.end and (self._end is None or self._pos < self._end):
            if self._pos == self._opened_at:
                # No progress: asking "for the rest" again would repeat this answer forever.
                raise TransientError(f"{self.url}: the server answered the range from byte {self._pos} "
                                     "with no bytes")
            self._drop()  # the server sent a shorter range than we asked for: ask for the rest
            return
        expected = resp.end if resp.end is not None else self._end
        if expected is not None and self._pos < expected:
            raise TransientError(f"{self.url}: body ended at byte {self._pos}, expected {expected}")
        self._end = self._pos  # no length was announced: the end of the body is the end
        self._drop()

    def _failed(self, error: TransientError) -> None:
        self._drop()
        if self._retries >= self._config.max_retries:
            raise RetryBudgetExceeded(self.url, self._pos, self._retries, error) from error
        self._retries += 1
        self.stats.add(retries=1)
        c = self._config
        delay = min(c.backoff_max_s, c.backoff_base_s * 2 ** self._consecutive_failures * self._rng.uniform(0.5, 1.5))
        self._consecutive_failures += 1
        log.info("%s; reopening at byte %d in %.2fs (retry %d of %d)",
                 error, self._pos, delay, self._retries, c.max_retries)
        if delay > 0:
            time.sleep(delay)

    def _watch_throughput(self, n: int, elapsed: float) -> None:
        """Only time spent waiting on the network counts, so a slow consumer is not blamed."""
        floor = self._config.min_throughput_bps
        if floor <= 0:
            return
        self._window_s += elapsed
        self._window_bytes += n
        if self._window_s < self._config.throughput_window_s:
            return
        slow = self._window_bytes / self._window_s < floor
        self._window_s, self._window_bytes = 0.0, 0
        if slow and not self._at_end():
            log.info("%s: below %.0f B/s for %.1fs; reconnecting at byte %d",
                     self.url, floor, self._config.throughput_window_s, self._pos)
            self._drop()
            self.stats.add(reconnects=1)

    def _drop(self) -> None:
        resp, self._resp = self._resp, None
        if resp is not None:
            # Closing a broken connection may fail again; nothing is lost by ignoring that.
            with contextlib.suppress(Exception):
                resp.body.close()
