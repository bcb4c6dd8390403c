"""S3SourceStore against a real SeaweedFS server: listings, bytes, builds, errors."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import pytest

from pid_platform.sharding.errors import BuildError, SourceNotFoundError
from pid_platform.sharding.layout import STATE_DIR
from pid_platform.sharding.pipeline import build_source
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import (
    FileEntry,
    Listing,
    LocalSourceStore,
    S3SourceStore,
    open_source_store,
)
from tests.conftest import SOURCE
from tests.support.seaweedfs import SeaweedS3, upload_tree

BUCKET = "raw-drops"
PREFIX = "drops/2024"
# Two samples per shard: several shards per bucket, so two workers really share the writing.
CONFIG = ShardingConfig(shard_size=2)


@pytest.fixture(scope="session")
def s3_raw_root(seaweedfs: SeaweedS3, photo_drop_template: Path) -> str:
    """The template raw root uploaded once: ``s3://raw-drops/drops/2024`` (read-only use)."""
    client = seaweedfs.client()
    seaweedfs.make_bucket(BUCKET)
    upload_tree(client, photo_drop_template, BUCKET, PREFIX)
    # A folder marker object, as some upload tools write: no file, must not be listed.
    client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{SOURCE}/caption/", Body=b"")
    return f"s3://{BUCKET}/{PREFIX}"


def output_files(out: Path) -> dict[str, bytes]:
    """Every output file by relative path, leaving out the build's own state folder."""
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.relative_to(out).parts[0] != STATE_DIR
    }


def _entries(listing: Listing) -> list[FileEntry]:
    """A listing's files as objects, to read them."""
    d = listing.files.to_pydict()
    return [FileEntry(listing.modality, n, s, fp, listing.folder)
            for n, s, fp in zip(d["name"], d["size"], d["fingerprint"], strict=True)]


def test_listings_match_local(s3_env: SeaweedS3, s3_raw_root: str, photo_drop_template: Path) -> None:
    store = open_source_store(s3_raw_root)
    local = LocalSourceStore(photo_drop_template)
    assert isinstance(store, S3SourceStore)
    assert store.list_sources() == local.list_sources() == [SOURCE]
    assert store.list_modalities(SOURCE) == local.list_modalities(SOURCE) == ["caption", "image", "umt5"]
    for modality in store.list_modalities(SOURCE):
        s3_listing = store.list_files(SOURCE, modality)
        local_listing = local.list_files(SOURCE, modality)
        assert s3_listing.skipped == []
        names = [e.name for e in _entries(s3_listing)]
        assert names == sorted(names) == [e.name for e in _entries(local_listing)]
        for s3_entry, local_entry in zip(_entries(s3_listing), _entries(local_listing), strict=True):
            data = store.read(SOURCE, s3_entry)
            assert data == Path(local_entry.local_path).read_bytes()
            assert s3_entry.size == local_entry.size == len(data)
            assert s3_entry.local_path is None
            # A single-part upload's ETag is the MD5 of its bytes.
            assert s3_entry.fingerprint == f"{len(data)}:{hashlib.md5(data).hexdigest()}"


def test_listing_skips_hidden_and_nested(s3_env: SeaweedS3) -> None:
    client = s3_env.client()
    s3_env.make_bucket("skips")
    for key in ("src/image/a.jpg", "src/image/.DS_Store", "src/image/sub/b.jpg", "src/_tmp/x"):
        client.put_object(Bucket="skips", Key=key, Body=b"x")
    store = S3SourceStore("s3://skips")
    assert store.list_sources() == ["src"]
    assert store.list_modalities("src") == ["image"]
    listing = store.list_files("src", "image")
    assert [e.name for e in _entries(listing)] == ["a.jpg"]
    assert listing.skipped == [("image/.DS_Store", "hidden_file"), ("image/sub/b.jpg", "nested_object")]


@pytest.mark.parametrize("num_workers", [1, 2])
def test_build_from_s3_equals_local_build(
    s3_env: SeaweedS3, s3_raw_root: str, photo_drop_template: Path, tmp_path: Path, num_workers: int
) -> None:
    local = build_source(LocalSourceStore(photo_drop_template), SOURCE, tmp_path / "local", CONFIG)
    remote = build_source(open_source_store(s3_raw_root), SOURCE, tmp_path / "s3", CONFIG,
                          num_workers=num_workers)
    assert remote.samples == local.samples == 32
    assert remote.shards == local.shards > 8
    local_files, s3_files = output_files(tmp_path / "local"), output_files(tmp_path / "s3")
    kinds = {Path(name).suffix for name in s3_files}
    assert {".tar", ".json", ".parquet"} <= kinds, kinds  # tars, wdinfo.json, key indexes
    assert sorted(s3_files) == sorted(local_files)
    for name, data in local_files.items():
        assert s3_files[name] == data, f"{name} differs between the local and the S3 build"


def test_pickled_store_works_without_the_environment(
    s3_env: SeaweedS3, s3_raw_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A forkserver worker sees the environment of when the forkserver started, which may lack the
    # credentials: the pickled store must carry what the parent resolved, and no client.
    store = S3SourceStore(s3_raw_root)
    entry = _entries(store.list_files(SOURCE, "caption"))[0]
    blob = pickle.dumps(store)
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name)
    copy = pickle.loads(blob)
    assert copy._objects is None and copy.settings.credentials is not None
    assert copy.read(SOURCE, entry) == store.read(SOURCE, entry)
    assert s3_env.secret_key not in repr(copy)


def test_missing_source(s3_env: SeaweedS3, s3_raw_root: str) -> None:
    with pytest.raises(SourceNotFoundError, match=r"source 'nope' not found under s3://raw-drops/drops/2024.*\['photos'\]"):
        S3SourceStore(s3_raw_root).list_modalities("nope")


def test_missing_bucket(s3_env: SeaweedS3) -> None:
    with pytest.raises(SourceNotFoundError, match="bucket 'no-such-bucket' does not exist"):
        S3SourceStore("s3://no-such-bucket/x").list_sources()


@pytest.mark.parametrize(
    ("env", "code"),
    [({"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, "SignatureDoesNotMatch"),
     ({"AWS_ACCESS_KEY_ID": "unknown-key"}, "InvalidAccessKeyId")],
)
def test_wrong_credentials(
    s3_env: SeaweedS3, s3_raw_root: str, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], code: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # boto3 raises botocore ClientError (HTTP 403) with this code; the store says what to check.
    with pytest.raises(BuildError, match=rf"refused the request \({code}: .*AWS_ACCESS_KEY_ID") as info:
        S3SourceStore(s3_raw_root).list_sources()
    assert type(info.value.__cause__).__name__ == "ClientError"
    assert s3_env.secret_key not in str(info.value)


def test_wrong_endpoint(s3_env: SeaweedS3, s3_raw_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Port 1 on 127.0.0.1: connection refused at once. One attempt: boto3 retries refusals.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    store = S3SourceStore(s3_raw_root, endpoint_url="http://127.0.0.1:1")
    # boto3 raises botocore EndpointConnectionError ("Could not connect to the endpoint URL").
    with pytest.raises(BuildError, match=r"cannot connect to S3 at http://127.0.0.1:1; check AWS_ENDPOINT_URL") as info:
        store.list_sources()
    assert type(info.value.__cause__).__name__ == "EndpointConnectionError"


def test_object_changed_after_listing(s3_env: SeaweedS3) -> None:
    client = s3_env.client()
    s3_env.make_bucket("changing")
    client.put_object(Bucket="changing", Key="src/caption/a.json", Body=b'{"prompt": "one"}')
    store = S3SourceStore("s3://changing")
    [entry] = _entries(store.list_files("src", "caption"))
    client.put_object(Bucket="changing", Key="src/caption/a.json", Body=b'{"prompt": "two"}')
    with pytest.raises(BuildError, match=r"s3://changing/src/caption/a.json: the object changed since it was listed"):
        store.read("src", entry)
