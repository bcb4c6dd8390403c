"""Starting and stopping the server processes of the Celery test (Redis, PostgreSQL, Celery
workers): each in its own process group, killed by the kernel when the test process dies however
it dies (``PR_SET_PDEATHSIG``, as ``pid_platform/demo/local_s3.py`` does for SeaweedFS), stopped
by its process id (its group: TERM, then KILL), never by name."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from loader.workers import die_with_parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str], log: Path,
          user: str | None = None) -> subprocess.Popen:
    """``cmd`` in its own session, output to ``log``; it dies with this process.

    ``user``: run as that user (setuid happens before ``preexec_fn``, so the parent-death signal,
    which a change of credentials clears, is set after it)."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(cmd), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, user=user, preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )


def started(ready: Callable[[], bool], proc: subprocess.Popen, what: str, log: Path, folder: Path,
            deadline_s: float = 60.0) -> None:
    """``wait_until``, and a server that never became ready is stopped and its ``folder`` removed."""
    try:
        wait_until(ready, proc, what, log, deadline_s)
    except Exception:
        stop(proc)
        shutil.rmtree(folder, ignore_errors=True)
        raise


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, what: str, log: Path,
               deadline_s: float = 60.0) -> None:
    """Poll ``ready`` until it is true; fail with the log's tail if ``proc`` exits or time runs out."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}:\n{tail(log)}")
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready within {deadline_s:.0f} s:\n{tail(log)}")


def tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """TERM ``proc``'s process group, wait, then KILL it (by id)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # What the leader left behind in its group (a worker's pool children) goes too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def kill_group(proc: subprocess.Popen) -> None:
    """``kill -9`` of the whole process (its group: a Celery worker and its pool children at once)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
