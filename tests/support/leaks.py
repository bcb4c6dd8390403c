"""Session-end check: no process the test suite started may outlive it.

A pytest plugin (registered in ``tests/conftest.py``). At configure time the pytest process
becomes a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): a process orphaned by a test -
a build worker whose parent was killed with SIGKILL, a server started in the background - is
re-parented to pytest instead of to init, so it stays visible as a descendant. At session end,
after every fixture (session-scoped servers included) has been torn down, the descendants still
running get a grace period to exit; those left are listed, killed, and the run fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

import pytest

from tests.support.procs import alive, cmdline, descendants, kill_all, wait_gone

PR_SET_CHILD_SUBREAPER = 36
# DataLoader workers and servers told to stop may take a moment to exit.
GRACE_S = float(os.environ.get("PID_TEST_LEAK_GRACE_S", "10"))


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
    config.stash[_SUBREAPER] = _become_subreaper()


_SUBREAPER = pytest.StashKey[bool]()


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
    if left:
        described = {p: cmdline(p) for p in sorted(left)}
        kill_all(left)
        wait_gone(left, 5.0)
        lines = [f"pid {p}: {c}" for p, c in described.items()]
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = (
            f"{len(left)} process(es) started by the test suite were still running {GRACE_S:.0f} s after "
            "it ended (now killed); a test or fixture leaks them:\n  " + "\n  ".join(lines)
        )
        if reporter is not None:
            reporter.write_sep("=", "leaked processes", red=True)
            reporter.write_line(msg)
        else:
            print(msg)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _reap({p for p in descendants(me)})
