"""loader/io/objects.py against a real SeaweedFS and a local folder: every operation, both
outcomes of each conditional put, multipart uploads, and errors that name the URL."""

from __future__ import annotations

import io
import pickle
import uuid
from pathlib import Path

import pytest

from loader.io import urls
from loader.io.errors import (
    BucketNotFoundError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
)
from loader.io.objects import LocalObjects, ObjectStore, S3Objects, open_store
from loader.io.s3_client import S3Settings
from tests.support.seaweedfs import SeaweedS3


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return open_store(tmp_path / "root")
    server: SeaweedS3 = request.getfixturevalue("s3_env")
    bucket = server.make_bucket(f"objects-{uuid.uuid4().hex[:12]}")
    return open_store(f"s3://{bucket}/some/prefix", s3_settings=S3Settings(max_attempts=2))


def test_put_get_head_range(store: ObjectStore) -> None:
    store.put("a/b.bin", b"0123456789", content_type="application/octet-stream")
    assert store.get("a/b.bin") == b"0123456789"
    assert store.get("a/b.bin", max_bytes=3) == b"012"
    assert store.get_range("a/b.bin", 2, 4) == b"2345"
    assert store.get_range("a/b.bin", 8, 10) == b"89"  # short at the end
    info = store.head("a/b.bin")
    assert (info.key, info.size) == ("a/b.bin", 10) and info.etag
    data, etag = store.get_tagged("a/b.bin")
    assert data == b"0123456789" and etag == info.etag
    with store.open("a/b.bin") as fh:
        assert fh.read(4) == b"0123" and fh.read() == b"456789"
    assert store.get("a/b.bin", if_match=info.etag) == b"0123456789"
    assert store.exists("a/b.bin") and not store.exists("a/none")
    assert store.get_or_none("a/none") is None


def test_put_from_a_path_and_a_stream(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"from a file")
    store.put("f", src)
    store.put("g", str(src))
    store.put("s", io.BytesIO(b"from a stream"))
    assert (store.get("f"), store.get("g"), store.get("s")) == (b"from a file", b"from a file", b"from a stream")


def test_replacing_changes_the_etag_and_if_match_reads_refuse(store: ObjectStore) -> None:
    store.put("k", b"one")
    old = store.head("k").etag
    store.put("k", b"two")
    assert store.get("k") == b"two" and store.head("k").etag != old
    with pytest.raises(PreconditionFailedError, match="k"):
        store.get("k", if_match=old)
    with pytest.raises(PreconditionFailedError):
        store.get_range("k", 0, 1, if_match=old)


def test_list_is_sorted_paginated_and_by_string_prefix(store: ObjectStore) -> None:
    keys = [f"d/{i:04d}" for i in range(1005)] + ["d2/x", "e/y", "top"]  # 1005 > one S3 page of 1000
    for k in keys[:5] + keys[-3:]:
        store.put(k, k.encode())
    if isinstance(store, S3Objects):  # the rest cheaply: one client, no checks per put
        for k in keys[5:-3]:
            store.client.put_object(Bucket=store.bucket, Key=store.key(k), Body=k.encode())
    else:
        for k in keys[5:-3]:
            store.put(k, k.encode())
    listed = list(store.list())
    assert [o.key for o in listed] == sorted(keys)
    assert all(o.size == len(o.key) and o.etag for o in listed)
    assert [o.key for o in store.list("d/")] == keys[:1005]
    assert [o.key for o in store.list("d")] == [*keys[:1005], "d2/x"]
    assert [o.key for o in store.list("d/000")] == keys[:10]
    assert list(store.list_prefixes()) == ["d", "d2", "e"]
    assert list(store.list_prefixes("d2/")) == []
    assert store.list_names() == ["d", "d2", "e", "top"] and store.list_names("d2/") == ["x"]
    assert store.list_names("nothing/") == []
    assert list(store.list("nothing/")) == []


def test_put_if_absent_both_outcomes(store: ObjectStore) -> None:
    etag = store.put_if_absent("lease", b"mine")
    assert store.get("lease") == b"mine"
    assert etag is None or etag == store.head("lease").etag
    with pytest.raises(PreconditionFailedError, match="lease"):
        store.put_if_absent("lease", b"theirs")
    assert store.get("lease") == b"mine"


def test_put_if_match_both_outcomes(store: ObjectStore) -> None:
    store.put("ptr", b"v1")
    etag = store.head("ptr").etag
    assert etag is not None
    new = store.put_if_match("ptr", b"v2", etag)
    assert store.get("ptr") == b"v2"
    assert new is None or new == store.head("ptr").etag
    with pytest.raises(PreconditionFailedError, match="ptr"):
        store.put_if_match("ptr", b"v3", etag)  # the old ETag: someone else wrote since
    assert store.get("ptr") == b"v2"
    store.delete("ptr")
    # SeaweedFS answers 412 here, AWS 404: both are a refused condition.
    with pytest.raises(PreconditionFailedError, match="ptr"):
        store.put_if_match("ptr", b"v4", etag)
    assert not store.exists("ptr")


def test_copy_delete_and_delete_many(store: ObjectStore) -> None:
    store.put("v1/a.tar", b"tar bytes")
    store.copy("v1/a.tar", "v2/a.tar")
    assert store.get("v2/a.tar") == b"tar bytes"
    with pytest.raises(ObjectNotFoundError, match="v1/none.tar"):
        store.copy("v1/none.tar", "v2/none.tar")
    store.delete("v1/a.tar")
    store.delete("v1/a.tar")  # absent: no error
    assert not store.exists("v1/a.tar")
    for i in range(3):
        store.put(f"many/{i}", b"x")
    assert store.delete_many(o.key for o in store.list("many/")) == 3
    assert list(store.list("many/")) == []


def test_missing_objects_name_the_url(store: ObjectStore) -> None:
    for call in (lambda: store.get("no/such"), lambda: store.head("no/such"),
                 lambda: store.get_range("no/such", 0, 1), lambda: store.get_tagged("no/such")):
        with pytest.raises(ObjectNotFoundError) as info:
            call()
        assert info.value.url == store.url("no/such") and store.url("no/such") in str(info.value)
        assert isinstance(info.value, FileNotFoundError)


def test_multipart_upload_above_the_threshold(s3_env: SeaweedS3, tmp_path: Path) -> None:
    bucket = s3_env.make_bucket(f"multipart-{uuid.uuid4().hex[:12]}")
    mib = 1 << 20
    store = S3Objects(f"s3://{bucket}/p", multipart_threshold=5 * mib, multipart_chunk=5 * mib)
    data = bytes(range(256)) * (11 * mib // 256 + 1)  # > 2 parts of 5 MiB (S3's smallest part)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    for key, what in (("from-file", path), ("from-stream", io.BytesIO(data)), ("from-bytes", data)):
        store.put(key, what)
        assert store.get(key) == data
        # A multipart object's ETag is "<digest>-<parts>".
        assert store.head(key).etag.strip('"').endswith("-3"), store.head(key).etag
    store.put("small", data[:1000])
    assert "-" not in store.head("small").etag


def test_s3_errors_name_the_url_and_the_fix(s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = S3Objects("s3://objects-no-bucket/x")
    with pytest.raises(BucketNotFoundError, match=r"objects-no-bucket' does not exist at http://127\.0\.0\.1.*create it"):
        missing.check_bucket()
    with pytest.raises(BucketNotFoundError, match=r"listing s3://objects-no-bucket/x"):
        list(missing.list())
    bucket = s3_env.make_bucket(f"objects-err-{uuid.uuid4().hex[:8]}")
    down = S3Objects(f"s3://{bucket}/k", S3Settings(endpoint_url="http://127.0.0.1:1", max_attempts=1))
    with pytest.raises(StorageError, match=rf"reading s3://{bucket}/k/a: cannot connect to S3 at http://127.0.0.1:1"):
        down.get("a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    wrong = S3Objects(f"s3://{bucket}/k", S3Settings(max_attempts=1))
    with pytest.raises(StorageError, match=rf"writing s3://{bucket}/k/a: .*refused the request.*AWS_ACCESS_KEY_ID") as info:
        wrong.put("a", b"x")
    assert "wrong-secret" not in str(info.value)
    assert type(info.value.__cause__).__name__ == "ClientError"
    # A refusal stays a refusal (not retried), a missing bucket is as missing as its objects.
    assert isinstance(info.value, PermissionError)
    with pytest.raises(FileNotFoundError):
        missing.head("k")


def test_an_s3_store_pickles_without_its_client(s3_env: SeaweedS3) -> None:
    bucket = s3_env.make_bucket(f"objects-pk-{uuid.uuid4().hex[:8]}")
    store = S3Objects(f"s3://{bucket}")
    store.put("a", b"1")
    again = pickle.loads(pickle.dumps(store))
    assert again._client is None and again.get("a") == b"1"


def test_local_keys_stay_inside_the_root(tmp_path: Path) -> None:
    store = LocalObjects(tmp_path)
    for bad in ("../x", "/etc/passwd", "a/../../x", "a\\b"):
        with pytest.raises(ValueError, match="bad key"):
            store.put(bad, b"x")
    store.put("a", b"x")
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # no temporary file left behind


def test_open_store_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    assert isinstance(open_store(f"file://{tmp_path}"), LocalObjects)
    assert open_store(f"file://{tmp_path}").root == str(tmp_path)
    with pytest.raises(ValueError, match=r"https://host/x.*s3://bucket/prefix.*https:// is not a place"):
        open_store("https://host/x")
    with pytest.raises(ValueError, match=r"gs://b/x.*gs:// is not a scheme the project reads"):
        open_store("gs://b/x")


@pytest.mark.parametrize(("text", "kind"), [
    ("/data/x", "local"), ("rel/x", "local"), ("file:///data/x", "local"), ("s3://b/k", "s3"),
    ("S3://b/k", "s3"), ("http://h/x", "http"), ("https://h/x", "http"), ("hf://datasets/o/n", "hf"),
])
def test_urls_say_what_a_string_is(text: str, kind: str) -> None:
    assert urls.kind(text) == kind
    assert urls.is_local(text) == (kind == "local") and urls.is_remote(text) == (kind != "local")


def test_a_url_is_never_silently_a_local_path() -> None:
    with pytest.raises(ValueError, match=r"'ftp://h/x'.*ftp:// is not a scheme") as info:
        urls.kind("ftp://user:secret@h/x")
    assert "secret" not in str(info.value)
    with pytest.raises(ValueError, match="is a s3:// URL, not a local path"):
        urls.local_path("s3://b/k")
    assert urls.local_path("file:///a%20b/c") == "/a b/c"
    with pytest.raises(ValueError, match=r"--output-dir 'hf://datasets/o/n': use a local path.*s3://bucket/prefix"):
        urls.kind("hf://datasets/o/n", allowed=("local", "s3"), what="--output-dir")
    assert urls.split_s3("s3://b/a/k?x#y") == ("b", "a/k?x#y")
    assert urls.join("s3://b/p/", "x") == "s3://b/p/x" and urls.join("/a", "x") == "/a/x"
    assert urls.parent("s3://b/p/x") == "s3://b/p" and urls.parent("/a/x") == "/a"


def test_put_returns_the_etag_and_get_tagged_reads_a_head(store: ObjectStore) -> None:
    etag = store.put("t", b"0123456789")
    assert etag == store.head("t").etag
    assert store.get_tagged("t", max_bytes=4) == (b"0123", etag)


def test_conditional_delete_both_outcomes(store: ObjectStore) -> None:
    store.put("lease", b"mine")
    etag = store.head("lease").etag
    store.put("lease", b"theirs")
    with pytest.raises(PreconditionFailedError, match="lease"):
        store.delete("lease", if_match=etag)
    assert store.get("lease") == b"theirs"
    store.delete("lease", if_match=store.head("lease").etag)
    assert not store.exists("lease")
    with pytest.raises(PreconditionFailedError, match="lease"):
        store.delete("lease", if_match=etag)
