"""A build killed with SIGKILL mid-way never shows a partial tar, and a re-run finishes it exactly.

A build writes into its staging folder beside ``--output-dir`` and publishes it by renaming at
the end; so the staged tars are watched here, and the output folder must not appear until then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from loader.formats.atomic import TMP_MARKER
from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.layout import STATE_DIR
from tests.support.build_data import SOURCE, build, output_files

COPIES = 4  # 32 photographs x 4 = 128 one-sample shards: long enough to be caught mid-way
ARGS = ["--shard-size", "1", "--num-workers", "1"]


def _bulk_drop(raw_root: Path) -> int:
    """Hard-link every sample under new names: many real samples, no extra bytes on disk."""
    src = raw_root / SOURCE
    n = 0
    for m in sorted(os.listdir(src)):
        for name in sorted(os.listdir(src / m)):
            stem, ext = name.rsplit(".", 1)
            for i in range(1, COPIES):
                os.link(src / m / name, src / m / f"{stem}-copy{i}.{ext}")
            n += m == "image"
    return n * COPIES


def _pid_shard(raw_root: Path, out: Path) -> list[str]:
    cli = Path(sys.executable).parent / "pid-shard"
    return [str(cli), "--input-dir", str(raw_root / SOURCE), "--output-dir", str(out), *ARGS]


def _final_files(out: Path) -> list[Path]:
    found = []
    for dirpath, dirs, names in os.walk(out):
        dirs[:] = [d for d in dirs if d != STATE_DIR]
        found += [Path(dirpath) / n for n in names]
    return found


def _stamps(staged: Path) -> int:
    # Stamps are committed by rename too: their temporary files are not stamps yet.
    return sum(TMP_MARKER not in n for _, _, names in os.walk(staged / STATE_DIR / "stamps") for n in names)


def _check_visible_tars(staged: Path, reference: dict[str, bytes], pid: int) -> int:
    """Every tar under a final name is complete; temporary files carry the writer's pid."""
    complete = 0
    for p in _final_files(staged):
        rel = p.relative_to(staged).as_posix()
        if TMP_MARKER in p.name:
            assert p.name.endswith(f"{TMP_MARKER}{pid}"), p
            continue
        if p.suffix == ".tar":
            try:
                data = p.read_bytes()
            except FileNotFoundError:  # no tar is ever removed by a writer; but be exact
                raise AssertionError(f"{rel} vanished while the build ran") from None
            assert data == reference[rel], f"{rel}: {len(data)} bytes, expected {len(reference[rel])}"
            complete += 1
    return complete


def test_killed_build_shows_no_partial_tar_and_rerun_matches(raw_root: Path, tmp_path: Path) -> None:
    samples = _bulk_drop(raw_root)
    ref_out = tmp_path / "reference"
    ref = build(raw_root, ref_out, shard_size=1)
    assert ref.shards == samples
    reference = output_files(ref_out)
    total_tars = sum(p.endswith(".tar") for p in reference)

    out = tmp_path / "out"
    staged = staging_dir(out)
    proc = subprocess.Popen(_pid_shard(raw_root, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while _stamps(staged) < 2:  # two shards committed: the writer is in its loop
            assert proc.poll() is None, f"pid-shard ended before it was killed: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline, "pid-shard never started writing shards"
            _check_visible_tars(staged, reference, proc.pid)
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    # At kill time: some shards done, not all; nothing published and no manifest staged, so no
    # reader can see a half build.
    assert not out.exists()
    visible = _check_visible_tars(staged, reference, proc.pid)
    assert 0 < visible < total_tars
    assert _stamps(staged) < samples
    assert not list(staged.rglob("wdinfo.json"))
    for p in _final_files(staged):
        if p.suffix == ".tar":
            with tarfile.open(p) as tf:
                assert len(tf.getmembers()) == 1

    rerun = subprocess.run(_pid_shard(raw_root, out), capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    kept = int(rerun.stdout.split("already up to date: ")[1].split()[0])
    assert kept >= 2  # the re-run resumed rather than starting over
    assert output_files(out) == reference
    assert not [p for p in out.rglob(f"*{TMP_MARKER}*")]
    assert not staged.exists()
