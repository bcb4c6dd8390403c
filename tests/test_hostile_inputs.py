"""Hostile inputs and kills: what each gets (the one list; see the table in docs/formats.md too).

HOSTILE_CASES_TABLE
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pid_platform.build.lock import BuildInProgressError
from pid_platform.cli import shard_main
from tests.support.build_data import SOURCE, build

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


def test_a_folder_no_build_made_is_refused_and_never_emptied(raw_root: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "theirs"
    foreign = {"image/part_000000/000000.tar": b"someone's tar", "wdinfo.json": b'{"data_keys": []}'}
    for rel, data in foreign.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    argv = ["--input-dir", str(raw_root / SOURCE), "--output-dir", str(out), "--num-workers", "1"]
    assert shard_main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no .pid-build/" in err and "--force" in err and "empty" in err
    assert {p: (out / p).read_bytes() for p in foreign} == foreign
    # --force builds into it, and still deletes nothing the build did not write.
    assert shard_main([*argv, "--force"]) == 0
    summary = capsys.readouterr().out
    assert "previous version the new one dropped" not in summary
    assert {p: (out / p).read_bytes() for p in foreign} == foreign
    assert sorted(out.glob("aspect_ratio_*/wdinfo.json"))
