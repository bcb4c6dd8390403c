"""Ordered parallel map over worker processes or threads; runs inline for one worker.

Worker processes end with the process that started them, however it ends (kill -9 included):
each worker asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``) and, where
that is not available, watches its parent pid. They are started with ``spawn``: direct children
of the build, no forkserver in between to outlive it, and no fork() of a threaded process
(Dagster and boto3 start threads).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.5


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def end_with_parent(parent: int) -> None:
    """Pool initializer: make this worker die when ``parent`` (the pid that started it) does."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()


def ordered_map(fn: Callable[[T], R], items: Iterable[T], num_workers: int, *, threads: bool = False) -> Iterator[R]:
    """Yield ``fn(item)`` in input order; results do not depend on the worker count.

    ``threads=True`` for work that spends its time in system calls that release the GIL
    (sendfile, write, hashing large buffers): no process start-up, no pickling of the tasks.
    """
    items = list(items)
    if num_workers <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    if threads:
        with ThreadPoolExecutor(max_workers=min(num_workers, len(items)), thread_name_prefix="pid-build") as pool:
            yield from pool.map(fn, items)
        return
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=min(num_workers, len(items)), mp_context=ctx,
        initializer=end_with_parent, initargs=(os.getpid(),),
    ) as pool:
        yield from pool.map(fn, items, chunksize=1)


def chunked(seq: list[T], size: int) -> list[list[T]]:
    return [seq[i : i + size] for i in range(0, len(seq), size)]
