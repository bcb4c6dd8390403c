"""The session-end leak check (tests/support/leaks.py) catches an orphaned process, and only then:
one still running at the end, and one that ran on after its parent was killed but ended before."""

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


# A trainer whose DataLoader workers block (here: in a sleep, as a reader blocked on a dead
# connection would), killed with SIGKILL. The test then waits 3 s (more than the nested orphan
# grace of 1 s) and kills the workers itself, so at session end nothing runs any more.
KILLED_TRAINER = '''
import os, signal, subprocess, sys, time
from tests.support.procs import descendants, wait_gone

TRAINER = """
import time, torch
from torch.utils.data import DataLoader, IterableDataset
from loader.workers import worker_init

class Stuck(IterableDataset):
    def __iter__(self):
        yield torch.zeros(1)
        time.sleep(300)

kwargs = {"worker_init_fn": worker_init()} if WORKER_INIT else {}
for batch in DataLoader(Stuck(), batch_size=None, num_workers=2, **kwargs):
    print("training", flush=True)
    time.sleep(300)
"""

def test_kills_a_trainer():
    code = TRAINER.replace("WORKER_INIT", os.environ["WORKER_INIT"])
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert trainer.stdout.readline().strip() == "training"
    workers = descendants(trainer.pid)
    assert len(workers) == 2
    time.sleep(1)  # the watcher (polling every 0.2 s) has seen them as the trainer's
    trainer.kill()
    trainer.wait()
    trainer.stdout.close()
    time.sleep(3)
    for pid in wait_gone(workers, 0):
        os.kill(pid, signal.SIGKILL)
    wait_gone(workers, 5)
'''


def _run_nested(tmp_path: Path, body: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_nested.py").write_text(body)
    env = os.environ | {"PYTHONPATH": str(REPO), "PID_TEST_LEAK_GRACE_S": "1", "PID_TEST_ORPHAN_POLL_S": "0.2",
                        "PID_TEST_ORPHAN_GRACE_S": "1",
                        **(env or {})}
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


def test_dataloader_workers_that_outlive_a_killed_trainer_fail_the_run(tmp_path: Path) -> None:
    res = _run_nested(tmp_path, KILLED_TRAINER, env={"WORKER_INIT": "False"})
    assert res.returncode == 1, res.stdout + res.stderr
    assert "1 passed" in res.stdout and "leaked processes" in res.stdout, res.stdout
    # Both workers were gone by the end; they are reported for the time they ran orphaned.
    assert res.stdout.count("after its parent (pid") == 2 and "worker_init_fn" in res.stdout, res.stdout


def test_workers_made_with_worker_init_die_with_the_killed_trainer(tmp_path: Path) -> None:
    res = _run_nested(tmp_path, KILLED_TRAINER, env={"WORKER_INIT": "True"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "leaked processes" not in res.stdout
