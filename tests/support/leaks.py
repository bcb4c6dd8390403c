"""Session-end check: no process the test suite started may outlive it.

A pytest plugin (registered in ``tests/conftest.py``). At configure time the pytest process
becomes a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): a process orphaned by a test -
a build worker whose parent was killed with SIGKILL, a server started in the background - is
re-parented to pytest instead of to init, so it stays visible as a descendant. At session end,
after every fixture (session-scoped servers included) has been torn down, the descendants still
running get a grace period to exit; those left are listed, killed, and the run fails.

An orphan that ends before the session does - a killed trainer's DataLoader worker that runs on
for a minute, then stops - would slip through a check made only at the end. So a watcher thread
polls the process tree (every ``PID_TEST_ORPHAN_POLL_S``, 0.5 s; 0 turns it off): a descendant
whose parent changes to pytest was orphaned, and one still running ``ORPHAN_GRACE_S`` (30 s)
after that fails the run as well, even if it is gone by the end. (Longer than ``GRACE_S``: a
server told to stop may orphan its helpers while they shut down, ``dagster dev`` for up to 25 s.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time

import pytest

from tests.support.procs import alive, cmdline, descendants, kill_all, parent_map, wait_gone

PR_SET_CHILD_SUBREAPER = 36
# DataLoader workers and servers told to stop may take a moment to exit.
GRACE_S = float(os.environ.get("PID_TEST_LEAK_GRACE_S", "10"))
ORPHAN_POLL_S = float(os.environ.get("PID_TEST_ORPHAN_POLL_S", "0.5"))
ORPHAN_GRACE_S = float(os.environ.get("PID_TEST_ORPHAN_GRACE_S", "30"))


class OrphanWatch(threading.Thread):
    """Notes each descendant of ``me`` re-parented to ``me`` (its own parent died) and how long it
    ran on after that."""

    def __init__(self, me: int, interval_s: float):
        super().__init__(name="orphan-watch", daemon=True)
        self.me = me
        self.interval_s = interval_s
        self.parents: dict[int, int] = {}                       # descendant -> parent last seen
        self.orphans: dict[int, tuple[float, int, str]] = {}    # running orphan -> (since, old parent, cmdline)
        self.outlived: list[tuple[int, float, int, str]] = []   # (pid, seconds run after, old parent, cmdline)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.poll()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.poll()
        now = time.monotonic()
        for pid, (since, parent, cmd) in self.orphans.items():
            self.outlived.append((pid, now - since, parent, cmd))
        self.orphans = {}

    def poll(self) -> None:
        table = parent_map()
        now = time.monotonic()
        mine = {p for p in descendants(self.me, table) if alive(p)}
        for pid in mine:
            before, ppid = self.parents.get(pid), table[pid]
            if before is not None and before != ppid and ppid == self.me and pid not in self.orphans:
                self.orphans[pid] = (now, before, " ".join(cmdline(pid).split()))
            self.parents[pid] = ppid
        for pid in [p for p in self.parents if p not in mine]:
            del self.parents[pid]   # gone: its pid may be reused by another process
        for pid in [p for p in self.orphans if p not in mine]:
            since, parent, cmd = self.orphans.pop(pid)
            self.outlived.append((pid, now - since, parent, cmd))


def _become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: orphans go to init and only children are seen
        return False


def _reap(pids: set[int]) -> None:
    # Orphans re-parented to us are our children now: collect their exit status (no zombies).
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SUBREAPER] = subreaper = _become_subreaper()
    watch = None
    if subreaper and ORPHAN_POLL_S > 0:
        watch = OrphanWatch(os.getpid(), ORPHAN_POLL_S)
        watch.start()
    config.stash[_WATCH] = watch


_SUBREAPER = pytest.StashKey[bool]()
_WATCH = pytest.StashKey["OrphanWatch | None"]()


def _late_orphans(watch: OrphanWatch | None, reported: set[int]) -> list[str]:
    """Orphans that ran ``ORPHAN_GRACE_S`` or more after their parent died (those still running
    at the end are reported with the other leaks)."""
    if watch is None:
        return []
    watch.stop()
    return [f"pid {pid}: ran {secs:.0f} s after its parent (pid {parent}) died: {cmd}"
            for pid, secs, parent, cmd in sorted(watch.outlived) if secs >= ORPHAN_GRACE_S and pid not in reported]


def _own_helpers() -> set[int]:
    """multiprocessing's resource tracker and forkserver *of the pytest process itself* (a test
    that ran a pool in-process): they live as long as pytest and end when it exits."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None)}
    return {p for p in pids if p}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    me = os.getpid()
    running = {p for p in descendants(me) if alive(p)} - _own_helpers()
    left = wait_gone(running, GRACE_S)
    msgs = []
    if left:
        described = {p: cmdline(p) for p in sorted(left)}
        kill_all(left)
        wait_gone(left, 5.0)
        lines = [f"pid {p}: {c}" for p, c in described.items()]
        msgs.append(
            f"{len(left)} process(es) started by the test suite were still running {GRACE_S:.0f} s after "
            "it ended (now killed); a test or fixture leaks them:\n  " + "\n  ".join(lines)
        )
    late = _late_orphans(session.config.stash.get(_WATCH, None), left)
    if late:
        msgs.append(
            f"{len(late)} process(es) ran on {ORPHAN_GRACE_S:.0f} s or more after the process that started them "
            "was killed (a DataLoader worker of a killed trainer: give the DataLoader "
            "loader.workers.worker_init(...) as worker_init_fn):\n  " + "\n  ".join(late)
        )
    if msgs:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for msg in msgs:
            if reporter is not None:
                reporter.write_sep("=", "leaked processes", red=True)
                reporter.write_line(msg)
            else:
                print(msg)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _reap({p for p in descendants(me)})
