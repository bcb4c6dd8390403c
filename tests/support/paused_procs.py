"""Real processes (``pid-shard``, a cleanup) held at named pause points, for race tests.

``procs(argv, folder, pause_at, env)`` starts ``python argv...`` with ``PID_PAUSE_AT`` /
``PID_PAUSE_DIR`` set (``pid_platform/sharding/pause_points.py``), its stdout and stderr in
``folder``; each process dies with the test process and is killed at the fixture's end.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REACH_TIMEOUT_S = 180


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


class Proc:
    """A real process that may be held at pause points in its own folder."""

    def __init__(self, argv: list[str], folder: Path, pause_at: str = "",
                 env: Mapping[str, str] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "PID_PAUSE_AT": pause_at, "PID_PAUSE_DIR": str(folder),
                    "PID_PAUSE_TIMEOUT_S": str(REACH_TIMEOUT_S), **(env or {})}
        self.out, self.err = open(folder / "stdout", "w+"), open(folder / "stderr", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, *argv], env=full_env, stdout=self.out, stderr=self.err,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    def reached(self, point: str) -> bool:
        return (self.folder / f"{point.replace(':', '-')}.reached").exists()

    def wait_reached(self, point: str) -> None:
        deadline = time.monotonic() + REACH_TIMEOUT_S
        while not self.reached(point):
            if self.proc.poll() is not None:
                pytest.fail(f"exited {self.proc.returncode} before pause point {point}: {self.stderr()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"never reached pause point {point}")
            time.sleep(0.05)

    def release(self, point: str) -> None:
        (self.folder / f"{point.replace(':', '-')}.go").write_text("")

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=REACH_TIMEOUT_S)
        finally:
            self.out.close()
            self.err.close()

    def stdout(self) -> str:
        return (self.folder / "stdout").read_text()

    def stderr(self) -> str:
        return (self.folder / "stderr").read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


@pytest.fixture
def procs():
    started: list[Proc] = []

    def start(argv: list[str], folder: Path, pause_at: str = "", env: Mapping[str, str] | None = None) -> Proc:
        p = Proc(argv, folder, pause_at, env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


def pid_shard(*args: str) -> list[str]:
    return ["-m", "pid_platform.cli", *args]
