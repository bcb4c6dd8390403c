"""Ordered parallel map over worker processes; runs inline for one worker."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(fn: Callable[[T], R], items: Iterable[T], num_workers: int) -> Iterator[R]:
    """Yield ``fn(item)`` in input order; results do not depend on the worker count."""
    items = list(items)
    if num_workers <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    # forkserver: Dagster and boto3 start threads, and fork()ing a threaded process can deadlock.
    ctx = mp.get_context("forkserver")
    with ProcessPoolExecutor(max_workers=min(num_workers, len(items)), mp_context=ctx) as pool:
        yield from pool.map(fn, items, chunksize=1)


def chunked(seq: list[T], size: int) -> list[list[T]]:
    return [seq[i : i + size] for i in range(0, len(seq), size)]
