"""A real PostgreSQL for tests: Debian's ``postgresql`` binaries, a fresh cluster (``initdb``) in a
temp folder, listening on 127.0.0.1 at a free port, dying with the test process
(``daemons.spawn``). PostgreSQL refuses to run as root: as root, the cluster belongs to and runs
as the ``postgres`` user the Debian package creates. Trust authentication, fsync off: a test
cluster, reachable only from this machine.

Fixtures: ``postgres_server`` (session) -> :class:`PostgresServer`; ``dagster_pg_home``
(function) -> a ``DAGSTER_HOME`` whose instance keeps runs, events and schedules in a new
database of that server (dagster-postgres), with this project's pool settings.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
import yaml

from pid_platform.defs.pools import apply_pool_limits
from tests.support.daemons import free_port, spawn, started, stop

PG_USER = "dagster"
PG_PASSWORD = "unused-trust-auth"
# SQLAlchemy 2.1 takes a bare postgresql:// for psycopg 3; dagster-postgres brings psycopg2.
PG_SCHEME = "postgresql+psycopg2"


@dataclass
class PostgresServer:
    port: int
    folder: Path
    log: Path
    process: subprocess.Popen

    def connect(self, db: str = "postgres"):
        import psycopg2

        return psycopg2.connect(host="127.0.0.1", port=self.port, user=PG_USER, password=PG_PASSWORD, dbname=db,
                                connect_timeout=3)

    def create_database(self, name: str) -> str:
        conn = self.connect()
        try:
            conn.autocommit = True  # CREATE DATABASE refuses to run in a transaction
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return name


def pg_bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def start_postgres(bin_dir: Path) -> PostgresServer:
    user = "postgres" if os.geteuid() == 0 else None
    folder = Path(tempfile.mkdtemp(prefix="pid-pg-"))
    data = folder / "data"
    if user is not None:
        shutil.chown(folder, user, user)
    log = folder / "postgres.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": str(folder)}
    init = subprocess.run([str(bin_dir / "initdb"), "-D", str(data), "-U", PG_USER, "--auth=trust", "-E", "UTF8",
                           "--no-sync", "--no-instructions"],
                          cwd=folder, env=env, user=user, capture_output=True, text=True, timeout=120)
    if init.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"initdb failed ({init.returncode}): {init.stdout}\n{init.stderr}")
    port = free_port()
    proc = spawn([str(bin_dir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(folder),
                  "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
                  "-c", "full_page_writes=off", "-c", "max_connections=200"],
                 cwd=folder, env=env, log=log, user=user)
    server = PostgresServer(port, folder, log, proc)
    started(lambda: server.connect().close() is None, proc, "postgres", log, folder)
    return server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    bin_dir = pg_bin_dir()
    if bin_dir is None:
        pytest.skip("Debian's postgresql is not installed (./dev test installs it when run as root)")
    pytest.importorskip("psycopg2", reason="dagster-postgres (the platform extra) brings psycopg2")
    server = start_postgres(bin_dir)
    try:
        yield server
    finally:
        stop(server.process)
        shutil.rmtree(server.folder, ignore_errors=True)


def write_instance_yaml(home: Path, server: PostgresServer, db: str) -> Path:
    """A Dagster instance on ``db``: Postgres storage, no compute-log files (a step's output
    stays in its worker's log, so the workers share no folder with the instance), runs launched
    and executed by the caller, the repository's pool settings."""
    repo_yaml = yaml.safe_load((Path(__file__).resolve().parents[2] / "dagster.yaml").read_text())
    config = {
        "storage": {"postgres": {"postgres_db": {
            "hostname": "127.0.0.1", "port": server.port, "username": PG_USER, "password": PG_PASSWORD,
            "db_name": db, "scheme": PG_SCHEME}}},
        "compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager",
                         "class": "NoOpComputeLogManager"},
        "concurrency": {"pools": repo_yaml["concurrency"]["pools"]},
        "telemetry": {"enabled": False},
    }
    home.mkdir(parents=True, exist_ok=True)
    path = home / "dagster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def dagster_pg_home(postgres_server: PostgresServer, tmp_path: Path) -> Path:
    db = postgres_server.create_database(f"dagster_{uuid.uuid4().hex[:12]}")
    home = tmp_path / "dagster_home"
    write_instance_yaml(home, postgres_server, db)
    # The pool limits a deployment sets at start-up (`python -m pid_platform.defs.pools`, run by
    # ./dev ui): without them every pool has dagster.yaml's default limit of 1, and the write
    # tasks of a build would run one at a time whatever the executor.
    with dg.DagsterInstance.from_config(str(home)) as instance:
        apply_pool_limits(instance)
    return home
