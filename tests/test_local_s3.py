"""The local S3 mode (``./dev s3``): SeaweedFS started for a person, gone with its parent."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.procs import alive, wait_gone

REPO = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, "PYTHONPATH": str(REPO)}

HOLD_A_SERVER = textwrap.dedent("""
    import time
    from pid_platform.demo import local_s3
    server = local_s3.start()
    print(server.process.pid, server.data_dir, flush=True)
    time.sleep(600)
""")


def test_the_server_dies_with_its_parent_even_after_kill_9() -> None:
    parent = subprocess.Popen([sys.executable, "-c", HOLD_A_SERVER], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        pid, data_dir = parent.stdout.readline().split()
        weed = int(pid)
        assert alive(weed)
        os.kill(parent.pid, signal.SIGKILL)  # no finally, no atexit: only the kernel can stop weed now
        parent.wait(timeout=30)
        assert wait_gone([weed], timeout=15) == set()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    shutil.rmtree(data_dir, ignore_errors=True)


def test_dev_s3_builds_from_s3_into_s3_and_trains_from_the_bucket(tmp_path: Path) -> None:
    """What ``./dev s3`` runs after its setup."""
    proc = subprocess.run(
        [sys.executable, "-m", "pid_platform.demo.s3_demo", "--work-dir", str(tmp_path), "--num-workers", "1",
         "--batch-size", "16"],
        env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    pid = int(out.split("(pid ", 1)[1].split(",", 1)[0])
    assert "building photos: s3://pid-raw/drops/photos -> s3://pid-out/built/photos" in out
    assert "catalog: s3://pid-out/built/catalog.json" in out
    assert "training from s3://pid-out/built/photos" in out and "105 samples per rank in this run" in out
    assert not alive(pid)  # stopped by its process id on the way out
    assert not (tmp_path / "s3:").exists()
