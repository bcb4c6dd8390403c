"""Ordered parallel map over worker processes or threads; runs inline for one worker."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


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
    # forkserver: Dagster and boto3 start threads, and fork()ing a threaded process can deadlock.
    ctx = mp.get_context("forkserver")
    with ProcessPoolExecutor(max_workers=min(num_workers, len(items)), mp_context=ctx) as pool:
        yield from pool.map(fn, items, chunksize=1)


def chunked(seq: list[T], size: int) -> list[list[T]]:
    return [seq[i : i + size] for i in range(0, len(seq), size)]
