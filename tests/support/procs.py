"""Processes seen through /proc (psutil is not a dependency): parents, descendants, liveness.

Used by the session-end leak check (``tests/support/leaks.py``) and by the kill tests, which
must show that nothing a killed build started outlives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable


def _stat_fields(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or parentheses.
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest[0], int(rest[1])


def parent_map() -> dict[int, int]:
    """pid -> ppid of every process this user can see."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields is not None:
                out[int(name)] = fields[1]
    return out


def descendants(root: int, parents: dict[int, int] | None = None) -> set[int]:
    """Every process below ``root`` in the process tree (children, their children...), from
    ``parents`` (a :func:`parent_map`) or from /proc now."""
    children: dict[int, list[int]] = {}
    for pid, ppid in (parent_map() if parents is None else parents).items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie - exited, not yet reaped - counts as gone)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def wait_gone(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to end; return those still running."""
    pending = set(pids)
    deadline = time.monotonic() + timeout
    while True:
        pending = {p for p in pending if alive(p)}
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(0.05)


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL each pid (processes the test suite itself started), one by one."""
    for pid in sorted(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
