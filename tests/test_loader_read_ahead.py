"""Twin tars read from a real S3 server (SeaweedFS) through the read-ahead (``loader/io/read_ahead.py``):
the same samples in the same order as one stream per tar, the same exact resume at any worker
count, the same answers to faults, and each byte fetched once for a sequential plan.

Small blocks and a small budget (``SMALL``) make every tar many ranged GETs, several in flight.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from loader.io import ObjectChangedError, StreamConfig, StreamStats
from loader.io.read_ahead import RAMP_PIECES, ReadAhead
from loader.wds.discovery import find_manifests
from loader.wds.errors import EpochEndedEarlyError, ShardReadError
from loader.wds.pipeline import build_dataset, make_loader
from loader.wds.twin_reader import TwinReader
from tests.support.fault_proxy import PASS, drop, stall, unavailable
from tests.support.loader_data import shared_build
from tests.support.seaweedfs import upload_tree

OFF = StreamConfig(read_ahead_bytes=0)
SMALL = StreamConfig(read_ahead_bytes=96 << 10, read_ahead_block=16 << 10, read_ahead_connections=4)
FAST = dict(max_retries=20, backoff_base_s=0.01, backoff_max_s=0.05, read_timeout_s=0.5, connect_timeout_s=2.0)
FAULTS = [drop(3_000), drop(9_000, rst=False), stall(5_000, 1.5), drop(12_000)]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, photo_drop_template: Path) -> Path:
    return shared_build(tmp_path_factory, photo_drop_template, shard_size=8)


def upload(s3_env, built: Path, name: str) -> tuple[str, list[str]]:
    bucket = s3_env.make_bucket(name)
    upload_tree(s3_env.client(), built, bucket, "data")
    return bucket, [f"s3://{bucket}/data/{Path(m).relative_to(built)}" for m in find_manifests(str(built))]


def digest(s: dict) -> tuple[str, int, str]:
    h = hashlib.sha256()
    for k in sorted(k for k in s if not k.startswith("__")):
        h.update(k.encode() + s[k])
    return s["__key__"], s["__sid__"], h.hexdigest()


def batch_keys(b: dict) -> tuple:
    """A batch as its (key, sample id) pairs."""
    return tuple((k, int(sid)) for k, sid in zip(b["__key__"], b["__sid__"].tolist(), strict=True))


def batches_seen(loader) -> list[tuple]:
    return [batch_keys(b) for b in loader]


def _loader(spec, config: StreamConfig, workers: int, **kw):
    ds = build_dataset(spec, decode=None, seed=5, stream_config=config, **{"shuffle_buffer": 4, **kw})
    return make_loader(ds, batch_size=3, num_workers=workers)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["zip", "index"])
def test_order_and_resume_are_the_same_with_read_ahead(built: Path, s3_env, workers: int, mode: str) -> None:
    _, urls = upload(s3_env, built, f"ra-order-{mode}-{workers}")
    local = batches_seen(_loader(str(built), OFF, 0, mode=mode))
    assert batches_seen(_loader(urls, OFF, workers, mode=mode)) == local
    assert batches_seen(_loader(urls, SMALL, workers, mode=mode)) == local
    # Stopped after 4 batches and resumed at another worker count: the rest of the same order.
    loader = _loader(urls, SMALL, workers, mode=mode)
    it, before = iter(loader), []
    for b in it:
        before.append(batch_keys(b))
        if len(before) == 4:
            break
    state = loader.state_dict()
    del it
    restored = _loader(urls, SMALL, 2 - workers, mode=mode)
    restored.load_state_dict(state)
    assert before + batches_seen(restored) == local


def test_samples_bytes_are_identical_and_fetched_once(built: Path, s3_env) -> None:
    """A sequential plan (no shuffle window): every tar byte fetched once, in several ranges at once."""
    _, urls = upload(s3_env, built, "ra-bytes")
    local = [digest(s) for s in build_dataset(str(built), decode=None, seed=1)]
    ds = build_dataset(urls, decode=None, seed=1, stream_config=SMALL)
    assert [digest(s) for s in ds] == local
    st = ds.stats.stream
    tar_bytes = sum(p.stat().st_size for p in built.rglob("*.tar"))
    assert st.bytes_handed > 0.9 * tar_bytes, "the read-ahead was not used"
    assert st.bytes_read <= 1.05 * st.bytes_handed, st
    assert st.bytes_read <= 1.05 * tar_bytes, st
    assert st.opens >= tar_bytes / SMALL.read_ahead_block, "fewer ranged GETs than blocks"


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_fetch_only_their_members_ranges(built: Path, s3_env, workers: int) -> None:
    """Batches of one shard, read one after another (0 workers) or alternating between workers:
    each byte fetched once; a worker fetches its own members' ranges, not the open-ended rest
    of the tar, and batches planned ahead share the stream of the batch before."""
    _, urls = upload(s3_env, built, f"ra-workers-{workers}")
    loader = _loader(urls, SMALL, workers, shuffle_buffer=0)
    n = sum(len(b) for b in batches_seen(loader))
    assert n == 32
    st = loader.stats["stream"]
    tar_bytes = sum(p.stat().st_size for p in built.rglob("*.tar"))
    assert st["bytes_read"] <= 1.05 * st["bytes_handed"], st
    assert st["bytes_read"] <= 1.05 * tar_bytes, st
    assert st["ahead_dropped"] == 0, st


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["zip", "index"])
def test_drops_stalls_and_truncations_give_the_same_samples(built: Path, s3_env, fault_proxy, mode: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _, urls = upload(s3_env, built, f"ra-faults-{mode}")
    expected = [digest(s) for s in build_dataset(str(built), decode=None, seed=2, shuffle_buffer=4, mode=mode)]
    proxy = fault_proxy(s3_env.endpoint_url, FAULTS * 4)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    config = StreamConfig(**FAST, read_ahead_bytes=SMALL.read_ahead_bytes, read_ahead_block=SMALL.read_ahead_block,
                          read_ahead_connections=SMALL.read_ahead_connections)
    ds = build_dataset(urls, decode=None, seed=2, shuffle_buffer=4, mode=mode, stream_config=config)
    assert [digest(s) for s in ds] == expected
    assert proxy.fired, "no fault fired: the test would prove nothing"
    # No count of our retries against the faults fired: a fault that lands in a response's
    # headers is retried inside botocore (its own retry handler) and never reaches the stream,
    # so the split between the two depends on where each cut falls.


@pytest.mark.timeout(240)
def test_a_full_budget_delays_the_plan_but_never_ends_it(built: Path, s3_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The read-ahead's budget full whenever the planner looks (as when retried ranges still hold
    it): every planned batch is still read, one at a time. The planner used to end the epoch
    when its window emptied while the budget was full: the rest of the plan was never read, and
    nothing said so (test_503s_give_the_same_samples lost its last 3 batches about once in 10)."""
    _, urls = upload(s3_env, built, "ra-full-budget")
    expected = batches_seen(_loader(str(built), OFF, 0))
    monkeypatch.setattr(ReadAhead, "has_room", lambda self: False)
    assert batches_seen(_loader(urls, SMALL, 0)) == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_reader_that_ends_its_plan_early_fails_the_epoch_naming_the_unread_batches(
        built: Path, workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner bug above, made on purpose: each reader drops the last batch of its plan.
    The epoch does not end quietly short (it did, before the loader counted its blocks): it
    raises, naming the batches never read, after handing out every batch that was read."""
    expected = batches_seen(_loader(str(built), OFF, 0))
    plan_ahead = TwinReader.plan_ahead

    def ends_early(self, batches):
        planned = list(batches)
        return plan_ahead(self, iter(planned[:-1]))

    monkeypatch.setattr(TwinReader, "plan_ahead", ends_early)
    seen: list[tuple] = []
    with pytest.raises(EpochEndedEarlyError, match=r"never read \(batches \[") as err:
        for b in _loader(str(built), OFF, workers):
            seen.append(batch_keys(b))
    unread = list(range(len(expected)))[-max(1, workers):]
    assert f"{len(unread)} of the {len(expected)} batches" in str(err.value)
    assert f"batches {unread}" in str(err.value)
    assert seen == [b for k, b in enumerate(expected) if k not in unread]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 2])
def test_503s_give_the_same_samples(built: Path, s3_env, fault_proxy, workers: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 answering 503 Service Unavailable to ranged GETs (and key-index reads) taken ahead:
    each is retried at its range, and the batches are the same, in the same order."""
    _, urls = upload(s3_env, built, f"ra-503-{workers}")
    expected = batches_seen(_loader(str(built), OFF, 0))
    # A range read to its end hands its connection back to the pool, and a kept connection serves
    # many GETs: three 503s (each closes its connection) follow each connection that passes.
    proxy = fault_proxy(s3_env.endpoint_url, [PASS, unavailable(), unavailable(), unavailable()] * 12)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    config = StreamConfig(**FAST, read_ahead_bytes=SMALL.read_ahead_bytes, read_ahead_block=SMALL.read_ahead_block,
                          read_ahead_connections=SMALL.read_ahead_connections)
    loader = _loader(urls, config, workers)
    assert batches_seen(loader) == expected
    assert proxy.fired["unavailable"] >= 8, proxy.fired
    assert loader.stats["stream"]["retries"] >= 1, "no 503 reached the read-ahead's ranged GETs"


def test_a_deleted_tar_fails_fast_naming_it(built: Path, s3_env) -> None:
    bucket, urls = upload(s3_env, built, "ra-deleted")
    tar = sorted(p for p in built.rglob("*.tar") if "/caption/" in p.as_posix())[0]
    key = f"data/{tar.relative_to(built).as_posix()}"
    s3_env.client().delete_object(Bucket=bucket, Key=key)
    slow = StreamConfig(max_retries=8, backoff_base_s=1.0, read_ahead_block=SMALL.read_ahead_block)
    t0 = time.monotonic()
    with pytest.raises(ShardReadError, match="tar not found") as err:
        list(build_dataset(urls, decode=None, shuffle=False, stream_config=slow))
    assert f"s3://{bucket}/{key}" in str(err.value)
    assert time.monotonic() - t0 < 5, "a missing tar was retried"


def test_a_replaced_object_fails_between_ranges(s3_env) -> None:
    """Every range after the first is pinned to the ETag the first saw."""
    bucket = s3_env.make_bucket("ra-etag")
    client = s3_env.client()
    client.put_object(Bucket=bucket, Key="a.bin", Body=bytes(range(256)) * 64)
    # No budget: nothing is fetched ahead, each read asks for its own range when it needs it.
    ahead = ReadAhead(StreamConfig(read_ahead_bytes=0, read_ahead_block=4096), StreamStats())
    stream = ahead.open(f"s3://{bucket}/a.bin")
    assert stream.read(4096) == (bytes(range(256)) * 16)
    client.put_object(Bucket=bucket, Key="a.bin", Body=b"x" * 16384)
    with pytest.raises(ObjectChangedError, match="changed"):
        stream.read(4096)
    stream.close()
    ahead.close()


def test_a_stream_reads_exact_windows_and_its_limit_bounds_what_is_fetched(s3_env) -> None:
    bucket = s3_env.make_bucket("ra-windows")
    blob = hashlib.sha256(b"seed").digest() * 4000  # 128000 bytes
    s3_env.client().put_object(Bucket=bucket, Key="b.bin", Body=blob)
    stats = StreamStats()
    ahead = ReadAhead(StreamConfig(read_ahead_bytes=40_000, read_ahead_block=10_000, read_ahead_connections=3), stats)
    url = f"s3://{bucket}/b.bin"
    with ahead.open(url, 1234) as s:  # no limit: to the object's end, in odd-sized reads
        parts = []
        while chunk := s.read(7777):
            parts.append(chunk)
    assert b"".join(parts) == blob[1234:]
    with ahead.open(url, 5000, limit=25_000) as s:
        assert s.read(20_000) == blob[5000:25_000]
        time.sleep(0.2)  # nothing past the limit is on its way
    assert stats.bytes_read == len(blob) - 1234 + 20_000 and stats.ahead_dropped == 0, stats
    with ahead.open(url, 0, limit=10) as s:  # read past the limit: served all the same
        assert s.read(50_000) == blob[:50_000]
    ahead.close()


def test_read_to_the_end_after_a_partial_read_hands_out_every_byte(s3_env) -> None:
    """``read()`` with no size, after a read that stopped inside a block, starts at the byte
    reached: the rest of the current block first, then the blocks after it."""
    bucket = s3_env.make_bucket("ra-rest")
    blob = hashlib.sha256(b"rest").digest() * 2000  # 64000 bytes: 7 blocks of 10000
    s3_env.client().put_object(Bucket=bucket, Key="d.bin", Body=blob)
    ahead = ReadAhead(StreamConfig(read_ahead_bytes=40_000, read_ahead_block=10_000, read_ahead_connections=4),
                      StreamStats())
    for first in (5, 10_000, 12_345):
        with ahead.open(f"s3://{bucket}/d.bin", 0, limit=len(blob)) as s:
            assert s.read(first) == blob[:first]
            assert s.read() == blob[first:], first
    ahead.close()


def test_range_buffers_are_the_readers_and_stay_within_the_budget(s3_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each range is read into one buffer allocated on the reader's thread (glibc keeps freed
    memory in the arena of the thread that allocated it: buffers allocated on 32 fetch threads left
    each arena holding its own high-water mark, +50 MB of peak RSS at 0 workers), and the buffers
    alive, the block being handed out included, never exceed read_ahead_bytes."""
    import threading
    import weakref

    import loader.io.read_ahead as read_ahead

    class Tracked(bytearray):  # a bytearray a weak reference can follow
        pass

    live: dict[int, weakref.ref] = {}
    threads: set[str] = set()

    def unfilled(n: int) -> bytearray:
        threads.add(threading.current_thread().name)
        buf = Tracked(n)
        key = id(buf)
        live[key] = weakref.ref(buf, lambda _: live.pop(key, None))
        return buf

    def alive() -> int:
        return sum(len(b) for b in (r() for r in list(live.values())) if b is not None)

    monkeypatch.setattr(read_ahead, "_unfilled", unfilled)
    bucket = s3_env.make_bucket("ra-buffers")
    blob = hashlib.sha256(b"buffers").digest() * 4000  # 128000 bytes: 13 blocks of 10000
    s3_env.client().put_object(Bucket=bucket, Key="e.bin", Body=blob)
    # More connections than ranges the budget holds: no read is queued behind others, so none is
    # fetched on the reader's own thread (which may go past the budget by the block it needs).
    ahead = ReadAhead(StreamConfig(read_ahead_bytes=40_000, read_ahead_block=10_000, read_ahead_connections=8),
                      StreamStats())
    got, most = [], 0
    with ahead.open(f"s3://{bucket}/e.bin", 0, limit=len(blob)) as s:
        while chunk := s.read(3_000):
            got.append(chunk)
            time.sleep(0.002)  # the fetch threads fill the budget meanwhile
            most = max(most, alive())
    ahead.close()
    assert b"".join(got) == blob
    assert threads == {threading.current_thread().name}, threads
    assert 30_000 <= most <= 40_000, most  # the budget was used, and not passed


def test_the_first_block_goes_out_in_pieces_the_rest_whole(s3_env) -> None:
    """A process's first block's worth of read-ahead is asked for as RAMP_PIECES ranges, so the
    bytes read first come before the rest of the budget (instrumented: the first batch's whole
    block shared the link with 15 others and came 0.3-0.4 s after it was asked for); every
    block after is one GET, and each byte is fetched once."""
    bucket = s3_env.make_bucket("ra-ramp")
    blob = hashlib.sha256(b"ramp").digest() * 1250  # 40000 bytes: 4 blocks of 10000
    s3_env.client().put_object(Bucket=bucket, Key="c.bin", Body=blob)
    stats = StreamStats()
    ahead = ReadAhead(StreamConfig(read_ahead_bytes=40_000, read_ahead_block=10_000, read_ahead_connections=4), stats)
    with ahead.open(f"s3://{bucket}/c.bin", 0, limit=len(blob)) as s:
        assert s.read() == blob
    with ahead.open(f"s3://{bucket}/c.bin", 0, limit=len(blob)) as s:  # the same process later: whole blocks
        assert s.read() == blob
    ahead.close()
    assert stats.opens == (RAMP_PIECES + 3) + 4, stats
    assert stats.bytes_read == 2 * len(blob) and stats.ahead_dropped == 0, stats


def test_verify_sha256_and_a_mixture_read_the_same_over_s3(built: Path, s3_env) -> None:
    """``verify="sha256"`` hashes whole tars read through the read-ahead (and still catches a
    changed one); a mixture of two sources reads the same samples from S3 as from disk."""
    from loader.mixture import Mixture, Source
    from loader.wds.errors import ChecksumError

    bucket, urls = upload(s3_env, built, "ra-verify")
    local = [digest(s) for s in build_dataset(str(built), decode=None, seed=4, verify="sha256")]
    assert [digest(s) for s in build_dataset(urls, decode=None, seed=4, verify="sha256", stream_config=SMALL)] == local
    half = len(urls) // 2
    local_m = sorted(find_manifests(str(built)))
    mix = Mixture([Source(local_m[:half], weight=1.0, name="a"), Source(local_m[half:], weight=1.0, name="b")])
    remote = Mixture([Source(sorted(urls)[:half], weight=1.0, name="a"), Source(sorted(urls)[half:], weight=1.0, name="b")])
    want = [(*digest(s), s["__source__"]) for s in build_dataset(mix, decode=None, seed=4)]
    assert [(*digest(s), s["__source__"]) for s in build_dataset(remote, decode=None, seed=4, stream_config=SMALL)] == want
    tar = sorted(built.rglob("*.tar"))[0]
    data = bytearray(tar.read_bytes())
    data[700] ^= 1  # inside the first member's data: a tar that still parses
    s3_env.client().put_object(Bucket=bucket, Key=f"data/{tar.relative_to(built).as_posix()}", Body=bytes(data))
    with pytest.raises(ChecksumError, match="sha256"):
        list(build_dataset(urls, decode=None, seed=4, verify="sha256", stream_config=SMALL))


def test_batches_planned_together_are_fetched_as_few_large_ranges(built: Path, s3_env) -> None:
    """A sequential plan of small batches: the batches planned in one pass share their tars' GETs
    (a GET per batch and tar before: each a request and a time to first byte)."""
    _, urls = upload(s3_env, built, "ra-coalesce")
    roomy = StreamConfig(read_ahead_bytes=8 << 20, read_ahead_block=1 << 20, read_ahead_connections=4)
    loader = _loader(urls, roomy, 0, shuffle_buffer=0)
    batches = batches_seen(loader)
    st = loader.stats["stream"]
    tars = len(list(built.rglob("*.tar")))
    indexes = len(list(built.rglob("*.parquet")))
    assert sum(map(len, batches)) == 32
    # Every tar is smaller than a block: one GET each, plus the key indexes and manifests.
    assert st["opens"] - indexes - len(urls) <= tars + 2, (st, tars, len(batches))
    assert st["bytes_read"] <= 1.05 * st["bytes_handed"], st


@pytest.mark.parametrize("workers", [0, 2])
def test_tars_opened_ahead_are_never_closed_unread(built: Path, s3_env, workers: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """More batches planned than tars may be opened ahead (a small ``PREPARED``): the batches
    past the bound wait for room; closing the oldest to make it dropped the bytes read soonest."""
    import loader.wds.twin_reader as twin_reader

    monkeypatch.setattr(twin_reader, "PREPARED", 2)  # forked workers inherit it
    _, urls = upload(s3_env, built, f"ra-prepared-{workers}")
    roomy = StreamConfig(read_ahead_bytes=8 << 20, read_ahead_block=1 << 20, read_ahead_connections=4)
    loader = _loader(urls, roomy, workers, shuffle_buffer=0)
    assert batches_seen(loader) == batches_seen(_loader(str(built), OFF, 0, shuffle_buffer=0))
    st = loader.stats["stream"]
    assert st["ahead_dropped"] == 0, st
    assert st["bytes_read"] <= 1.05 * st["bytes_handed"], st


def test_a_small_tar_is_one_get_for_every_stream_of_it(built: Path, s3_env) -> None:
    """A small tar (captions) opened by several streams, as the batches of a shard alternate
    between workers: its members fetched in one GET, once, each stream handed its own range."""
    bucket, _ = upload(s3_env, built, "ra-whole")
    tar = next(p for p in sorted(built.rglob("*.tar")) if "caption" in p.parts)
    data = tar.read_bytes()
    url = f"s3://{bucket}/data/{tar.relative_to(built).as_posix()}"
    n = len(data)
    cuts = [0, 1536, n // 2, n]  # header boundaries do not matter to the stream
    stats = StreamStats()
    ahead = ReadAhead(StreamConfig(), stats)
    streams = [ahead.open(url, a, b, whole=n) for a, b in zip(cuts, cuts[1:], strict=False)]
    try:
        got = [s.read(b - a) for s, a, b in zip(streams, cuts, cuts[1:], strict=False)]
    finally:
        for s in streams:
            s.close()
        ahead.close()
    assert b"".join(got) == data
    assert stats.opens == 1 and stats.bytes_read == n == stats.bytes_handed, stats
    assert stats.ahead_dropped == 0, stats


def test_workers_start_with_the_key_indexes_the_training_process_read(built: Path, s3_env) -> None:
    """With workers (forked), the key indexes of the shards the plan reads first are read once,
    in the training process before the fork, not again by every worker; samples unchanged."""
    import loader.wds.twin_reader as twin_reader
    from loader.wds.twin_reader import index_cached

    _, urls = upload(s3_env, built, "ra-fork-indexes")
    loader = _loader(urls, SMALL, 2, shuffle_buffer=0)
    shards = loader.dataset.shards
    _wait_for_index_reads()
    twin_reader._INDEX_CACHE.clear()  # as a dataset too large to have them read with its manifests
    assert batches_seen(loader) == batches_seen(_loader(str(built), OFF, 0, shuffle_buffer=0))
    assert all(index_cached(shards[i], tuple(shards[i].keys)) for i in range(len(shards)))


def test_a_forked_process_starts_with_the_client_made_for_it(s3_env) -> None:
    """The S3 client made for forked workers is theirs: the maker never uses it (its sockets
    would be shared), a forked process takes it and reads with it."""
    import multiprocessing

    from loader.io.s3_client import client_for_fork, s3_client

    bucket = s3_env.make_bucket("ra-fork-client")
    s3_env.client().put_object(Bucket=bucket, Key="x", Body=b"abc")
    config = StreamConfig(read_timeout_s=7.0)  # settings of their own: no other test's client
    spare = client_for_fork(config)
    assert s3_client(config) is not spare

    def child(q) -> None:
        client = s3_client(config)
        q.put((client is spare, client.get_object(Bucket=bucket, Key="x")["Body"].read()))

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    took, body = q.get(timeout=60)
    p.join(60)
    assert took and body == b"abc"


def test_workers_get_a_client_made_for_them_when_every_key_index_was_read_already(built: Path, s3_env) -> None:
    """A small remote dataset has every key index read with its manifests; the fork still gets the
    S3 client made for its workers (before: none was made then, and each worker made its own
    before its first GET)."""
    import os

    from loader.io import s3_client as clients
    from loader.io.s3_client import S3Settings

    _, urls = upload(s3_env, built, "ra-fork-spare")
    config = StreamConfig(read_timeout_s=7.5)  # settings of their own: no other test's spare
    ds = build_dataset(urls, decode=None, seed=5, stream_config=config)
    _wait_for_index_reads()
    ds.before_fork()
    key = (clients._env_key(), clients._settings_key(S3Settings.for_stream(config)))
    assert clients._spares.get(key, (None,))[0] == os.getpid()


def _wait_for_index_reads() -> None:
    import loader.wds.twin_reader as twin_reader

    for _, fut in list(twin_reader._INDEX_PENDING.values()):
        fut.exception()


def test_a_small_datasets_key_indexes_are_read_with_its_manifests(built: Path, s3_env) -> None:
    """A remote dataset of a few shards has every key index asked for as soon as its manifests
    are read (before: when the first batch was planned, or before the fork: one more time to
    first byte before the first batch); the tars' sizes come from the manifests."""
    from loader.wds.twin_reader import _INDEX_PENDING, index_cached

    _, urls = upload(s3_env, built, "ra-indexes-soon")
    ds = build_dataset(urls, decode=None, seed=5, stream_config=SMALL)
    shards = [ds.shards[i] for i in range(len(ds.shards))]
    assert all(index_cached(s, tuple(s.keys)) or (s.key_index, s.sample_count, tuple(s.keys), True) in _INDEX_PENDING
               for s in shards)
    _wait_for_index_reads()
    assert all(index_cached(s, tuple(s.keys)) for s in shards)
    for s in shards:
        assert s.sizes == {m: (built / s.url(m).split("/data/", 1)[1]).stat().st_size for m in s.keys}


def test_a_large_datasets_first_shards_key_indexes_are_read_with_its_manifests(built: Path, s3_env,
                                                                              monkeypatch) -> None:
    """A remote dataset of more shards than the key-index cache holds has the key indexes of the
    shards its plan reads first (as many as the cache holds) asked for with its manifests, and no
    others (before: none, until the first batch or the fork asked); samples unchanged."""
    import loader.wds.twin_reader as twin_reader
    from loader.wds.twin_reader import index_cached

    _, urls = upload(s3_env, built, "ra-indexes-large")
    _wait_for_index_reads()
    twin_reader._INDEX_CACHE.clear()
    monkeypatch.setattr(twin_reader, "_INDEX_CACHE_SIZE", 2)  # this dataset's shards: more than that
    ds = build_dataset(urls, decode=None, seed=5, stream_config=SMALL, shuffle_buffer=0)
    shards = [ds.shards[i] for i in range(len(ds.shards))]
    assert len(shards) > 2
    first: list[int] = []
    for t in (t for pb in ds.shardlist.batches(0, 1) for t in pb.reading()[0]):  # the plan's tasks, in order
        if t.shard_id not in first:
            first.append(t.shard_id)
    _wait_for_index_reads()
    assert [i for i, s in enumerate(shards) if index_cached(s, tuple(s.keys))] == sorted(first[:2])
    assert batches_seen(make_loader(ds, batch_size=3)) == batches_seen(_loader(str(built), OFF, 0, shuffle_buffer=0))


def test_a_shards_first_task_fetches_its_tars_while_its_key_index_comes(built: Path, s3_env,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The key index not read yet: a task from a shard's first member opens its tars at byte 0
    at once (short of their ends, by the manifest's sizes), the index raises their limits when it
    comes; the same samples, every byte fetched once, none dropped."""
    import loader.wds.twin_reader as twin_reader

    _, urls = upload(s3_env, built, "ra-early")
    early = []
    real = twin_reader.TwinReader._open_early

    def counted(self, shard, task, mods, mode):
        early.append(shard.shard_id)
        return real(self, shard, task, mods, mode)

    monkeypatch.setattr(twin_reader.TwinReader, "_open_early", counted)
    monkeypatch.setattr(twin_reader, "_INDEX_CACHE_SIZE", 1)  # too many shards to read them with the manifests
    for mode in ("zip", "index"):
        early.clear()
        loader = _loader(urls, SMALL, 0, shuffle_buffer=0, mode=mode)
        assert batches_seen(loader) == batches_seen(_loader(str(built), OFF, 0, shuffle_buffer=0, mode=mode))
        st = loader.stats["stream"]
        assert early, "no tar was opened before its key index came"
        assert st["ahead_dropped"] == 0, st
        assert st["bytes_read"] <= 1.05 * st["bytes_handed"], st
