"""An inter-process lock on a lock file (``loader.io.flock``) with a timeout and a named holder.

The kernel drops an flock when its holder exits, even on SIGKILL, so a crashed builder never
blocks the next one on a local file system. The holder writes who it is into the lock file
(pid, host, start time, what it does); a waiter that times out quotes it, so the error says
which process to look for. The lock file is kept (its holder line cleared on release), so a
stale one still says who held it last; if someone removes it anyway, an acquirer notices (the
path no longer names its inode) and retries.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loader.io.flock import flock_held, read_lock_holder

from .errors import SidecarLockTimeout

log = logging.getLogger(__name__)

LOCK_TIMEOUT_SETTING = "streaming_sidecar_lock_timeout_s"
DEFAULT_LOCK_TIMEOUT_S = 1800.0
_POLL_S = 0.1
_WAIT_LOG_EVERY_S = 30.0


def read_holder(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Who holds (or last held) the lock at ``path``, as written by the holder; None if unknown."""
    text = read_lock_holder(path)
    try:
        return json.loads(text) if text else None
    except ValueError:
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
    next_log = time.monotonic() + _WAIT_LOG_EVERY_S
    waited = False

    def log_wait() -> None:
        nonlocal waited, next_log
        now = time.monotonic()
        if not waited:
            log.info("waiting for %s, held by %s", path, _describe(read_holder(path)))
            waited = True
        elif now >= next_log:
            log.info("still waiting for %s, held by %s", path, _describe(read_holder(path)))
            next_log = now + _WAIT_LOG_EVERY_S

    def timed_out() -> SidecarLockTimeout:
        return SidecarLockTimeout(timeout_message(path, timeout_s or 0.0, purpose))

    with flock_held(path, holder=_holder(purpose), busy=timed_out, timeout_s=timeout_s, poll_s=poll_s,
                    on_busy=log_wait):
        log.debug("locked %s (%s)", path, purpose)
        yield path


def _holder(purpose: str) -> str:
    info = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": purpose,
            "since": datetime.now(UTC).isoformat(timespec="seconds")}
    return json.dumps(info, sort_keys=True) + "\n"
