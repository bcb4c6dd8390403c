"""Kill a whole process tree the way a lost machine would, and check nothing of it survives.

    groups = kill_process_tree(proc.pid)     # SIGKILL to every process group in the tree
    proc.wait()
    assert wait_until_gone(groups, 10) == []

A launcher may put its children in sessions of their own (torchrun does: each rank is a session
leader, its DataLoader workers in the rank's group), so killing the launcher's group alone would
leave the ranks running. This kills the group of the root and of every descendant, root first, so
no new child is started by a launcher that has not been killed yet. Read from ``/proc`` (Linux).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, state letter) of every process visible now."""
    out: dict[int, tuple[int, int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = text[text.rindex(")") + 2:].split()
        out[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return out


def descendants(pid: int, table: dict[int, tuple[int, int, str]] | None = None) -> list[int]:
    """Every process below ``pid``, parents before their children."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for child, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], sorted(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(sorted(children.get(p, [])))
    return out


def kill_process_tree(pid: int) -> set[int]:
    """SIGKILL the process group of ``pid`` and of each of its descendants; return those groups."""
    table = process_table()
    groups: list[int] = []
    for p in [pid, *descendants(pid, table)]:
        if p in table and table[p][1] not in groups:
            groups.append(table[p][1])
    if pid not in table:
        groups.insert(0, pid)  # already gone: its group (pgid == pid for a session leader) may not be
    for group in groups:
        with contextlib.suppress(ProcessLookupError):  # the whole group exited meanwhile
            os.killpg(group, signal.SIGKILL)
    return set(groups)


def living_members(groups: set[int]) -> list[int]:
    """Processes of ``groups`` that still run (zombies, dead but not yet reaped, do not count)."""
    return sorted(p for p, (_, group, state) in process_table().items() if group in groups and state not in "ZX")


def wait_until_gone(groups: set[int], timeout_s: float) -> list[int]:
    """The members of ``groups`` still running after up to ``timeout_s`` (empty once all are gone)."""
    deadline = time.monotonic() + timeout_s
    while (alive := living_members(groups)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive
