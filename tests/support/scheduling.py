"""Fails a test after which the test process's thread runs under a real-time CPU scheduling
policy (``SCHED_FIFO``/``SCHED_RR``), and puts the policy back.

Every process a later test starts would inherit it. Under FIFO a process that never blocks is
never preempted by its equals: that is how, once the tests had encoded AV1 as root (SVT-AV1 raises
the encoding thread to FIFO 99, see ``pid_platform.demo.sample_video.scheduling_kept``), two
spinning headless-chromium renderers held both CI cores for 40 minutes.
"""

from __future__ import annotations

import os

import pytest

_REALTIME = {getattr(os, name) for name in ("SCHED_FIFO", "SCHED_RR") if hasattr(os, name)}


def _policy() -> tuple[int, os.sched_param] | None:
    if not hasattr(os, "sched_getscheduler"):
        return None
    return os.sched_getscheduler(0), os.sched_getparam(0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    before = _policy()
    result = yield
    after = _policy()
    if before is not None and after != before and after[0] in _REALTIME:
        os.sched_setscheduler(0, *before)
        raise AssertionError(
            f"{item.nodeid} left this process's thread under real-time scheduling (policy {after[0]}, "
            f"priority {after[1].sched_priority}); every process started from it would inherit that. "
            "Wrap the code that does it (an SVT-AV1 encoder, run as root, does) in "
            "pid_platform.demo.sample_video.scheduling_kept()")
    return result
