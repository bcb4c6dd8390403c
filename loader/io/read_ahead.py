"""Remote objects read through several bounded ranged GETs at once, ahead of their reader.

One connection per stream caps a reader at what one connection carries (about 50-100 MB/s
from S3) and makes it wait a whole time-to-first-byte at every open. A ``ReadAhead`` (one per
process: a DataLoader worker or the training process) fetches the byte ranges its
``ReadAheadStream`` s will be read next, each a ``RetryingStream`` of a bounded range (so a
failed, short or stalled answer is reopened at the exact byte reached, after a back-off, and
every range of one object after the first is pinned to the ETag the first one saw), on at most
``read_ahead_connections`` threads at once; a range read to its end hands its connection back to
the client's pool, so connections are reused, never abandoned mid-body.

Memory is bounded: the buffers of ranges asked for, fetched, or being handed out never exceed
``read_ahead_bytes`` (per process). A block holds its share of the budget until its reader has
moved past it; each is one buffer of its range's size, allocated on the reader's thread (which
frees it) and filled by the socket reads themselves. A reader that needs a block nobody fetched
yet (or one still queued behind other streams' read-ahead) fetches it on its own thread at once,
outside the budget: read-ahead never delays a read, and a full budget cannot deadlock.

A stream asks ahead only up to its ``limit`` (the end of what its reader was told it will need,
raised by ``want``): a reader that knows its member ranges (a twin tar's key index) fetches those
bytes and no others.
"""

from __future__ import annotations

import ctypes
import io
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager

from .config import StreamConfig, StreamStats
from .errors import ObjectChangedError

RAMP_PIECES = 4  # the first block's worth of a process's read-ahead, in this many ranges


class _Block:
    """One ranged GET of a stream: ``[start, start + length)``; ``held``: bytes charged to the budget.
    ``shared``: a slice of an object fetched whole for several streams (its answer starts at byte
    0; it is never cancelled by one of them)."""

    __slots__ = ("start", "length", "future", "held", "shared")

    def __init__(self, start: int, length: int, future: Future, held: int, shared: bool = False):
        self.start, self.length, self.future, self.held, self.shared = start, length, future, held, shared


class ReadAhead:
    """The connections and the byte budget that one process's read-ahead streams share."""

    def __init__(self, config: StreamConfig | None = None, stats: StreamStats | None = None):
        self.config = config or StreamConfig()
        self.stats = stats if stats is not None else StreamStats()
        self._lock = threading.Lock()
        self._held = 0
        self._busy = 0    # fetches running
        self._queued = 0  # fetches submitted, not started (or cancelled before they started)
        self._hungry: deque[ReadAheadStream] = deque()  # streams that stopped asking for want of budget
        self._pool: ThreadPoolExecutor | None = None
        # Set by the reader that plans the reads: called while it waits for bytes, so what it
        # plans next goes out then (key indexes read meanwhile, budget handed back), not only
        # once the bytes it waits for have come. It returns the fetches its planning waits on.
        self.while_waiting: Callable[[], list[Future]] | None = None
        self._planning = False
        # The first block's worth of a process's read-ahead goes out as RAMP_PIECES ranges:
        # instrumented, the 16 first GETs shared the link, and the first batch's 4 MB block came
        # with the rest of the budget (0.3-0.4 s after it was asked for) while the reader idled.
        self._ramp = self.config.read_ahead_block
        self._deferred: dict[ReadAheadStream, None] | None = None  # streams to top up when a plan ends
        self._wholes: OrderedDict[str, tuple[int, Future]] = OrderedDict()  # url -> (bytes, its one GET)

    def open(self, url: str, start: int = 0, limit: int | None = None, order: int = 0,
             whole: int | None = None) -> ReadAheadStream:
        """A stream of ``url`` from byte ``start``; ranges are asked for ahead up to ``limit``
        (None: the object's end). Its first GETs go out now: a caller that opens several
        streams has their first bytes on the way at once. ``order``: when its reader needs
        those bytes (a batch's place in the plan); the budget goes to the lowest first.
        ``whole``: the object's first ``whole`` bytes (a small tar's members) are fetched in one
        GET, once, and every stream of ``url`` opened with it reads them from there: instrumented
        at 2 workers, a caption tar's batches alternate between the workers, and each batch's
        33 KB was a GET of its own (33 of 78 GETs), where the whole tar is 100 KB."""
        return ReadAheadStream(self, url, start, limit, order, whole)

    def _whole(self, url: str, n: int, etag: str | None) -> Future:
        """The one GET of ``url``'s first ``n`` bytes (asked for now, or by an earlier stream)."""
        got = self._wholes.get(url)
        if got is not None and got[0] >= n and not got[1].cancelled():
            self._wholes.move_to_end(url)
            return got[1]
        fut = self.call(self.fetch, url, 0, n, etag)
        self._wholes[url] = (n, fut)
        # Kept for the streams opened later: one block's worth at most (the budget does not see them).
        while sum(k for k, _ in self._wholes.values()) > self.config.read_ahead_block:
            self._wholes.popitem(last=False)
        return fut

    @contextmanager
    def plan(self) -> Iterator[None]:
        """Streams opened or extended inside ask for their ranges at the end, once: a reader that
        plans several batches of one shard at once fetches them as a few large ranges, not as a
        GET per batch (instrumented: a caption tar's 33 KB per batch each cost a request, its
        time to first byte and a connection slot)."""
        if self._deferred is not None:
            yield
            return
        self._deferred = {}
        try:
            yield
        finally:
            streams, self._deferred = self._deferred, None
            for stream in streams:
                stream._top_up()

    def call(self, fn, *args) -> Future:
        """``fn(*args)`` on a fetch thread (a small read a reader will need soon, such as an index)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.read_ahead_connections, thread_name_prefix="read-ahead")
        with self._lock:
            self._queued += 1
        return self._pool.submit(self._run, fn, args)

    def _run(self, fn, args):
        with self._lock:
            self._queued -= 1
            self._busy += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._busy -= 1

    def cancel(self, fut: Future) -> bool:
        """Cancel a fetch that has not started; False if it has."""
        if not fut.cancel():
            return False
        with self._lock:
            self._queued -= 1
        return True

    def wait(self, fut: Future) -> None:
        """Block until ``fut`` is done; meanwhile, each time a fetch the planning waits on ends,
        plan again (``while_waiting``). Instrumented, a reader that waited here without planning
        left the connections idle: only the few ranges of the batches planned before it waited
        were in flight."""
        plan = self.while_waiting
        while not fut.done():
            if plan is None or self._planning:
                wait([fut])
                return
            self._planning = True
            try:
                others = plan()
            finally:
                self._planning = False
            if fut.done():
                return
            if not others:
                plan = None
                continue
            wait([fut, *others], return_when=FIRST_COMPLETED)

    def saturated(self) -> bool:
        """Every fetch thread busy and more waiting: a read that needs a queued block now should
        not wait behind blocks fetched for later."""
        with self._lock:
            return self._busy >= self.config.read_ahead_connections and self._queued > 0

    def close(self) -> None:
        """Stop the fetch threads (queued fetches are cancelled; running ones end on their own)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def has_room(self) -> bool:
        """Whether the budget holds one more block: a reader may plan further ahead."""
        with self._lock:
            return self._held + self.config.read_ahead_block <= self.config.read_ahead_bytes

    # -- budget -----------------------------------------------------------------------------------

    def _take(self, n: int, stream: ReadAheadStream) -> bool:
        with self._lock:
            if self._held + n <= self.config.read_ahead_bytes:
                self._held += n
                return True
            if stream not in self._hungry:
                self._hungry.append(stream)
            return False

    def _give(self, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            self._held -= n
            # The bytes needed soonest first: a stream extended for the next batch comes before
            # one opened for a batch further on, whenever each was refused.
            hungry = sorted(self._hungry, key=ReadAheadStream.order)
            self._hungry.clear()
        for stream in hungry:  # oldest first: the stream read now was as a rule opened first
            stream._top_up()

    def _forget(self, stream: ReadAheadStream) -> None:
        with self._lock:
            if stream in self._hungry:
                self._hungry.remove(stream)

    # -- fetching ---------------------------------------------------------------------------------

    def _submit(self, url: str, start: int, length: int, etag: str | None) -> Future:
        # The buffer is allocated here, on the reader's thread, which also frees it: glibc keeps
        # freed memory in the arena of the thread that allocated it, and buffers allocated on 32
        # fetch threads (16 arenas) left each arena holding its own high-water mark of blocks.
        # Measured at 0 workers (3,000 photographs, 64 MiB budget): peak RSS +137 MB over no
        # read-ahead with the buffers allocated there, +86 MB with them allocated here.
        return self.call(self.fetch, url, start, length, etag, _unfilled(length))

    def fetch(self, url: str, start: int, length: int, etag: str | None,
              into: bytearray | None = None) -> tuple[memoryview, str | None, int | None]:
        """``(bytes, ETag, object size)`` of ``[start, start + length)`` (fewer bytes only where
        the object ends), through a ``RetryingStream`` pinned to ``etag`` when given. The bytes
        are read straight into one buffer of the range's size (``into``, or a new one): no bytes
        object per socket read, each allocated at the read's size and shrunk to what came, and
        no join, which held each range twice at its end."""
        from .opener import source_for
        from .retrying import RetryingStream
        from .urls import scheme

        raw = RetryingStream(source_for(url, scheme(url), self.config), start=start, length=length,
                             config=self.config, stats=self.stats, etag=etag)
        try:
            view, got = memoryview(_unfilled(length) if into is None else into), 0
            while got < length:
                n = raw.readinto(view[got:])
                if not n:
                    break
                got += n
            return view[:got], raw.etag, raw.size
        finally:
            raw.close()


def _unfilled(n: int) -> bytearray:
    """A bytearray of ``n`` bytes whose contents are whatever the allocator gave: each is
    overwritten by the range before any byte of it is handed out, and zeroing 2 MiB per GET is
    a pass over memory the reader does not need."""
    return _new_bytearray(None, n)


_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_new_bytearray.restype = ctypes.py_object


class ReadAheadStream(io.RawIOBase):
    """A forward-only stream of one remote object from byte ``start``, read through a ``ReadAhead``.

    Not for sharing between threads: only its reader's thread calls it (the fetch threads only
    fill futures).
    """

    def __init__(self, ahead: ReadAhead, url: str, start: int = 0, limit: int | None = None, order: int = 0,
                 whole: int | None = None):
        self._ahead, self._url = ahead, url
        self._whole = whole  # bytes [0, whole) come from the object's one shared GET (ReadAhead.open)
        self._pos = start          # the next byte handed out
        self._next = start         # the next byte asked for
        self._limit = limit
        self._orders: deque[tuple[int | None, int]] = deque([(limit, order)])  # (limit, order) of each want
        self._size: int | None = None   # the object's size, once an answer said it
        self._etag: str | None = None
        self._blocks: deque[_Block] = deque()
        self._cur = memoryview(b"")
        self._cur_held = 0  # budget the current block holds until it has been handed out
        self._cur_shared = False  # _cur is a slice of a shared GET (other streams hand its bytes out)
        self._top_up()

    @property
    def name(self) -> str:
        return self._url

    @property
    def url(self) -> str:
        return self._url

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def want(self, limit: int | None, order: int = 0) -> None:
        """Ask ahead up to byte ``limit`` (None: to the object's end), bytes needed at ``order``
        (see ``ReadAhead.open``); never lowers the limit."""
        if self._limit is not None and (limit is None or limit > self._limit):
            self._limit = limit
            self._orders.append((limit, order))
            self._top_up()

    def order(self) -> int:
        """When the reader needs the next byte this stream would ask for."""
        orders = self._orders
        while len(orders) > 1 and orders[0][0] is not None and orders[0][0] <= self._next:
            orders.popleft()
        return orders[0][1]

    # -- reading ----------------------------------------------------------------------------------

    def read(self, n: int | None = -1) -> bytes:
        self._checkClosed()
        # Views of the chunks, copied once into what is handed out.
        if n is None or n < 0:
            parts = [self._hand(len(self._cur))]  # the rest of the chunk at the position, first
            while self._advance():
                parts.append(self._hand(len(self._cur)))
            return b"".join(parts)
        parts = []
        while n > 0 and (len(self._cur) or self._advance()):
            part = self._hand(min(n, len(self._cur)))
            parts.append(part)
            n -= len(part)
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def _hand(self, n: int) -> memoryview:
        cur = self._cur
        out = cur[:n]
        self._cur = cur[n:]
        self._pos += n
        self._ahead.stats.add(bytes_handed=n)
        return out

    def _advance(self) -> bool:
        """Make the next chunk of the block at the position current; False at the object's end."""
        # The block handed out is gone (an empty view of it would keep its buffer alive): its
        # budget goes to the next ranges. Handed back once the block is, not when it became
        # current, so bytes held never exceed the budget: a stream's current block was outside
        # it, one block per open stream on top of read_ahead_bytes.
        self._cur = memoryview(b"")
        self._ahead._give(self._cur_held)
        self._cur_held = 0
        if self._size is not None and self._pos >= self._size:
            return False
        blocks = self._blocks
        if blocks and blocks[0].start == self._pos:
            block = blocks.popleft()
            fut = block.future
            if (not fut.done() and not block.shared and self._ahead.saturated()
                    and self._ahead.cancel(fut)):  # queued behind others
                data, etag, size = self._fetch_here(block.start, block.length)
            else:
                if not fut.done():
                    t0 = time.monotonic()
                    self._ahead.wait(fut)
                    self._ahead.stats.add(ahead_waits=1, ahead_wait_ms=int((time.monotonic() - t0) * 1000))
                data, etag, size = fut.result()
                if block.shared:  # the object's first bytes: this stream's slice of them
                    data = data[block.start : block.start + block.length]
            self._cur_held = block.held
            length = block.length
            self._cur_shared = block.shared
        else:
            self._drop_blocks()  # none is at the position (the limit was passed): start again here
            self._whole = None  # and on its own ranges: a shared GET now would fetch what it has again
            self._cur_shared = False
            length = self._ahead.config.read_ahead_block
            if self._limit is not None and self._limit > self._pos:
                length = min(length, self._limit - self._pos)  # up to the limit, as a read ahead would
            if self._size is not None:
                length = min(length, self._size - self._pos)
            self._next = self._pos + length
            if self._limit is not None and self._next > self._limit:
                self._limit = self._next  # read past it: the reader needs more than it said
            data, etag, size = self._fetch_here(self._pos, length)
        self._check(etag, size)
        got = len(data)
        if got < length:  # the object ends inside this block
            self._size = self._pos + got
            self._drop_blocks()
        self._cur = data
        self._top_up()
        return got > 0

    def _fetch_here(self, start: int, length: int):
        t0 = time.monotonic()
        got = self._ahead.fetch(self._url, start, length, self._etag)
        self._ahead.stats.add(ahead_waits=1, ahead_wait_ms=int((time.monotonic() - t0) * 1000))
        return got

    def _check(self, etag: str | None, size: int | None) -> None:
        """Every range of the stream came from one version of the object."""
        if etag and self._etag and etag != self._etag:
            raise ObjectChangedError(
                f"{self._url}: the object changed while it was being read (ETag {self._etag} -> {etag})")
        if size is not None and self._size is not None and self._size != size:
            raise ObjectChangedError(
                f"{self._url}: the object changed while it was being read (size {self._size} -> {size})")
        self._etag = self._etag or etag
        if size is not None:
            self._size = size

    def _top_up(self) -> None:
        """Ask for the next ranges up to the limit, as far as the budget allows."""
        if self.closed:
            return
        ahead, block = self._ahead, self._ahead.config.read_ahead_block
        if ahead._deferred is not None:
            ahead._deferred[self] = None
            return
        if self._whole is not None and self._next < self._whole:
            # The rest of a small object in one slice of its shared GET (charged whole: it is small).
            length = self._whole - self._next
            if not ahead._take(length, self):
                return
            fut = ahead._whole(self._url, self._whole, self._etag)
            self._blocks.append(_Block(self._next, length, fut, length, shared=True))
            self._next = self._whole
        while True:
            end = self._limit if self._limit is not None else self._size
            if end is None:
                # An object of unknown size: one range ahead until an answer gives its size.
                if self._blocks or self._next > self._pos + len(self._cur):
                    return
                end = self._next + block
            if self._size is not None:
                end = min(end, self._size)
            length = min(block, end - self._next)
            if ahead._ramp > 0:  # a range of at most a piece is asked for whole
                length = min(length, max(block // RAMP_PIECES, 1))
            if length <= 0 or not ahead._take(length, self):
                return
            if ahead._ramp > 0:
                ahead._ramp -= length
            fut = ahead._submit(self._url, self._next, length, self._etag)
            self._blocks.append(_Block(self._next, length, fut, length))
            self._next += length

    def _drop_blocks(self) -> None:
        """Forget every range asked for ahead: cancel the queued ones, count what was fetched."""
        dropped = 0
        while self._blocks:
            b = self._blocks.popleft()
            if not b.shared and not self._ahead.cancel(b.future):
                dropped += b.length
            self._ahead._give(b.held)
        if dropped:
            self._ahead.stats.add(ahead_dropped=dropped)

    def close(self) -> None:
        if not self.closed:
            self._ahead._forget(self)
            left = 0 if self._cur_shared else len(self._cur)
            self._cur = memoryview(b"")
            self._ahead._give(self._cur_held)
            self._cur_held = 0
            self._drop_blocks()
            if left:
                self._ahead.stats.add(ahead_dropped=left)
        super().close()

    def __repr__(self) -> str:
        return f"<ReadAheadStream {self._url} at {self._pos}>"
