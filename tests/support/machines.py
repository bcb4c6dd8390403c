"""``pid-shard`` as separate machines run it, for the tests of the tasked build (no tests here).

Each call is a real process with its own working folder, ``HOME`` and ``PID_WORK_ROOT`` under
``tmp_path/machines/<name>``: it shares nothing with the others but what the test hands them
(the source, the output folder or bucket).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PID_SHARD = str(Path(sys.executable).parent / "pid-shard")


def pid_shard(tmp_path: Path, machine: str, *args: str, env: dict | None = None, check: bool = True,
              popen: bool = False, timeout: float = 240):
    """Run ``pid-shard args`` as machine ``machine``; the finished process, or the running one (``popen``)."""
    home = tmp_path / "machines" / machine
    home.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "HOME": str(home), "PID_WORK_ROOT": str(home / "work"), **(env or {})}
    cmd = [PID_SHARD, *args]
    if popen:
        return subprocess.Popen(cmd, cwd=home, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    res = subprocess.run(cmd, cwd=home, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert res.returncode == 0, res.stderr
    return res


def write_tasks(tmp_path: Path, n: int, *args: str, timeout: float = 240) -> list[str]:
    """Write tasks 0 .. n-1 at once, each as a machine of its own (``task-I``); their outputs."""
    procs = [pid_shard(tmp_path, f"task-{i}", "task", "--index", str(i), "--of", str(n), *args, "--num-workers", "1",
                       popen=True) for i in range(n)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr
        outs.append(stdout)
    return outs


def kill_write_task_half_way(tmp_path: Path, machine: str, *args: str,
                             command: tuple[str, ...] = ("task", "--index", "0", "--of", "2")) -> None:
    """Write task ``0 of 2`` (or what ``command`` runs: ``()``, the one-process build, is write
    task 0 of 1) as machine ``machine``, killed with SIGKILL once its first shard is in place
    (``SHARD_DONE_POINT``) and before the next: a task that died half way."""
    from pid_platform.sharding.tasks.outcomes import SHARD_DONE_POINT

    pause = tmp_path / f"pause-{machine}"
    pause.mkdir()
    env = {"PID_PAUSE_AT": SHARD_DONE_POINT, "PID_PAUSE_DIR": str(pause)}
    proc = pid_shard(tmp_path, machine, *command, *args, "--num-workers", "1", env=env, popen=True)
    reached = pause / f"{SHARD_DONE_POINT.replace(':', '-')}.reached"
    try:
        deadline = time.monotonic() + 120
        while not reached.exists():
            assert proc.poll() is None, f"the task ended before its first shard: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline, "the task never finished a shard"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
