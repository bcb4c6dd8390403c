"""Real Celery workers for the Dagster Celery executor (``dagster_celery.celery_executor``).

Each worker is what ``dagster-celery worker start`` runs (``celery -A dagster_celery.app worker``
with a ``dagster_celery_config`` module holding the executor's settings), one pool process, in its
own empty folder with its own ``HOME``, ``DAGSTER_HOME`` and ``PID_WORK_ROOT``: it shares nothing
with the test process or another worker but the broker (Redis), the Dagster instance's storage
(Postgres; the instance comes with each task) and the bucket. Each worker dies with the test
process (``daemons.spawn``).

Fixture: ``celery_workers`` (function) -> :class:`CeleryWorkers`; ``.start(name, queues, env)``
starts one and waits until it consumes; all are stopped at the end of the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemons import kill_group, spawn, stop, wait_until
from tests.support.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
# Only what a worker needs from this machine's environment: where Python and the tools are.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


def celery_settings(redis: RedisServer, queue: str, *, visibility_timeout_s: int = 3600) -> dict[str, Any]:
    """The Celery executor's settings (``execution: config: celery:``) for ``queue`` on ``redis``;
    the workers are started with the same ones. A step is acknowledged when it ends, so a worker
    killed mid-step leaves it to be delivered again."""
    return {
        "broker": redis.url(0),
        "backend": redis.url(1),
        "config_source": {
            "task_default_queue": queue,
            "task_acks_late": True,
            "task_reject_on_worker_lost": True,
            "broker_transport_options": {"visibility_timeout": visibility_timeout_s},
            "worker_prefetch_multiplier": 1,
        },
    }


def config_module(settings: Mapping[str, Any]) -> str:
    """The ``dagster_celery_config`` module ``dagster-celery worker start -y`` writes for ``settings``."""
    lines = [f"broker_url = {settings['broker']!r}", f"result_backend = {settings['backend']!r}"]
    lines += [f"{k} = {v!r}" for k, v in settings.get("config_source", {}).items()]
    return "\n".join(lines) + "\n"


@dataclass
class CeleryWorker:
    name: str
    folder: Path
    log: Path
    process: subprocess.Popen = field(repr=False)

    @property
    def work_root(self) -> Path:
        return self.folder / "work"

    def kill(self) -> None:
        """``kill -9`` of the worker: its main process and its pool process at once."""
        kill_group(self.process)


class CeleryWorkers:
    def __init__(self, settings: Mapping[str, Any]):
        self.settings = settings
        self.workers: list[CeleryWorker] = []

    def start(self, name: str, queues: Sequence[str], env: Mapping[str, str],
              settings: Mapping[str, Any] | None = None) -> CeleryWorker:
        """A worker consuming ``queues``, with ``env`` (roots, S3 access, pause points) on top of
        its own folders; ``settings``: the executor settings it shares with the runs (default:
        the fixture's)."""
        folder = Path(tempfile.mkdtemp(prefix=f"pid-celery-{name}-"))
        for sub in ("home", "work", "config", "dagster_home"):
            (folder / sub).mkdir()
        (folder / "config" / "dagster_celery_config.py").write_text(config_module(settings or self.settings))
        worker_env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        worker_env.update({
            "HOME": str(folder / "home"),
            "DAGSTER_HOME": str(folder / "dagster_home"),
            "PID_WORK_ROOT": str(folder / "work"),
            "TMPDIR": str(folder / "home"),
            "PYTHONPATH": os.pathsep.join([str(REPO), str(folder / "config")]),
            "PYTHONUNBUFFERED": "1",
            **env,
        })
        log = folder / "worker.log"
        cmd = [sys.executable, "-m", "celery", "-A", "dagster_celery.app", "worker", "--loglevel=INFO",
               "--pool=prefork", "--concurrency=1", "--prefetch-multiplier=1", "-n", f"{name}@%h",
               "--without-gossip", "--without-mingle", "-Q", ",".join(queues)]
        proc = spawn(cmd, cwd=folder / "home", env=worker_env, log=log)
        worker = CeleryWorker(name, folder, log, proc)
        self.workers.append(worker)
        wait_until(lambda: " ready." in log.read_text(errors="replace"), proc, f"celery worker {name}", log,
                   deadline_s=120)
        return worker

    def stop_all(self) -> None:
        for worker in self.workers:
            stop(worker.process)
            shutil.rmtree(worker.folder, ignore_errors=True)


@pytest.fixture
def celery_workers(redis_server: RedisServer) -> Iterator[CeleryWorkers]:
    workers = CeleryWorkers(celery_settings(redis_server, "dagster"))
    try:
        yield workers
    finally:
        workers.stop_all()
