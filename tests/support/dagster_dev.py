"""``dagster dev`` in a process group of its own, as a test fixture's context manager.

    with DagsterDev(home, env) as dev:       # waits until GET /server_info answers
        dev.graphql(query, variables)
    # stopped: TERM to every process group of its tree, a wait, then KILL; nothing survives

The webserver, the daemon and the code server it starts are its descendants; those that put
themselves in groups of their own are found through /proc (tests/support/process_tree.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.process_tree import descendants, living_members, process_table, wait_until_gone

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DagsterDev:
    def __init__(self, home: Path, env: dict[str, str], log: Path, *, start_timeout_s: float = 90) -> None:
        self.home, self.log, self.port = home, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPO), **env}
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> DagsterDev:
        dagster = Path(sys.executable).parent / "dagster"
        with open(self.log, "wb") as out:
            self._proc = subprocess.Popen(
                [str(dagster), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(self.port)],
                cwd=REPO, env=self._env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"dagster dev exited with {self._proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/server_info", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"dagster dev did not answer {self.url}/server_info in {self._start_timeout_s:.0f} s; "
                           f"see {self.log}")

    def graphql(self, query: str, variables: dict | None = None) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(f"{self.url}/graphql", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        if answer.get("errors"):
            raise RuntimeError(f"GraphQL errors: {answer['errors']}")
        return answer["data"]

    def stop(self, grace_s: float = 20) -> list[int]:
        """TERM every process group of the tree, wait up to ``grace_s``, KILL what is left; the
        processes still alive after that (empty when all are gone)."""
        if self._proc is None:
            return []
        table = process_table()
        groups = {self._proc.pid} | {table[p][1] for p in descendants(self._proc.pid, table) if p in table}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for group in groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, sig)
            if sig == signal.SIGTERM:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=grace_s)
                if not wait_until_gone(groups, 5):
                    break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        self._proc = None
        return living_members(groups) if wait_until_gone(groups, 10) else []
