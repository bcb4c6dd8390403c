"""Start writing finished tars to disk while the build goes on.

Tars are written without a per-file fsync (the writer's hot path) and the commit fsyncs the
whole staged version before it points readers at it (``versions.commit``): that stays the one
durability guarantee. Handing each finished tar to a background thread as soon as it is
written lets the disk work while later shards are copied, hashed and indexed, so the commit
finds the bytes already on disk instead of waiting for all of them at once.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

_pending: queue.SimpleQueue[str] = queue.SimpleQueue()
_started = False
_start_lock = threading.Lock()


def _drain() -> None:
    while True:
        path = _pending.get()
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # renamed or removed meanwhile: the commit syncs what is there then
        try:
            os.fsync(fd)
        except OSError:
            pass  # the commit's own fsync of this file reports the error
        finally:
            os.close(fd)


def _forget_thread() -> None:
    # A forked child has the flag but not the thread: start its own on first use.
    global _pending, _started
    _pending, _started = queue.SimpleQueue(), False


os.register_at_fork(after_in_child=_forget_thread)


def sync_soon(path: str | os.PathLike[str]) -> None:
    """Queue ``path`` for an fsync on the background thread; returns at once.

    A daemon thread: a process that ends drops what is queued, which costs nothing but time
    at the next commit.
    """
    global _started
    if not _started:
        with _start_lock:
            if not _started:
                threading.Thread(target=_drain, name="pid-early-sync", daemon=True).start()
                _started = True
    _pending.put(os.fspath(Path(path)))
