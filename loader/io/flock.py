"""An exclusive inter-process lock on a lock file (``fcntl.flock``), the one the project uses.

The kernel drops an flock when its holder exits, even on SIGKILL, so a crashed process never
blocks the next one on a local file system. The holder writes a line saying who it is into the
file; a process that finds it taken quotes that line in its error.

A lock is only as good as the inode it is on: if the file is removed (or replaced) between a
taker's ``open`` and its ``flock``, the taker holds a lock on a file no one else will open. So
after locking, the taker checks that the path still names the inode it locked, and else tries
again on the new file. That makes deleting the file on release safe too (``remove=True``): a
waiter that opened the old file sees the name gone once it gets the lock, and retries.

Callers: the build's one-build-per-output lock (``pid_platform/sharding/output_lock.py``: no waiting,
file removed on release) and the sidecar builders' lock (``loader/lerobot/sidecar/process_lock.py``:
waits with a timeout, file kept).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

DEFAULT_POLL_S = 0.1


def read_lock_holder(path: str | os.PathLike[str]) -> str:
    """What the holder (or the last holder) of the lock at ``path`` wrote; "" if nothing."""
    try:
        return Path(path).read_bytes().decode("utf-8", errors="replace").strip()
    except OSError:
        return ""


def acquire_flock(path: str | os.PathLike[str], *, timeout_s: float | None = None,
                  poll_s: float = DEFAULT_POLL_S, on_busy: Callable[[], None] | None = None) -> int | None:
    """Lock ``path`` (created, with its folder, if needed): the locked descriptor, or None once
    ``timeout_s`` has passed with the lock taken (``0``: one try; ``None``: wait for ever).

    ``on_busy`` is called each time the lock is found taken and there is time left to wait. ``OSError`` from
    creating or opening the file propagates: the caller knows which folder that concerns.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            if on_busy is not None:
                on_busy()
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - now)))
            continue
        except BaseException:
            os.close(fd)
            raise
        if _names_inode(path, fd):
            return fd
        os.close(fd)  # removed or replaced between our open and flock: lock the file there now


def _names_inode(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def write_lock_holder(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode("utf-8"), 0)


def release_flock(fd: int, path: str | os.PathLike[str], *, remove: bool) -> None:
    """Let go of a lock from :func:`acquire_flock`; ``remove``: delete the file first (before
    the flock goes, so no one can lock the name in between), else just clear the holder line."""
    try:
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing the last descriptor releases the flock


@contextlib.contextmanager
def flock_held(path: str | os.PathLike[str], *, holder: str, busy: Callable[[], BaseException],
               timeout_s: float | None = None, poll_s: float = DEFAULT_POLL_S,
               on_busy: Callable[[], None] | None = None, remove: bool = False) -> Iterator[Path]:
    """Hold the lock on ``path`` for the ``with`` body, with ``holder`` written into the file.

    When ``timeout_s`` passes with the lock taken, ``busy()`` is raised: the caller's named
    error, which can quote :func:`read_lock_holder`.
    """
    path = Path(path)
    fd = acquire_flock(path, timeout_s=timeout_s, poll_s=poll_s, on_busy=on_busy)
    if fd is None:
        raise busy()
    try:
        write_lock_holder(fd, holder)
    except BaseException:
        release_flock(fd, path, remove=remove)
        raise
    try:
        yield path
    finally:
        release_flock(fd, path, remove=remove)
