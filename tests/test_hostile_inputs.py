"""Hostile inputs and kills: what each gets (the one list; see the table in docs/formats.md too).

HOSTILE_CASES_TABLE
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pid_platform.build.lock import BuildInProgressError
from tests.support.build_data import build

HOLD_LOCK = """
import sys, time
from pid_platform.build.lock import build_lock
with build_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


# --------------------------------------------------------------------------- output folder


def test_a_build_through_a_link_to_a_folder_being_built_is_refused(raw_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    link = tmp_path / "link-to-out"
    link.symlink_to(out)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(link)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        # Both spellings stage in one folder: the second build must see the first one's lock.
        with pytest.raises(BuildInProgressError, match=rf"pid {holder.pid}"):
            build(raw_root, out)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert list(out.iterdir()) == []
