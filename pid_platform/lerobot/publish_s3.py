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

from loader.io import urls
from loader.io.errors import ObjectNotFoundError, StorageError
from loader.io.objects import S3Objects
from loader.io.s3_client import S3Settings
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
        try:
            bucket = urls.split_s3(self.root)[0]
        except ValueError:
            bucket = ""
        if not bucket or "@" in bucket or "?" in self.root:
            raise PublishRefused(f"not an s3:// dataset root: {self.root!r} (expected s3://bucket/prefix, "
                                 "credentials in the environment)")

    @property
    def bucket(self) -> str:
        return urls.split_s3(self.root)[0]

    @property
    def prefix(self) -> str:
        return urls.split_s3(self.root)[1]

    def key(self, name: str) -> str:
        return "/".join(p for p in (self.prefix, SIDECAR_DIR, name) if p)

    def __str__(self) -> str:
        return self.root.rstrip("/")


def _store(target: S3Target) -> S3Objects:
    # botocore's standard retries: a publish is a handful of whole-object requests.
    return S3Objects(f"s3://{target.bucket}", S3Settings(endpoint_url=target.endpoint_url, max_attempts=5))


@contextmanager
def _errors(target: S3Target, what: str) -> Iterator[None]:
    try:
        yield
    except (StorageError, ObjectNotFoundError) as e:
        raise PublishError(f"{what} in {target}: {e}") from e


def publish_s3(target: S3Target, npz: Path, pointer: bytes, *, revision: str | None, sidecar_name: str,
               pointer_name: str, sha256: str, size: int) -> Published:
    store = _store(target)
    data_key, pointer_key = target.key(sidecar_name), target.key(pointer_name)
    where = {"sidecar_url": f"s3://{target.bucket}/{data_key}", "pointer_url": f"s3://{target.bucket}/{pointer_key}"}
    with _errors(target, f"reading {pointer_key}"):
        old_pointer = store.get_or_none(pointer_key)
    previous = read_pointer(old_pointer, where["pointer_url"]).get("sidecar") if old_pointer else None
    if old_pointer == pointer:
        with _errors(target, f"checking {data_key}"):
            there = store.head(data_key).size
        if there == size:
            return Published(target=str(target), sha256=sha256, size=size, unchanged=True, **where)

    with _errors(target, f"uploading {data_key}"):
        store.put(data_key, npz, content_type="application/octet-stream", metadata={"sha256": sha256})
        uploaded = store.head(data_key).size
    if uploaded != size:
        raise PublishError(f"{where['sidecar_url']}: uploaded {uploaded} bytes, expected {size}; "
                           "the pointer was not changed")
    with _errors(target, f"writing {pointer_key}"):
        store.put(pointer_key, pointer, content_type="application/json")
    with _errors(target, "removing older sidecars"):
        _prune(store, target, revision, keep={sidecar_name, previous})
    return Published(target=str(target), sha256=sha256, size=size, **where)


def _prune(store: S3Objects, target: S3Target, revision: str | None, keep: set[str | None]) -> None:
    prefix = target.key(f"{stem(revision)}.")
    for obj in store.list(prefix):
        name = obj.key.rsplit("/", 1)[-1]
        # Only this stem's content-addressed NPZs: "<stem>.<16 hex>.npz".
        middle = name[len(stem(revision)) + 1:-len(".npz")]
        addressed = len(middle) == 16 and all(c in "0123456789abcdef" for c in middle)
        if name.endswith(".npz") and addressed and name not in keep:
            store.delete(obj.key)
