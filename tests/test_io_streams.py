"""open_url / RetryingStream against real servers: a range HTTP server, SeaweedFS S3, and the same
HTTP server standing in for the Hub's ``resolve`` endpoint, each behind a fault-injecting TCP proxy.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
import time
from pathlib import Path

import pytest
from webdataset.tariterators import tar_file_iterator

from loader.io import (
    ObjectChangedError,
    RetryBudgetExceeded,
    StreamConfig,
    StreamError,
    StreamStats,
    open_url,
)
from tests.support.fault_proxy import PASS, drop, stall, trickle
from tests.support.seaweedfs import upload_tree

# Fixtures from tests/support (bound here so this module works whether or not conftest lists them).

BLOB_SIZE = 1_000_000
# Small waits keep the file fast; the stall (2 s) is far longer than the read timeout (0.5 s),
# which in turn is far longer than any healthy read on 127.0.0.1.
FAST = StreamConfig(max_retries=6, backoff_base_s=0.01, backoff_max_s=0.05, connect_timeout_s=2.0,
                    read_timeout_s=0.5, seed=7)
STALL_S = 2.0
# Three faults, one per connection: a reset, a clean close and a stall, all mid-body.
FAULTS = [drop(20_000), drop(60_000, rst=False), stall(40_000, STALL_S)]
HF_TOKEN = "hf_standin_token_not_a_secret"
HF_REPO = "datasets/pid-test/photos"


def windows(size: int, n: int = 2, seed: int = 1234) -> list[tuple[int, int | None]]:
    """The whole object, a tail, and seeded windows long enough for all FAULTS to fire."""
    rng = random.Random(seed)
    out: list[tuple[int, int | None]] = [(0, None), (size - 200_000, None)]
    for _ in range(n):
        length = rng.randrange(200_000, 400_000)
        out.append((rng.randrange(0, size - length), length))
    return out


def expected(data: bytes, start: int, length: int | None) -> bytes:
    return data[start:] if length is None else data[start:start + length]


def assert_recovered(stats: StreamStats, faults: int) -> None:
    """Each injected fault cost one retry. A busy CI machine may add a spurious read timeout
    (0.5 s) on top, so this is a lower bound; the bytes themselves are always checked exactly."""
    assert faults <= stats.retries <= faults + 2
    assert stats.opens == 1 + stats.retries + stats.reconnects


def photo_tar() -> bytes:
    """A real WebDataset tar: four photographs as JPEG plus a JSON caption each."""
    from pid_platform.demo.sample_data import load_photo

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in ("astronaut", "chelsea", "coffee", "rocket"):
            jpg = io.BytesIO()
            load_photo(name).save(jpg, "JPEG", quality=90)
            for member, payload in ((f"{name}.jpg", jpg.getvalue()),
                                    (f"{name}.json", json.dumps({"prompt": name}).encode())):
                info = tarfile.TarInfo(member)
                info.size, info.mtime, info.mode = len(payload), 0, 0o644
                tar.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Files to serve; also laid out under the Hub stand-in's ``resolve`` paths."""
    root = tmp_path_factory.mktemp("io-corpus")
    blob = random.Random(42).randbytes(BLOB_SIZE)
    tar = photo_tar()
    for rel in ("", f"{HF_REPO}/resolve/main/", f"{HF_REPO}/resolve/refs/pr/1/"):
        folder = root / rel
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "blob.bin").write_bytes(blob)
        (folder / "photos.tar").write_bytes(tar)
    (root / "secret.bin").write_bytes(b"top secret")
    (root / "empty.bin").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def blob(corpus: Path) -> bytes:
    return (corpus / "blob.bin").read_bytes()


@pytest.fixture(scope="module")
def s3_bucket(seaweedfs, corpus: Path) -> str:
    bucket = seaweedfs.make_bucket("io-streams")
    client = seaweedfs.client()
    for name in ("blob.bin", "photos.tar", "empty.bin"):
        client.put_object(Bucket=bucket, Key=f"data/{name}", Body=(corpus / name).read_bytes())
    return bucket


def read_all(url: str, start: int = 0, length: int | None = None, config: StreamConfig = FAST,
             stats: StreamStats | None = None) -> bytes:
    with open_url(url, start=start, length=length, config=config, stats=stats) as f:
        assert f.tell() == start
        chunks = []
        while chunk := f.read(37_111):  # odd size: reads straddle every boundary
            chunks.append(chunk)
        data = b"".join(chunks)
        assert f.tell() == start + len(data)
        assert f.read(10) == b""
    return data


# -- local ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("as_url", [False, True], ids=["path", "file-url"])
def test_local_windows(corpus: Path, blob: bytes, as_url: bool) -> None:
    url = (corpus / "blob.bin").as_uri() if as_url else str(corpus / "blob.bin")
    for start, length in [*windows(BLOB_SIZE), (BLOB_SIZE - 10, 100), (BLOB_SIZE, None), (5, 0)]:
        stats = StreamStats()
        assert read_all(url, start, length, stats=stats) == expected(blob, start, length)
        assert stats.bytes_read == len(expected(blob, start, length))


def test_local_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_url(tmp_path / "nope.tar")


# -- http ----------------------------------------------------------------------------------------

def test_http_windows_through_drops_and_stalls(corpus: Path, blob: bytes, http_server, fault_proxy) -> None:
    server = http_server(corpus)
    for start, length in windows(BLOB_SIZE):
        proxy = fault_proxy(server.url, FAULTS)  # a fresh proxy: no pooled connection skips the plan
        stats = StreamStats()
        assert read_all(f"{proxy.url}/blob.bin", start, length, stats=stats) == expected(blob, start, length)
        assert proxy.fired == {"rst": 1, "fin": 1, "stall": 1}
        assert_recovered(stats, faults=3)
        assert stats.bytes_read == len(expected(blob, start, length))
    # Each reopen asked for exactly the rest of the window, from a later offset.
    last = server.gets("blob.bin")[-4:]
    starts = [int(r.range.split("=")[1].split("-")[0]) for r in last]
    assert starts == sorted(starts) and len(set(starts)) == 4
    assert len({r.range.split("-")[1] for r in last}) == 1


def test_http_stall_longer_than_read_timeout_reconnects(corpus: Path, blob: bytes, http_server,
                                                         fault_proxy) -> None:
    proxy = fault_proxy(http_server(corpus).url, [stall(10_000, 5.0)])
    stats = StreamStats()
    t0 = time.monotonic()
    assert read_all(f"{proxy.url}/blob.bin", stats=stats) == blob
    assert time.monotonic() - t0 < 3.0, "waited for the stall instead of timing out"
    assert proxy.fired == {"stall": 1}
    assert_recovered(stats, faults=1)


def test_http_trickle_below_floor_reconnects(corpus: Path, blob: bytes, http_server, fault_proxy) -> None:
    proxy = fault_proxy(http_server(corpus).url, [trickle(10_000, bps=20_000)])
    config = StreamConfig(**{**FAST.__dict__, "min_throughput_bps": 500_000, "throughput_window_s": 0.3})
    stats = StreamStats()
    t0 = time.monotonic()
    assert read_all(f"{proxy.url}/blob.bin", config=config, stats=stats) == blob
    assert time.monotonic() - t0 < 3.0, "the trickle was waited out"
    # A reconnect is not a failure: it does not spend the retry budget.
    assert stats.reconnects >= 1 and stats.opens == 1 + stats.reconnects + stats.retries


def test_http_retry_budget_exhausted(corpus: Path, http_server, fault_proxy) -> None:
    proxy = fault_proxy(http_server(corpus).url, [drop(5_000)] * 50)
    config = StreamConfig(**{**FAST.__dict__, "max_retries": 3})
    stats = StreamStats()
    url = f"{proxy.url}/blob.bin"
    with pytest.raises(RetryBudgetExceeded) as exc, open_url(url, config=config, stats=stats) as f:
        f.read()
    assert exc.value.url == url and exc.value.retries == 3 and exc.value.offset > 0
    assert url in str(exc.value) and f"offset {exc.value.offset}" in str(exc.value)
    assert stats.retries == 3 and proxy.connections == 4


EMPTY_ANSWERS = 1000   # far more than any budget: the old loop asked again each time, for free


@pytest.mark.parametrize("reader", ["open_url", "lerobot RangeFetcher"])
@pytest.mark.parametrize(("start", "length"), [(0, None), (123_456, 50_000)], ids=["whole", "window"])
def test_http_empty_206_answers_spend_the_retry_budget(corpus: Path, http_server, reader: str, start: int,
                                                       length: int | None) -> None:
    from loader.lerobot.streaming.ranges import RangeFetcher

    server = http_server(corpus)
    server.empty_ranges = EMPTY_ANSWERS
    url = f"{server.url}/blob.bin"
    config = StreamConfig(**{**FAST.__dict__, "max_retries": 2})
    with pytest.raises(RetryBudgetExceeded) as exc:
        if reader == "open_url":
            read_all(url, start, length, config=config)
        else:
            RangeFetcher(config=config).fetch(url, start, length or BLOB_SIZE - start)
    # The first answer and one per retry, then a named error: the URL, the offset, no progress.
    assert len(server.gets("blob.bin")) == 3
    assert exc.value.url == url and exc.value.offset == start and exc.value.retries == 2
    assert url in str(exc.value) and f"offset {start}" in str(exc.value) and "no bytes" in str(exc.value)


def test_http_unreachable_server_spends_budget(http_server, corpus: Path) -> None:
    server = http_server(corpus)
    url = f"{server.url}/blob.bin"
    server.stop()
    config = StreamConfig(**{**FAST.__dict__, "max_retries": 2})
    with pytest.raises(RetryBudgetExceeded, match="blob.bin"):
        open_url(url, config=config)


@pytest.mark.parametrize(("path", "error"), [("missing.bin", FileNotFoundError), ("secret.bin", PermissionError)])
def test_http_404_403_fail_fast(corpus: Path, http_server, path: str, error: type[OSError]) -> None:
    server = http_server(corpus, forbidden={"secret.bin"})
    stats = StreamStats()
    # A retry would sleep at least 2.5 s.
    config = StreamConfig(**{**FAST.__dict__, "backoff_base_s": 5.0, "backoff_max_s": 10.0})
    t0 = time.monotonic()
    with pytest.raises(error, match=path):
        open_url(f"{server.url}/{path}", config=config, stats=stats)
    assert time.monotonic() - t0 < 2.0
    assert (stats.retries, stats.opens) == (0, 1)


def test_http_server_ignoring_range(corpus: Path, blob: bytes, http_server, fault_proxy) -> None:
    server = http_server(corpus, ignore_range=True)
    for start, length in windows(BLOB_SIZE, n=1):
        proxy = fault_proxy(server.url, [drop(300_000)])
        stats = StreamStats()
        assert read_all(f"{proxy.url}/blob.bin", start, length, stats=stats) == expected(blob, start, length)
        assert all(r.status == 200 for r in server.gets())
        if start:
            assert stats.bytes_skipped >= start


def test_http_object_changed_mid_read(tmp_path: Path, http_server, fault_proxy) -> None:
    target = tmp_path / "blob.bin"
    target.write_bytes(random.Random(1).randbytes(300_000))
    proxy = fault_proxy(http_server(tmp_path).url, [drop(150_000)])
    with open_url(f"{proxy.url}/blob.bin", config=FAST) as f:
        f.read(50_000)
        target.write_bytes(random.Random(2).randbytes(300_000))  # same size, new ETag
        with pytest.raises(ObjectChangedError, match="ETag"):
            f.read()


def test_http_edges(corpus: Path, blob: bytes, http_server) -> None:
    server = http_server(corpus)
    assert read_all(f"{server.url}/empty.bin") == b""
    assert read_all(f"{server.url}/blob.bin", start=BLOB_SIZE) == b""
    assert read_all(f"{server.url}/blob.bin", start=BLOB_SIZE - 5, length=100) == blob[-5:]
    assert read_all(f"{server.url}/blob.bin", start=3, length=0) == b""


# -- s3 (SeaweedFS) ------------------------------------------------------------------------------

def s3_config(endpoint: str, **overrides: object) -> StreamConfig:
    return StreamConfig(**{**FAST.__dict__, "s3_endpoint_url": endpoint, **overrides})


def test_s3_windows_through_drops_and_stalls(s3_env, s3_bucket: str, blob: bytes, fault_proxy) -> None:
    url = f"s3://{s3_bucket}/data/blob.bin"
    for start, length in windows(BLOB_SIZE):
        proxy = fault_proxy(s3_env.endpoint_url, FAULTS)
        stats = StreamStats()
        got = read_all(url, start, length, config=s3_config(proxy.url), stats=stats)
        assert got == expected(blob, start, length)
        assert proxy.fired == {"rst": 1, "fin": 1, "stall": 1}
        assert_recovered(stats, faults=3)


def test_s3_endpoint_from_environment(s3_env, s3_bucket: str, blob: bytes) -> None:
    assert read_all(f"s3://{s3_bucket}/data/blob.bin", 1000, 2000) == blob[1000:3000]
    assert read_all(f"s3://{s3_bucket}/data/empty.bin") == b""


def test_s3_trickle_below_floor_reconnects(s3_env, s3_bucket: str, blob: bytes, fault_proxy) -> None:
    proxy = fault_proxy(s3_env.endpoint_url, [trickle(10_000, bps=20_000)])
    config = s3_config(proxy.url, min_throughput_bps=500_000, throughput_window_s=0.3)
    stats = StreamStats()
    assert read_all(f"s3://{s3_bucket}/data/blob.bin", config=config, stats=stats) == blob
    assert stats.reconnects >= 1 and stats.opens == 1 + stats.reconnects + stats.retries


def test_s3_retry_budget_exhausted(s3_env, s3_bucket: str, fault_proxy) -> None:
    proxy = fault_proxy(s3_env.endpoint_url, [drop(5_000)] * 50)
    stats = StreamStats()
    with pytest.raises(RetryBudgetExceeded, match=f"s3://{s3_bucket}/data/blob.bin"), \
            open_url(f"s3://{s3_bucket}/data/blob.bin", config=s3_config(proxy.url, max_retries=2),
                     stats=stats) as f:
        f.read()
    assert stats.retries == 2


def test_s3_404_403_fail_fast(s3_env, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = s3_config(s3_env.endpoint_url, backoff_base_s=5.0, backoff_max_s=10.0)
    stats = StreamStats()
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError, match="data/missing.bin"):
        open_url(f"s3://{s3_bucket}/data/missing.bin", config=config, stats=stats)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(PermissionError, match="data/blob.bin") as exc:
        open_url(f"s3://{s3_bucket}/data/blob.bin", config=config, stats=stats)
    assert "wrong-secret" not in str(exc.value) and s3_env.access_key not in str(exc.value)
    assert time.monotonic() - t0 < 2.0
    assert (stats.retries, stats.opens) == (0, 2)


def test_s3_object_changed_mid_read(s3_env, s3_bucket: str, fault_proxy) -> None:
    client = s3_env.client()
    client.put_object(Bucket=s3_bucket, Key="data/changing.bin", Body=random.Random(1).randbytes(300_000))
    proxy = fault_proxy(s3_env.endpoint_url, [drop(150_000)])
    with open_url(f"s3://{s3_bucket}/data/changing.bin", config=s3_config(proxy.url)) as f:
        f.read(50_000)
        client.put_object(Bucket=s3_bucket, Key="data/changing.bin", Body=random.Random(2).randbytes(300_000))
        with pytest.raises(ObjectChangedError, match="changing.bin"):
            f.read()


def test_s3_ranges_go_out_presigned_and_errors_come_from_the_api(s3_env, s3_bucket: str, blob: bytes) -> None:
    """A ranged GET is a presigned URL over urllib3 (botocore's get_object costs twice the CPU per
    request); the API is asked only when that answer is not bytes, and names the cause."""
    from loader.io.s3_client import s3_client
    from loader.io.source_s3 import S3Source

    config = s3_config(s3_env.endpoint_url)
    api_calls: list[str] = []
    events = s3_client(config).meta.events

    def hook(params, **_) -> None:
        api_calls.append(params["url_path"])

    events.register("before-call.s3.GetObject", hook)
    try:
        assert read_all(f"s3://{s3_bucket}/data/blob.bin", 1000, 5000, config=config) == blob[1000:6000]
        assert api_calls == []
        source = S3Source(s3_bucket, "data/blob.bin", config)
        first = source.open(0, 10, None)
        first.body.read1(100)
        first.body.close()
        opened = source.open(10, 20, first.etag)
        assert opened.body.read1(100) == blob[10:20] and api_calls == []
        opened.body.close()
        with pytest.raises(ObjectChangedError, match="data/blob.bin"):  # the server's 412 to If-Match
            source.open(0, 10, '"0123456789abcdef0123456789abcdef"')
        assert api_calls == []
        with pytest.raises(FileNotFoundError, match="NoSuchKey"):
            S3Source(s3_bucket, "data/missing.bin", config).open(0, 10, None)
        assert len(api_calls) == 1  # the 404 asked again through the API, for its error code
    finally:
        events.unregister("before-call.s3.GetObject", hook)


def test_s3_an_objects_ranges_share_one_presigned_url_for_a_minute(
        s3_env, s3_bucket: str, blob: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A presigned GET URL signs the host, not the Range: the ranges of one object go out on one
    URL signed at the first (botocore's signer is 1.1 ms of CPU, most of a GET's), another object
    gets its own, and a URL older than ``_REUSE_S`` is signed again."""
    import loader.io.source_s3 as source_s3
    from loader.io.s3_client import s3_client

    config = s3_config(s3_env.endpoint_url)
    client = s3_client(config)
    s3_env.client().put_object(Bucket=s3_bucket, Key="data/other.bin", Body=blob[:3000])
    monkeypatch.setattr(source_s3, "_signed", {})
    signed: list[str] = []

    def hook(request, **_) -> None:  # botocore signs each presigned URL (and each API call) here
        signed.append(request.url.split("?")[0].split(f"/{s3_bucket}/", 1)[1])

    client.meta.events.register("before-sign.s3.GetObject", hook)
    try:
        for start in range(0, 50_000, 10_000):
            got = read_all(f"s3://{s3_bucket}/data/blob.bin", start, 10_000, config=config)
            assert got == blob[start:start + 10_000]
        assert read_all(f"s3://{s3_bucket}/data/other.bin", 0, 1000, config=config) == blob[:1000]
        assert signed == ["data/blob.bin", "data/other.bin"]
        monkeypatch.setattr(source_s3, "_REUSE_S", 0.0)
        read_all(f"s3://{s3_bucket}/data/blob.bin", 0, 10, config=config)
        assert signed == ["data/blob.bin", "data/other.bin", "data/blob.bin"]
    finally:
        client.meta.events.unregister("before-sign.s3.GetObject", hook)


def test_s3_a_reused_url_refused_is_signed_anew_not_taken_for_an_unreachable_bucket(
        s3_env, s3_bucket: str, blob: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A URL signed a while ago that the server now refuses (the credentials it was signed with
    revoked: here, its signature spoilt, which SeaweedFS answers with 403) is signed again and the
    range read on the new one: the bucket is not moved to the API for it."""
    import loader.io.source_s3 as source_s3
    from loader.io.s3_client import s3_client

    config = s3_config(s3_env.endpoint_url)
    monkeypatch.setattr(source_s3, "_API_ONLY", set())
    monkeypatch.setattr(source_s3, "_signed", {})
    api_calls: list[str] = []
    events = s3_client(config).meta.events

    def hook(params, **_) -> None:
        api_calls.append(params["url_path"])

    assert read_all(f"s3://{s3_bucket}/data/blob.bin", 0, 100, config=config) == blob[:100]
    [(key, (url, at, through_proxy))] = source_s3._signed.items()
    head, _, sig = url.partition("X-Amz-Signature=")
    source_s3._signed[key] = head + "X-Amz-Signature=" + "0" * 64 + sig[64:], at, through_proxy
    events.register("before-call.s3.GetObject", hook)
    try:
        assert read_all(f"s3://{s3_bucket}/data/blob.bin", 100, 5000, config=config) == blob[100:5100]
    finally:
        events.unregister("before-call.s3.GetObject", hook)
    assert api_calls == [] and not source_s3._API_ONLY
    assert source_s3._signed[key][0] != head + "X-Amz-Signature=" + "0" * 64 + sig[64:]


def test_s3_a_bucket_presigned_gets_cannot_reach_is_read_through_the_api(
        s3_env, s3_bucket: str, blob: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A presigned GET refused where get_object then works (on AWS: a bucket in another region
    than the signature names, which botocore follows and a presigned URL cannot) reads the range
    through the API, and the process reads that bucket through the API from then on. The refusal
    here: a signature made with a wrong secret, which SeaweedFS answers with 403."""
    import loader.io.source_s3 as source_s3
    from loader.io.s3_client import s3_client

    config = s3_config(s3_env.endpoint_url)
    signed = s3_client(config).generate_presigned_url("get_object", Params={"Bucket": s3_bucket, "Key": "k"})
    assert "X-Amz-Signature=" in signed, "presigned in SigV2, which AWS regions opened since 2014 refuse"
    monkeypatch.setattr(source_s3, "_API_ONLY", set())
    monkeypatch.setattr(source_s3, "_signed", {})
    presigned: list[str] = []
    real = source_s3.S3Source._presigned

    def wrongly_signed(self, fresh: bool = False) -> tuple[str | None, bool]:
        url, reused = real(self, fresh)
        presigned.append(url)
        head, _, sig = url.partition("X-Amz-Signature=")
        return head + "X-Amz-Signature=" + ("0" * len(sig[:64])) + sig[64:], reused

    monkeypatch.setattr(source_s3.S3Source, "_presigned", wrongly_signed)
    assert read_all(f"s3://{s3_bucket}/data/blob.bin", 100, 5000, config=config) == blob[100:5100]
    assert len(presigned) == 1
    assert sorted(source_s3._API_ONLY) == [(s3_env.endpoint_url, s3_bucket)]
    assert read_all(f"s3://{s3_bucket}/data/blob.bin", 0, 1000, config=config) == blob[:1000]
    assert len(presigned) == 1  # the API, without a presigned GET first
    with pytest.raises(FileNotFoundError, match="NoSuchKey"):  # a real error is still the API's
        read_all(f"s3://{s3_bucket}/data/missing.bin", config=config)


def test_s3_behind_an_http_proxy_is_read_through_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore sends through HTTP(S)_PROXY and our urllib3 pool does not: an endpoint the
    environment proxies gets no presigned GET: the decision, on the environment alone, for
    HTTPS, HTTP and NO_PROXY (the test after this one reads through a real proxy)."""
    from loader.io.source_s3 import proxied

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    local, aws = "http://127.0.0.1:8333/b/k?X-Amz-Signature=0", "https://b.s3.amazonaws.com/k?X-Amz-Signature=0"
    assert not proxied(local) and not proxied(aws)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    assert proxied(aws) and not proxied(local)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    assert proxied(local)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    assert not proxied(local) and proxied(aws)


def test_s3_behind_a_real_http_proxy_goes_through_it(s3_env, s3_bucket: str, blob: bytes, forward_proxy,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With HTTP_PROXY naming a real forward proxy, every request of a read reaches SeaweedFS
    through it: the ranges are botocore's GetObject (which honours the proxy), not presigned GETs
    over our urllib3 pool, which would go around it."""
    proxy = forward_proxy()
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    config = s3_config(s3_env.endpoint_url)
    assert read_all(f"s3://{s3_bucket}/data/blob.bin", 100, 50_000, config=config) == blob[100:50_100]
    gets = [url for method, url in proxy.requests if method == "GET"]
    assert gets and all(url.startswith(s3_env.endpoint_url) and "X-Amz-Signature" not in url for url in gets), gets


def test_s3_a_proxy_set_after_an_objects_url_was_signed_takes_effect_at_the_next_range(
        s3_env, s3_bucket: str, blob: bytes, forward_proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a presigned URL goes around a proxy is decided once per signature, kept with it
    for its minute of reuse: HTTP_PROXY set after the object's first range (the same process,
    the same object, within the minute) still sends its next range through the proxy, since
    the proxy variables are part of what picks the client, and so the signature."""
    import loader.io.source_s3 as source_s3

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(source_s3, "_signed", {})
    config = s3_config(s3_env.endpoint_url)
    assert read_all(f"s3://{s3_bucket}/data/blob.bin", 0, 1000, config=config) == blob[:1000]
    [(_, (_, _, through_proxy))] = source_s3._signed.items()
    assert through_proxy is False
    proxy = forward_proxy()
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    assert read_all(f"s3://{s3_bucket}/data/blob.bin", 1000, 20_000, config=config) == blob[1000:21_000]
    gets = [url for method, url in proxy.requests if method == "GET"]
    assert gets and all("X-Amz-Signature" not in url for url in gets), gets


# -- hf:// (the local HTTP server is a STAND-IN for the Hub's resolve endpoint) -------------------

def hf_config(endpoint: str, **overrides: object) -> StreamConfig:
    return StreamConfig(**{**FAST.__dict__, "hf_endpoint": endpoint, "hf_token": HF_TOKEN, **overrides})


@pytest.mark.parametrize("revision", ["", "@main", "@refs%2Fpr%2F1"])
def test_hf_standin_windows_through_drops(corpus: Path, blob: bytes, http_server, fault_proxy,
                                          revision: str) -> None:
    hub_standin = http_server(corpus, require_bearer=HF_TOKEN)
    url = f"hf://{HF_REPO}{revision}/blob.bin"
    for start, length in windows(BLOB_SIZE, n=0):
        proxy = fault_proxy(hub_standin.url, FAULTS)
        stats = StreamStats()
        assert read_all(url, start, length, config=hf_config(proxy.url), stats=stats) == expected(blob, start, length)
        assert_recovered(stats, faults=3)
    resolved = "refs/pr/1" if "refs" in revision else "main"
    assert {r.path for r in hub_standin.gets()} == {f"{HF_REPO}/resolve/{resolved}/blob.bin"}


def test_hf_standin_token_from_environment(corpus: Path, blob: bytes, http_server,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    hub_standin = http_server(corpus, require_bearer=HF_TOKEN)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", hub_standin.url)
    assert read_all(f"hf://{HF_REPO}/blob.bin", 10, 20, config=FAST) == blob[10:30]


def test_hf_standin_bad_token_fails_fast_without_leaking(corpus: Path, http_server) -> None:
    hub_standin = http_server(corpus, require_bearer=HF_TOKEN)
    stats = StreamStats()
    bad = "hf_wrong_token_value"
    with pytest.raises(PermissionError, match=f"hf://{HF_REPO}/blob.bin") as exc:
        open_url(f"hf://{HF_REPO}/blob.bin", config=hf_config(hub_standin.url, hf_token=bad), stats=stats)
    assert bad not in str(exc.value) and stats.retries == 0
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        open_url(f"hf://{HF_REPO}/nope.bin", config=hf_config(hub_standin.url))


# -- tar iteration through faults ----------------------------------------------------------------

def members(fileobj) -> list[tuple[str, bytes]]:
    with fileobj:
        return [(s["fname"], s["data"]) for s in tar_file_iterator(fileobj)]


TAR_FAULTS = [drop(30_000), stall(80_000, STALL_S), drop(5_000, rst=False), PASS]


def test_tar_members_identical_through_faulty_http(corpus: Path, http_server, fault_proxy) -> None:
    reference = members(open_url(corpus / "photos.tar"))
    assert [n for n, _ in reference][:2] == ["astronaut.jpg", "astronaut.json"] and len(reference) == 8
    proxy = fault_proxy(http_server(corpus).url, TAR_FAULTS)
    stats = StreamStats()
    assert members(open_url(f"{proxy.url}/photos.tar", config=FAST, stats=stats)) == reference
    assert_recovered(stats, faults=3)
    with open_url(f"{proxy.url}/photos.tar", config=FAST) as f, tarfile.open(fileobj=f, mode="r|") as tar:
        assert [m.name for m in tar] == [n for n, _ in reference]


def test_tar_members_identical_through_faulty_s3(corpus: Path, s3_env, s3_bucket: str, fault_proxy,
                                                 tmp_path: Path) -> None:
    reference = members(open_url(corpus / "photos.tar"))
    proxy = fault_proxy(s3_env.endpoint_url, TAR_FAULTS)
    stats = StreamStats()
    url = f"s3://{s3_bucket}/data/photos.tar"
    assert members(open_url(url, config=s3_config(proxy.url), stats=stats)) == reference
    assert_recovered(stats, faults=3)


def test_built_twin_tars_identical_through_faulty_s3(photo_drop_template: Path, tmp_path: Path, s3_env,
                                                     fault_proxy) -> None:
    """Tars made by the real build, uploaded to S3, read through faults == read from disk."""
    from pid_platform.sharding.pipeline import build_source
    from pid_platform.sharding.plan.shard_plan import ShardingConfig
    from pid_platform.sharding.storage import LocalSourceStore

    out = tmp_path / "out"
    build_source(LocalSourceStore(photo_drop_template), "photos", out, ShardingConfig())
    tars = sorted(out.rglob("*.tar"), key=lambda p: (-p.stat().st_size, str(p)))
    assert len(tars) >= 3, "the build wrote too few tars"
    bucket = s3_env.make_bucket("io-built-tars")
    upload_tree(s3_env.client(), out, bucket, "built")
    for i, path in enumerate(tars[:3]):
        proxy = fault_proxy(s3_env.endpoint_url, [drop(2_000 + 3_000 * i), stall(1_000, STALL_S)])
        url = f"s3://{bucket}/built/{path.relative_to(out).as_posix()}"
        stats = StreamStats()
        assert members(open_url(url, config=s3_config(proxy.url), stats=stats)) == members(open_url(path))
        assert_recovered(stats, faults=2)


def test_bad_urls() -> None:
    with pytest.raises(ValueError, match="unsupported URL scheme"):
        open_url("ftp://example.com/x.tar")
    with pytest.raises(ValueError, match="hf://datasets"):
        open_url("hf://datasets/only-org", config=FAST)
    with pytest.raises(ValueError):
        open_url("s3://bucket-without-key", config=FAST)
    with pytest.raises(ValueError):
        open_url("s3://b/k", start=-1)
    assert issubclass(RetryBudgetExceeded, StreamError) and issubclass(StreamError, OSError)


def test_ranges_read_into_their_buffers_keep_their_connection(corpus: Path, blob: bytes, http_server,
                                                              fault_proxy) -> None:
    """The read-ahead reads a range straight into one buffer (http.client's socket reads land
    there); read to its announced end, the range hands its connection back: five ranges one after
    another go over one connection, and a reset midway reopens at the byte reached."""
    from loader.io.read_ahead import ReadAhead

    proxy = fault_proxy(http_server(corpus).url)
    stats = StreamStats()
    ahead = ReadAhead(FAST, stats)
    url = f"{proxy.url}/blob.bin"
    for start in range(0, 50_000, 10_000):
        data, _, size = ahead.fetch(url, start, 10_000, None)
        assert bytes(data) == blob[start : start + 10_000] and size == len(blob)
    assert proxy.connections == 1 and stats.opens == 5
    proxy.stop()
    proxy = fault_proxy(http_server(corpus).url, [drop(25_000)])
    data, _, _ = ahead.fetch(f"{proxy.url}/blob.bin", 0, 100_000, None)
    assert bytes(data) == blob[:100_000] and proxy.fired == {"rst": 1}
    assert stats.retries == 1 and stats.bytes_read == 50_000 + 100_000, stats
    ahead.close()
