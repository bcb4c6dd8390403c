"""An inter-process lock on a lock file (``fcntl.flock``) with a timeout and a named holder.

The kernel drops an flock when its holder exits, even on SIGKILL, so a crashed builder never
blocks the next one on a local file system. The holder writes who it is into the lock file
(pid, host, start time, what it does); a waiter that times out quotes it, so the error says
which process to look for. The lock file is never deleted by the lock itself: deleting it
while another process waits would let two processes hold "the" lock on different inodes. If
someone removes it anyway, an acquirer notices (the path no longer names its inode) and retries.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .errors import SidecarLockTimeout

log = logging.getLogger(__name__)

LOCK_TIMEOUT_SETTING = "streaming_sidecar_lock_timeout_s"
DEFAULT_LOCK_TIMEOUT_S = 1800.0
_POLL_S = 0.1
_WAIT_LOG_EVERY_S = 30.0


def read_holder(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Who holds (or last held) the lock at ``path``, as written by the holder; None if unknown."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "an unknown process"
    return (f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}"
            f" ({holder.get('purpose', '?')})")


def timeout_message(path: Path, timeout_s: float, purpose: str) -> str:
    holder = read_holder(path)
    pid = (holder or {}).get("pid", "<pid>")
    return (
        f"timed out after {timeout_s:g} s waiting for the lock {path} to {purpose}; it is held by "
        f"{_describe(holder)}. Another process may still be indexing the same revision: check "
        f"with `ps -p {pid}` on that host (or `fuser -v {path}` / `lsof {path}`). If it is still "
        f"working, wait or raise {LOCK_TIMEOUT_SETTING} (large datasets take longer to index). "
        f"If no process holds it (a stale lock, e.g. on a network file system after a crash), "
        f"remove {path} and retry."
    )


@contextlib.contextmanager
def process_lock(path: str | os.PathLike[str], *, timeout_s: float | None, purpose: str,
                 poll_s: float = _POLL_S) -> Iterator[Path]:
    """Hold an exclusive lock on ``path`` (created if needed) for the ``with`` body.

    ``timeout_s=None`` waits forever; on timeout raises SidecarLockTimeout naming the holder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    next_log = time.monotonic() + _WAIT_LOG_EVERY_S
    waited = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise SidecarLockTimeout(timeout_message(path, timeout_s or 0.0, purpose)) from None
            if not waited:
                log.info("waiting for %s, held by %s", path, _describe(read_holder(path)))
                waited = True
            elif now >= next_log:
                log.info("still waiting for %s, held by %s", path, _describe(read_holder(path)))
                next_log = now + _WAIT_LOG_EVERY_S
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - now)))
            continue
        except BaseException:
            os.close(fd)
            raise
        if not _same_inode(fd, path):
            os.close(fd)   # the file was removed or replaced meanwhile: lock the new one
            continue
        break
    try:
        _write_holder(fd, purpose)
        log.debug("locked %s (%s)", path, purpose)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)   # closing the last descriptor releases the flock


def _same_inode(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _write_holder(fd: int, purpose: str) -> None:
    info = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": purpose,
            "since": datetime.now(UTC).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info, sort_keys=True) + "\n").encode("utf-8"), 0)
