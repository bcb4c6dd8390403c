"""Pure parts of loader.io: URL parsing, counters, config checks, deterministic jitter."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest

from loader.io import (
    HfPath,
    RetryBudgetExceeded,
    StreamConfig,
    StreamStats,
    open_url,
    parse_hf_url,
)
from loader.io.retrying import jitter_rng
from loader.io.source import parse_content_range, redact_url
from loader.io.source_hf import resolve_url


def test_parse_hf_url() -> None:
    assert parse_hf_url("hf://datasets/org/name/a/b.tar") == HfPath("dataset", "org/name", "main", "a/b.tar")
    assert parse_hf_url("hf://datasets/org/name@lerobot-sidecars/meta/x.json").revision == "lerobot-sidecars"
    assert parse_hf_url("hf://datasets/org/name@refs%2Fpr%2F3/f").revision == "refs/pr/3"
    for bad in ("hf://datasets/org", "hf://datasets/org/name", "hf://things/org/name/f", "s3://x/y"):
        with pytest.raises(ValueError):
            parse_hf_url(bad)


def test_resolve_url_quotes_revision_and_path() -> None:
    config = StreamConfig(hf_endpoint="http://hub.invalid/")
    assert resolve_url("hf://datasets/org/name@refs%2Fpr%2F3/a b/c.tar", config) == (
        "http://hub.invalid/datasets/org/name/resolve/refs%2Fpr%2F3/a%20b/c.tar")


def test_token_is_not_in_config_repr() -> None:
    assert "sekrit" not in repr(StreamConfig(hf_token="sekrit"))


def test_redact_url_and_content_range() -> None:
    assert redact_url("https://user:pw@host:1/p/a.tar?X-Amz-Signature=abc") == "https://host:1/p/a.tar?<redacted>"
    assert parse_content_range("bytes 5-9/100") == (5, 10, 100)
    assert parse_content_range("bytes 5-9/*") == (5, 10, None)
    assert parse_content_range(None) is None


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_retries"):
        StreamConfig(max_retries=-1)
    with pytest.raises(ValueError, match="read_timeout_s"):
        StreamConfig(read_timeout_s=0)


def test_jitter_depends_only_on_seed_and_url() -> None:
    def draws(seed: int, url: str) -> list[float]:
        rng = jitter_rng(seed, url)
        return [rng.uniform(0.5, 1.5) for _ in range(5)]

    assert draws(0, "s3://b/k") == draws(0, "s3://b/k")
    assert draws(0, "s3://b/k") != draws(1, "s3://b/k") != draws(0, "s3://b/other")


def test_stats_merge_pickle_and_threads() -> None:
    stats = StreamStats()

    def bump() -> None:
        for _ in range(1000):
            stats.add(bytes_read=3, retries=1)

    threads = [threading.Thread(target=bump) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (stats.bytes_read, stats.retries) == (24_000, 8000)
    copy = pickle.loads(pickle.dumps(stats))
    assert copy.as_dict() == stats.as_dict()
    total = StreamStats().merge(stats).merge(copy.as_dict())
    assert total.as_dict() == {"bytes_read": 48_000, "retries": 16_000, "reconnects": 0, "opens": 0,
                               "bytes_skipped": 0, "bytes_handed": 0, "ahead_dropped": 0, "ahead_waits": 0,
                               "ahead_wait_ms": 0}


def test_budget_error_pickles() -> None:
    err = RetryBudgetExceeded("s3://b/k", 123, 8, TimeoutError("read timed out"))
    back = pickle.loads(pickle.dumps(err))
    assert (back.url, back.offset, back.retries, str(back)) == (err.url, err.offset, err.retries, str(err))


def test_shared_stats_across_threads_over_http(tmp_path: Path, http_server) -> None:
    payload = bytes(range(256)) * 2000
    (tmp_path / "f.bin").write_bytes(payload)
    server = http_server(tmp_path)
    stats = StreamStats()
    results: dict[int, bytes] = {}

    def read(i: int) -> None:
        with open_url(f"{server.url}/f.bin", start=i * 1000, length=50_000, stats=stats) as f:
            results[i] = f.read()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[i] == payload[i * 1000:i * 1000 + 50_000] for i in range(6))
    assert (stats.bytes_read, stats.opens, stats.retries) == (300_000, 6, 0)
