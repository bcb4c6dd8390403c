"""glibc heap settings for a process that reads samples in batches.

A batch of samples is tens of megabytes of ``bytes`` objects, allocated member by member and
freed together when the batch is collated or dropped. With glibc's defaults the freed top of the
heap is handed back to the kernel after every batch (the trim threshold follows the largest
freed mmap chunk: a few hundred KB), and the next batch faults every page in again: measured on
``bench/bench_loader_sync.py``, 40% of the reader's time (174 ms -> 113 ms for 468 MB). Keeping
up to ``TRIM_BYTES`` of freed heap and serving members up to ``MMAP_BYTES`` from the heap ends
that. It is set once, in the process that reads (each DataLoader worker, or the training process
with ``num_workers=0``), never when the user set glibc's own ``MALLOC_*`` variables, and not at
all with ``PID_LOADER_HEAP=default``.
"""

from __future__ import annotations

import ctypes
import os
import sys

TRIM_BYTES = 256 << 20  # freed heap kept for the next batches: a few batches of large images
MMAP_BYTES = 32 << 20  # glibc's own ceiling for its adaptive threshold on 64-bit
ENV = "PID_LOADER_HEAP"
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GLIBC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
_state: dict[int, bool] = {}  # pid -> applied: a forked worker decides for itself


def keep_heap_for_batches() -> bool:
    """Apply the settings in this process (once); True when they are in force."""
    pid = os.getpid()
    if pid in _state:
        return _state[pid]
    _state[pid] = applied = _apply()
    return applied


def _apply() -> bool:
    if os.environ.get(ENV, "") == "default" or not sys.platform.startswith("linux"):
        return False
    if any(v in os.environ for v in _GLIBC_ENV):
        return False  # the user tuned the allocator: theirs wins
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc only; musl has none
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
