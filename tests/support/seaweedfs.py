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

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest

from pid_platform.demo import local_s3

ACCESS_KEY = "pid-test-access"
SECRET_KEY = "pid-test-secret-0123456789"


def weed_binary() -> str:
    try:
        return local_s3.weed_binary()
    except local_s3.LocalS3Error as e:
        pytest.fail(f"{e} into the test environment", pytrace=False)


@dataclass
class SeaweedS3(local_s3.LocalS3):
    """A running ``weed mini`` (``pid_platform.demo.local_s3``), with helpers for tests."""

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


def raw_and_output_buckets(s3_env: SeaweedS3, drop: Path, monkeypatch: pytest.MonkeyPatch, prefix: str):
    """Buckets ``<prefix>-raw`` (holding ``drop`` under ``drops/``) and ``<prefix>-out``, set as the
    code location's raw and output roots (``PID_RAW_ROOT``, ``PID_OUTPUT_ROOT``); the S3 client."""
    client = s3_env.client()
    s3_env.make_bucket(f"{prefix}-raw")
    s3_env.make_bucket(f"{prefix}-out")
    upload_tree(client, drop, f"{prefix}-raw", "drops")
    monkeypatch.setenv("PID_RAW_ROOT", f"s3://{prefix}-raw/drops")
    monkeypatch.setenv("PID_OUTPUT_ROOT", f"s3://{prefix}-out/built")
    return client


def upload_to_new_bucket(server: SeaweedS3, local_dir: str | os.PathLike[str], bucket: str, prefix: str) -> str:
    """Make ``bucket``, upload ``local_dir`` under ``prefix``; the ``s3://`` URL of that copy."""
    made = server.make_bucket(bucket)
    upload_tree(server.client(), local_dir, made, prefix)
    return f"s3://{made}/{prefix.strip('/')}"


def stop(server: SeaweedS3) -> None:
    local_s3.stop(server)


def start_seaweedfs(attempts: int = 3) -> SeaweedS3:
    """Start ``weed mini`` with the test identity; retry with new ports if one was taken meanwhile."""
    weed_binary()
    try:
        server = local_s3.start(ACCESS_KEY, SECRET_KEY, attempts=attempts)
    except local_s3.LocalS3Error as e:
        raise RuntimeError(str(e)) from None
    return SeaweedS3(**{f.name: getattr(server, f.name) for f in fields(server)})


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
