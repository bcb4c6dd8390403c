"""Which process holds a record (the build lease), and whether it is certainly gone.

A lease left by a build killed with ``kill -9`` (or by the OOM killer) would block the output
until it expires; a rerun on the same machine can do better, because it can look. The lease
records, beside host and pid, the machine's boot (``/proc/sys/kernel/random/boot_id``), the pid
namespace (a container on the same kernel shares the boot id but not the pids) and the
process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot). A reader on the
same host, boot and pid namespace knows the holder is gone when that pid no longer exists, is
a zombie, or is another process (a different start time: the pid was reused). Anywhere else
(another machine, a record without these fields, no ``/proc``) it cannot know, and says so.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(4096).decode("ascii", "replace").strip() or None
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of ``pid``; None when there is none."""
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or parentheses.
    rest = raw[raw.rfind(")") + 2:].split()
    try:
        return rest[0], int(rest[19])  # fields 3 (state) and 22 (starttime)
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


@dataclass(frozen=True)
class HolderProcess:
    """A process as a record names it: where it ran and which process it was."""

    host: str
    pid: int
    boot: str | None = None
    pidns: int | None = None
    start: int | None = None

    @classmethod
    def of(cls, pid: int) -> HolderProcess:
        """Process ``pid`` of this machine (its start time None if there is none)."""
        stat = _stat(pid)
        return cls(socket.gethostname()[:100], pid, _read(BOOT_ID), _pid_namespace(),
                   None if stat is None else stat[1])

    @classmethod
    def this(cls) -> HolderProcess:
        return cls.of(os.getpid())

    def on_this_machine(self) -> bool:
        """Same host, boot and pid namespace as this process: its pid can be looked up here."""
        here = HolderProcess.this()
        return None not in (self.boot, self.pidns, self.start, here.boot, here.pidns) and \
            (self.host, self.boot, self.pidns) == (here.host, here.boot, here.pidns)

    def gone(self) -> bool:
        """True only when certain: on this machine, and its pid is free, a zombie or another
        process (reused). False when it runs, or when it cannot be known from here."""
        if not self.on_this_machine():
            return False
        stat = _stat(self.pid)
        return stat is None or stat[0] in ("Z", "X") or stat[1] != self.start
