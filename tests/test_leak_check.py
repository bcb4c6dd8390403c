"""The session-end leak check (tests/support/leaks.py) catches an orphaned process, and only then."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.procs import alive

REPO = Path(__file__).resolve().parents[1]

LEAKY = '''
import subprocess

def test_leaves_an_orphan():
    # The shell exits at once; its background sleep is orphaned, as a killed build's worker is.
    out = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    open("orphan.pid", "w").write(out.stdout.strip())
'''

CLEAN = '''
import subprocess

def test_waits_for_its_child():
    subprocess.run(["sleep", "0.1"], check=True)
'''


def _run_nested(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_nested.py").write_text(body)
    env = os.environ | {"PYTHONPATH": str(REPO), "PID_TEST_LEAK_GRACE_S": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.support.leaks",
         "test_nested.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


def test_an_orphaned_process_fails_the_run_and_is_killed(tmp_path: Path) -> None:
    res = _run_nested(tmp_path, LEAKY)
    pid = int((tmp_path / "orphan.pid").read_text())
    assert res.returncode == 1, res.stdout + res.stderr
    assert "leaked processes" in res.stdout and f"pid {pid}: sleep 300" in res.stdout, res.stdout
    assert not alive(pid), "the check kills what it reports"


def test_a_suite_that_waits_for_its_processes_passes(tmp_path: Path) -> None:
    res = _run_nested(tmp_path, CLEAN)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "leaked processes" not in res.stdout
