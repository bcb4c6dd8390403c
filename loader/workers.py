"""DataLoader workers that die with the process that started them, even after ``kill -9`` of it.

A plain PyTorch DataLoader worker notices a dead parent only when it next waits for work (its
watchdog polls every few seconds), and not at all while it is blocked elsewhere: in a reader's
own threads, or in a put to a queue nobody drains any more. A killed trainer can so leave its
workers running, holding memory, connections and CPU, for as long as that lasts.

``die_with_parent`` makes the kernel send the calling process SIGKILL when its parent dies
(Linux ``prctl(PR_SET_PDEATHSIG)``), then checks that the parent is still the one that started it:
a parent that died between the fork and the ``prctl`` call would otherwise go unnoticed (the
worker has already been re-parented). SIGKILL, not SIGTERM: a worker holds nothing that must be
flushed (readers write nothing), and no handler or blocked thread can delay it.

``WorkerInit`` wraps a DataLoader's ``worker_init_fn`` (the user's, if any, runs after it); both
readers' loaders (``loader.wds`` and ``loader.lerobot.streaming``) pass it to every DataLoader
they build. Elsewhere than Linux it is a no-op (``die_with_parent`` returns False), and the
workers rely on PyTorch's own watchdog.

One caveat of the kernel's rule: the "parent" is the *thread* that started the worker. The
DataLoader starts its workers in the thread that calls ``iter()`` on it; iterating a loader in a
thread that ends while another thread goes on reading the same iterator would kill its workers.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _parent_pid() -> int | None:
    """The pid of the process that started this one, as multiprocessing recorded it at the start
    (``os.getppid()`` would already name the new parent if the old one is gone)."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else None


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Have this process killed (SIGKILL) when its parent dies; True when that is now in force.

    ``parent_pid``: the parent expected (default: the one multiprocessing started this process
    from). If it is already gone, this process kills itself at once."""
    if not sys.platform.startswith("linux"):
        return False
    expected = parent_pid if parent_pid is not None else _parent_pid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if expected is not None and os.getppid() != expected:
        # The parent died before the prctl call took effect: nobody will send the signal.
        os.kill(os.getpid(), signal.SIGKILL)
    return True


class WorkerInit:
    """A DataLoader ``worker_init_fn``: ``die_with_parent()``, then ``user_fn(worker_id)``.

    A class, not a closure, so it pickles under the spawn and forkserver start methods."""

    def __init__(self, user_fn: Callable[[int], None] | None = None):
        if user_fn is not None and not callable(user_fn):
            raise TypeError(f"worker_init_fn must be callable or None, got {user_fn!r}")
        # Wrapping twice (a loader handed an already wrapped function) runs the user's once.
        self.user_fn = user_fn.user_fn if isinstance(user_fn, WorkerInit) else user_fn

    def __call__(self, worker_id: int) -> None:
        die_with_parent()
        if self.user_fn is not None:
            self.user_fn(worker_id)

    def __repr__(self) -> str:
        return f"WorkerInit({self.user_fn!r})"


def worker_init(user_fn: Callable[[int], None] | None = None) -> WorkerInit:
    """The ``worker_init_fn`` to give a DataLoader: its workers die with this process."""
    return WorkerInit(user_fn)
