"""A real Redis for tests: Debian's ``redis-server`` on 127.0.0.1, a free port, a temp folder, no
persistence; it dies with the test process (``daemons.spawn``). The Celery test's broker and
result store.

Fixture: ``redis_server`` (session) -> :class:`RedisServer` (``url(db)``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.daemons import free_port, spawn, started, stop


@dataclass
class RedisServer:
    port: int
    folder: Path
    log: Path
    process: subprocess.Popen

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"


def _pong(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith(b"+PONG")


def start_redis(binary: str) -> RedisServer:
    folder = Path(tempfile.mkdtemp(prefix="pid-redis-"))
    port = free_port()
    log = folder / "redis.log"
    proc = spawn([binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder), "--save", "",
                  "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes"],
                 cwd=folder, env={"PATH": "/usr/bin:/bin"}, log=log)
    server = RedisServer(port, folder, log, proc)
    started(lambda: _pong(port), proc, "redis-server", log, folder, deadline_s=30)
    return server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("Debian's redis-server is not installed (./dev test installs it when run as root)")
    server = start_redis(binary)
    try:
        yield server
    finally:
        stop(server.process)
        shutil.rmtree(server.folder, ignore_errors=True)
