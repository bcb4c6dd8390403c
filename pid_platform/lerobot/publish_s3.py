"""Publish a sidecar under an ``s3://`` dataset root: ``<root>/meta/mp4-sidecars/``.

A bucket has no commits, so the order of writes is the commit point: the NPZ goes up first
under a content-addressed name, is checked (size), and only then is the pointer replaced. A
reader that follows the pointer finds either the previous complete sidecar or the new one, never
half of one. The NPZ the previous pointer named is kept (a reader may have just read that
pointer); older generations of the same stem are deleted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from loader.io.s3_client import S3Settings, s3_client
from loader.lerobot.sidecar.publish_layout import (
    SIDECAR_DIR,
    Published,
    PublishError,
    PublishRefused,
    read_pointer,
    stem,
)


@dataclass(frozen=True)
class S3Target:
    """``s3://bucket[/prefix]``: the dataset root; the endpoint defaults to ``AWS_ENDPOINT_URL(_S3)``."""

    root: str
    endpoint_url: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.root)
        if parts.scheme != "s3" or not parts.netloc or "@" in parts.netloc or parts.query:
            raise PublishRefused(f"not an s3:// dataset root: {self.root!r} (expected s3://bucket/prefix, "
                                 "credentials in the environment)")

    @property
    def bucket(self) -> str:
        return urlsplit(self.root).netloc

    @property
    def prefix(self) -> str:
        return urlsplit(self.root).path.strip("/")

    def key(self, name: str) -> str:
        return "/".join(p for p in (self.prefix, SIDECAR_DIR, name) if p)

    def __str__(self) -> str:
        return self.root.rstrip("/")


def _client(target: S3Target) -> Any:
    # botocore's standard retries: a publish is a handful of whole-object requests.
    return s3_client(S3Settings(endpoint_url=target.endpoint_url, max_attempts=5))


@contextmanager
def _errors(target: S3Target, what: str) -> Iterator[None]:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as e:
        err = e.response.get("Error", {})
        code = err.get("Code", "?")
        hint = {
            "NoSuchBucket": f"bucket {target.bucket!r} does not exist; create it or fix the root",
            "AccessDenied": "this identity may not write there; publishing needs write access",
        }.get(code, err.get("Message", ""))
        raise PublishError(f"{what} in {target}: S3 answered {code}: {hint}") from e
    except BotoCoreError as e:
        raise PublishError(f"{what} in {target}: {e}") from e


def _get(client: Any, target: S3Target, key: str) -> bytes | None:
    from botocore.exceptions import ClientError

    try:
        return client.get_object(Bucket=target.bucket, Key=key)["Body"].read()
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise


def publish_s3(target: S3Target, npz: Path, pointer: bytes, *, revision: str | None, sidecar_name: str,
               pointer_name: str, sha256: str, size: int) -> Published:
    client = _client(target)
    data_key, pointer_key = target.key(sidecar_name), target.key(pointer_name)
    urls = {"sidecar_url": f"s3://{target.bucket}/{data_key}", "pointer_url": f"s3://{target.bucket}/{pointer_key}"}
    with _errors(target, f"reading {pointer_key}"):
        old_pointer = _get(client, target, pointer_key)
    previous = read_pointer(old_pointer, urls["pointer_url"]).get("sidecar") if old_pointer else None
    if old_pointer == pointer:
        with _errors(target, f"checking {data_key}"):
            head = client.head_object(Bucket=target.bucket, Key=data_key)
        if head["ContentLength"] == size:
            return Published(target=str(target), sha256=sha256, size=size, unchanged=True, **urls)

    with _errors(target, f"uploading {data_key}"):
        client.upload_file(str(npz), target.bucket, data_key,
                           ExtraArgs={"ContentType": "application/octet-stream",
                                      "Metadata": {"sha256": sha256}})
        head = client.head_object(Bucket=target.bucket, Key=data_key)
    if head["ContentLength"] != size:
        raise PublishError(f"{urls['sidecar_url']}: uploaded {head['ContentLength']} bytes, expected {size}; "
                           "the pointer was not changed")
    with _errors(target, f"writing {pointer_key}"):
        client.put_object(Bucket=target.bucket, Key=pointer_key, Body=pointer, ContentType="application/json")
    with _errors(target, "removing older sidecars"):
        _prune(client, target, revision, keep={sidecar_name, previous})
    return Published(target=str(target), sha256=sha256, size=size, **urls)


def _prune(client: Any, target: S3Target, revision: str | None, keep: set[str | None]) -> None:
    prefix = target.key(f"{stem(revision)}.")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=target.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            name = obj["Key"].rsplit("/", 1)[-1]
            # Only this stem's content-addressed NPZs: "<stem>.<16 hex>.npz".
            middle = name[len(stem(revision)) + 1:-len(".npz")]
            addressed = len(middle) == 16 and all(c in "0123456789abcdef" for c in middle)
            if name.endswith(".npz") and addressed and name not in keep:
                client.delete_object(Bucket=target.bucket, Key=obj["Key"])
