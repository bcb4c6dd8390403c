"""The loader end to end over real remote storage with injected faults.

Twin tars built from real photographs are uploaded to a real SeaweedFS server (and served by a
real range-capable HTTP server); the loader reads them through a TCP proxy that drops and
stalls connections mid-object. The sample sequence must equal a fault-free local read.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from loader.io import StreamConfig
from loader.wds.discovery import find_manifests
from loader.wds.pipeline import build_dataset
from pid_platform.sharding.pipeline import build_source
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import open_source_store
from tests.support.fault_proxy import drop, stall
from tests.support.seaweedfs import upload_tree

FAST = StreamConfig(max_retries=20, backoff_base_s=0.01, backoff_max_s=0.05, read_timeout_s=0.5,
                    connect_timeout_s=2.0)
# A drop after the first bytes of a tar, a clean close mid-image, a stall longer than the
# read timeout: one of each on the first connections, then the proxy passes traffic through.
FAULTS = [drop(3_000), drop(40_000, rst=False), stall(20_000, 1.5), drop(70_000)]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, photo_drop_template: Path) -> Path:
    out = tmp_path_factory.mktemp("remote-build") / "photos"
    build_source(open_source_store(str(photo_drop_template)), "photos", out, ShardingConfig(shard_size=3))
    return out


def sequence(spec, **kw) -> list[tuple[str, int, str]]:
    """(key, sid, digest of every member) for each sample, in order."""
    ds = build_dataset(spec, decode=None, seed=3, shuffle_buffer=4, **kw)
    out = []
    for s in ds:
        h = hashlib.sha256()
        for k in sorted(k for k in s if not k.startswith("__")):
            h.update(k.encode() + s[k])
        out.append((s["__key__"], s["__sid__"], h.hexdigest()))
    return out


def relative_manifests(out: Path) -> list[str]:
    return [str(Path(m).relative_to(out)) for m in find_manifests(str(out))]


@pytest.mark.parametrize("mode", ["zip", "index"])
def test_s3_with_drops_and_stalls_reads_the_same_samples(built: Path, s3_env, fault_proxy, mode: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3_env.make_bucket(f"loader-remote-{mode}")
    upload_tree(s3_env.client(), built, bucket, "photos")
    expected = sequence(str(built), mode=mode)
    proxy = fault_proxy(s3_env.endpoint_url, FAULTS * 3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    urls = [f"s3://{bucket}/photos/{m}" for m in relative_manifests(built)]
    got = sequence(urls, mode=mode, stream_config=FAST)
    assert got == expected and len(got) == 32
    assert proxy.fired, "no fault fired: the test would prove nothing"


def test_http_with_drops_and_stalls_reads_the_same_samples(built: Path, http_server, fault_proxy) -> None:
    server = http_server(built.parent)
    proxy = fault_proxy(server.url, FAULTS * 3)
    expected = sequence(str(built))
    urls = [f"{proxy.url}/photos/{m}" for m in relative_manifests(built)]
    assert sequence(urls, stream_config=FAST) == expected
    assert proxy.fired
