"""One build of an output folder at a time: a second one stops at once with a clear error."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pid_platform.sharding.output_lock import BuildInProgressError, build_lock, lock_path
from tests.support.build_data import build

HOLD = """
import sys, time
from pid_platform.sharding.output_lock import build_lock
with build_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_build_of_the_same_output_is_refused(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(BuildInProgressError, match=rf"another build of .*out is running \(pid {holder.pid}\)"):
            build(raw_root, out)
        assert not out.exists(), "the refused build must not have started writing"
    finally:
        holder.kill()
        holder.wait()
    # The kernel released the dead holder's lock: the next build goes ahead.
    summary = build(raw_root, out)
    assert summary.samples > 0 and not lock_path(out).exists()  # only there while a build runs


def test_nested_steps_of_one_process_share_the_lock(tmp_path: Path) -> None:
    out = tmp_path / "out"
    t0 = time.monotonic()
    with build_lock(out), build_lock(out), build_lock(out):
        pass
    with build_lock(out):  # released after the outermost exit
        pass
    assert time.monotonic() - t0 < 5
