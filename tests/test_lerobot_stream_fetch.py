"""Fetching an episode's parquet rows by byte range: ``RangeFetcher`` and ``EpisodeTableReader``.

Over a local folder, ``s3://`` on a real SeaweedFS server, ``http://`` on a real range-capable
HTTP server (also as a STAND-IN for the Hub's ``resolve`` endpoint, for ``hf://``) and through
the fault proxy. Every episode read must equal a full ``pq.read_table`` of its data file
filtered to it. The dataset has no cameras (parquet only) and three data files: LeRobot's layout
(one row group per episode, with statistics), one without statistics, and one with all its
episodes in a single row group.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from loader.io import StreamConfig, StreamError
from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.streaming.ranges import FetchCounters, RangeFetcher, RangeFile
from loader.lerobot.streaming.tabular import (
    EpisodeDataError,
    EpisodeDataMissingError,
    EpisodeTableReader,
)
from tests.support.fault_proxy import drop, stall
from tests.support.lerobot_data import write_v3_dataset
from tests.support.seaweedfs import upload_to_new_bucket

# Three long episodes (a file of ~300 KB: pruning shows in bytes), then two files of short ones.
LENGTHS = (1500, 2000, 2500, 7, 9, 11, 6, 8, 10)
STARTS = np.concatenate([[0], np.cumsum(LENGTHS)]).tolist()
BIG = "data/chunk-000/file-000.parquet"          # LeRobot's layout: a row group per episode
NO_STATS = "data/chunk-000/file-001.parquet"     # a row group per episode, no statistics
ONE_GROUP = "data/chunk-000/file-002.parquet"    # three episodes in one row group
FAST = StreamConfig(max_retries=20, backoff_base_s=0.01, backoff_max_s=0.05, read_timeout_s=0.5,
                    connect_timeout_s=2.0)
FAULTS = [drop(3_000), drop(40_000, rst=False), stall(20_000, 1.5), drop(70_000)]
HF_REPO = "pid-test/arm-tabular"
HF_REV = "89abcdef0123456789abcdef0123456789abcdef"
HF_TOKEN = "hf_standin_token_not_a_secret"


def _episode_rows(table: pa.Table, e: int) -> pa.Table:
    return table.filter(pc.equal(table["episode_index"], e))


def _rewrite(path: Path, write: Callable[[pa.Table, Path], None]) -> None:
    table = pq.read_table(path)
    path.unlink()
    write(table, path)


@pytest.fixture(scope="module")
def tab_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_v3_dataset(tmp_path_factory.mktemp("lerobot-tabular"), cameras=(), episodes_per_file=3,
                            episode_lengths=LENGTHS, data_episodes_per_file=3)

    def without_statistics(table: pa.Table, path: Path) -> None:
        with pq.ParquetWriter(path, table.schema, write_statistics=False) as w:
            for e in (3, 4, 5):
                w.write_table(_episode_rows(table, e))

    _rewrite(root / NO_STATS, without_statistics)
    _rewrite(root / ONE_GROUP, lambda t, p: pq.write_table(t, p, row_group_size=t.num_rows))
    return root


def expected(local_root: Path, e: int) -> pa.Table:
    rel = [BIG, NO_STATS, ONE_GROUP][e // 3]
    return _episode_rows(pq.read_table(local_root / rel), e)


def assert_every_episode(root: str, local_root: Path, fetcher: RangeFetcher | None = None,
                         columns: list[str] | None = None) -> EpisodeTableReader:
    meta = LeRobotMeta.load(root, config=fetcher.config if fetcher else None)
    reader = EpisodeTableReader(meta, fetcher or RangeFetcher(), columns=columns)
    for e in meta.episode_indices.tolist():
        got = reader.read(meta.episode(e))
        want = expected(local_root, e)
        want = want.select(columns) if columns is not None else want
        assert got.num_rows == LENGTHS[e]
        assert got.equals(want), f"episode {e}"
    return reader


def row_group_span(path: Path, i: int) -> tuple[int, int]:
    """[first, last) byte of row group ``i``'s column chunks."""
    rg = pq.read_metadata(path).row_group(i)
    starts, ends = [], []
    for j in range(rg.num_columns):
        col = rg.column(j)
        start = col.dictionary_page_offset or col.data_page_offset
        starts.append(start)
        ends.append(start + col.total_compressed_size)
    return min(starts), max(ends)


def get_ranges(server, rel: str) -> list[tuple[int, int]]:
    """[a, b) of every ranged GET of ``rel`` the server answered."""
    out = []
    for r in server.gets(rel):
        a, b = r.range.removeprefix("bytes=").split("-")
        out.append((int(a), int(b) + 1))
    return out


# -- the fixture itself ------------------------------------------------------------------------------

def test_fixture_has_the_three_layouts(tab_root: Path) -> None:
    big, no_stats, one = (pq.read_metadata(tab_root / rel) for rel in (BIG, NO_STATS, ONE_GROUP))
    ep_col = big.schema.names.index("episode_index")
    assert big.num_rows == sum(LENGTHS[:3]) and big.num_row_groups == 3
    assert [big.row_group(i).column(ep_col).statistics.min for i in range(3)] == [0, 1, 2]
    assert no_stats.num_row_groups == 3
    assert all(no_stats.row_group(i).column(ep_col).statistics is None for i in range(3))
    assert one.num_row_groups == 1 and one.num_rows == sum(LENGTHS[6:])
    assert (tab_root / BIG).stat().st_size > 250_000


# -- roots ---------------------------------------------------------------------------------------

def test_local_root_reads_every_episode(tab_root: Path) -> None:
    counters = FetchCounters()
    assert_every_episode(str(tab_root), tab_root, RangeFetcher(counters=counters))
    assert counters.requests > 0 and counters.bytes_fetched > 0 and counters.retries == 0
    assert_every_episode(tab_root.as_uri(), tab_root)  # file://


def test_chosen_columns_only(tab_root: Path) -> None:
    assert_every_episode(str(tab_root), tab_root, columns=["action", "observation.state"])
    assert_every_episode(str(tab_root), tab_root, columns=["index", "timestamp"])
    meta = LeRobotMeta.load(str(tab_root))
    reader = EpisodeTableReader(meta, RangeFetcher(), columns=["action", "observation.velocity"])
    with pytest.raises(EpisodeDataError, match=r"file-000\.parquet: episode 1: .*'observation\.velocity'"):
        reader.read(meta.episode(1))
    with pytest.raises(ValueError, match="more than once"):
        EpisodeTableReader(meta, RangeFetcher(), columns=["action", "action"])


@pytest.fixture(scope="module")
def s3_tab_root(seaweedfs, tab_root: Path) -> str:
    return upload_to_new_bucket(seaweedfs, tab_root, "lerobot-tabular", "arm")


def test_s3_root_reads_every_episode(s3_env, s3_tab_root: str, tab_root: Path) -> None:
    counters = FetchCounters()
    assert_every_episode(s3_tab_root, tab_root, RangeFetcher(counters=counters))
    assert counters.requests > 0 and counters.retries == 0


def test_http_root_reads_every_episode(tab_root: Path, http_server) -> None:
    server = http_server(tab_root)
    assert_every_episode(server.url + "/", tab_root)
    assert_every_episode(server.url + "/", tab_root, RangeFetcher(http_subranges=3, min_subrange=4096,
                                                                  http_connections=2))
    assert all(r.range for r in server.gets() if r.path.startswith("data/"))


def test_faults_change_nothing_over_http(tab_root: Path, http_server, fault_proxy) -> None:
    server = http_server(tab_root)
    proxy = fault_proxy(server.url, FAULTS * 2)
    meta = LeRobotMeta.load(proxy.url + "/", config=FAST)
    counters = FetchCounters()
    reader = EpisodeTableReader(meta, RangeFetcher(config=FAST, counters=counters, http_subranges=2,
                                                   min_subrange=16_384))
    server.fail_gets = 3   # and 503s
    for e in meta.episode_indices.tolist():
        assert reader.read(meta.episode(e)).equals(expected(tab_root, e)), f"episode {e}"
    assert proxy.fired and counters.retries >= 3
    assert sum(r.status == 503 for r in server.requests) == 3


def test_faults_change_nothing_over_s3(s3_env, s3_tab_root: str, tab_root: Path, fault_proxy,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    meta = LeRobotMeta.load(s3_tab_root, config=FAST)
    counters = FetchCounters()
    reader = EpisodeTableReader(meta, RangeFetcher(config=FAST, counters=counters))
    # Footers (and sizes: a HEAD, which botocore does not retry here) are fetched directly ...
    for e in (0, 3, 6):
        reader.read(meta.episode(e))
    # ... then every row group goes through drops and stalls.
    proxy = fault_proxy(s3_env.endpoint_url, FAULTS * 2)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    for e in meta.episode_indices.tolist():
        assert reader.read(meta.episode(e)).equals(expected(tab_root, e)), f"episode {e}"
    assert proxy.fired and counters.retries > 0


@pytest.fixture
def hub_tree(tmp_path: Path, tab_root: Path) -> Path:
    """``<tree>/datasets/<repo>/resolve/<rev>/...``: what the Hub's resolve endpoint serves."""
    shutil.copytree(tab_root, tmp_path / "hub" / "datasets" / HF_REPO / "resolve" / HF_REV)
    return tmp_path / "hub"


def test_hf_root_honours_connections_and_subranges(hub_tree: Path, tab_root: Path, http_server,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    hub = http_server(hub_tree, require_bearer=HF_TOKEN, delay_s=0.02)  # a STAND-IN, not the Hub
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    root = f"hf://datasets/{HF_REPO}@{HF_REV}"
    meta = LeRobotMeta.load(root)
    fetcher = RangeFetcher(http_connections=1, http_subranges=3, min_subrange=16_384)
    reader = EpisodeTableReader(meta, fetcher)
    hub.reset_in_flight()
    before = len(hub.gets())
    threads = [threading.Thread(target=lambda e=e: reader.read(meta.episode(e))) for e in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hub.max_in_flight == 1
    assert len(hub.gets()) - before > 3  # footer + split row groups: several requests, one at a time
    for e in (0, 1, 2, 4, 7):
        assert reader.read(meta.episode(e)).equals(expected(tab_root, e))
    with pytest.raises(FileNotFoundError, match=f"{root}/data/nope.parquet") as exc:
        fetcher.fetch(f"{root}/data/nope.parquet", 0, 10)
    assert HF_TOKEN not in str(exc.value)


# -- pruning and the footer cache ----------------------------------------------------------------

def test_one_episode_reads_its_row_group_and_no_other(tab_root: Path, http_server) -> None:
    server = http_server(tab_root)
    meta = LeRobotMeta.load(server.url + "/")
    counters = FetchCounters()
    reader = EpisodeTableReader(meta, RangeFetcher(counters=counters))
    size = (tab_root / BIG).stat().st_size
    assert reader.read(meta.episode(1)).equals(expected(tab_root, 1))
    first = counters.as_dict()
    assert first["bytes_fetched"] < 0.7 * size
    # The footer read (the last 64 KiB) and the group of episode 1; episode 0's bytes never.
    g0, g1 = row_group_span(tab_root / BIG, 0), row_group_span(tab_root / BIG, 1)
    ranges = get_ranges(server, BIG)
    assert all(a >= g0[1] for a, _ in ranges) and any(a <= g1[0] and b >= g1[1] for a, b in ranges)
    heads = [r for r in server.requests if r.method == "HEAD" and r.path == BIG]
    assert len(heads) == 1

    # A second episode of the same file: no HEAD, no footer, one request inside its row group.
    g2 = row_group_span(tab_root / BIG, 2)
    assert reader.read(meta.episode(2)).equals(expected(tab_root, 2))
    assert counters.requests - first["requests"] == 1
    assert get_ranges(server, BIG)[len(ranges):] == [g2]
    assert counters.bytes_fetched - first["bytes_fetched"] == g2[1] - g2[0]
    assert len([r for r in server.requests if r.method == "HEAD" and r.path == BIG]) == 1


def test_local_pruning_counts_bytes_too(tab_root: Path) -> None:
    meta = LeRobotMeta.load(str(tab_root))
    counters = FetchCounters()
    reader = EpisodeTableReader(meta, RangeFetcher(counters=counters), columns=["action"])
    reader.read(meta.episode(0))
    size = (tab_root / BIG).stat().st_size
    assert 0 < counters.bytes_fetched < 0.5 * size
    # Without statistics every group is a candidate: more bytes than the episode's own group.
    counters_ns = FetchCounters()
    EpisodeTableReader(meta, RangeFetcher(counters=counters_ns)).read(meta.episode(4))
    groups = [row_group_span(tab_root / NO_STATS, i) for i in range(3)]
    assert counters_ns.bytes_fetched >= sum(b - a for a, b in groups)


def test_footer_cache_is_an_lru(tab_root: Path) -> None:
    meta = LeRobotMeta.load(str(tab_root))
    counters = FetchCounters()
    reader = EpisodeTableReader(meta, RangeFetcher(counters=counters), footer_cache=1)
    reader.read(meta.episode(3))
    n = counters.requests
    reader.read(meta.episode(4))           # same file: cached
    warm = counters.requests - n
    reader.read(meta.episode(6))           # another file evicts it
    n = counters.requests
    reader.read(meta.episode(5))           # so the first file's footer is fetched again
    assert counters.requests - n == warm + 1
    with pytest.raises(ValueError, match="footer_cache"):
        EpisodeTableReader(meta, RangeFetcher(), footer_cache=0)


def test_concurrent_reads_fetch_each_footer_once(tab_root: Path, http_server) -> None:
    server = http_server(tab_root, delay_s=0.02)
    meta = LeRobotMeta.load(server.url + "/")
    reader = EpisodeTableReader(meta, RangeFetcher(http_subranges=2, min_subrange=16_384))
    errors: list[BaseException] = []
    results: dict[tuple[int, int], pa.Table] = {}

    def work(t: int) -> None:
        try:
            for e in np.random.default_rng(t).permutation(len(LENGTHS)).tolist():
                results[t, e] = reader.read(meta.episode(e))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 4 * len(LENGTHS)
    for (_, e), table in results.items():
        assert table.equals(expected(tab_root, e))
    for rel in (BIG, NO_STATS, ONE_GROUP):
        assert len([r for r in server.requests if r.method == "HEAD" and r.path == rel]) == 1
    assert server.max_in_flight > 1


# -- sub-ranges and connections ----------------------------------------------------------------

def test_subranges_split_a_range_into_parallel_requests(tab_root: Path, http_server) -> None:
    server = http_server(tab_root)
    counters = FetchCounters()
    fetcher = RangeFetcher(http_subranges=3, min_subrange=1024, counters=counters)
    local = (tab_root / BIG).read_bytes()
    assert fetcher.fetch(server.url_for(BIG), 1000, 200_000) == local[1000:201_000]
    assert sorted(get_ranges(server, BIG)) == [(1000, 67_667), (67_667, 134_334), (134_334, 201_000)]
    assert counters.as_dict() == {"bytes_fetched": 200_000, "requests": 3, "retries": 0}
    # A range too short to split is one request; a tail of the file is exact as well.
    assert fetcher.fetch(server.url_for(BIG), 5, 2047) == local[5:2052]
    assert fetcher.fetch(server.url_for(BIG), len(local) - 3001, 3001) == local[-3001:]
    assert counters.requests == 3 + 1 + 2
    # S3 and local ranges are never split.
    assert RangeFetcher(http_subranges=3, min_subrange=1024, counters=counters).fetch(
        str(tab_root / BIG), 1000, 200_000) == local[1000:201_000]
    assert counters.requests == 7


@pytest.mark.parametrize("limit, most", [(1, 1), (2, 2), (None, None)])
def test_connection_limit_caps_requests_in_flight(tab_root: Path, http_server, limit: int | None,
                                                  most: int | None) -> None:
    server = http_server(tab_root, delay_s=0.05)
    fetcher = RangeFetcher(http_connections=limit, http_subranges=4, min_subrange=1024)
    local = (tab_root / BIG).read_bytes()
    spans = [(0, 40_000), (50_000, 60_000), (150_000, 80_000)]
    got: dict[int, bytes] = {}
    threads = [threading.Thread(target=lambda i=i, s=s: got.__setitem__(i, fetcher.fetch(server.url_for(BIG), *s)))
               for i, s in enumerate(spans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(3)] == [local[a:a + n] for a, n in spans]
    assert len(server.gets(BIG)) == 12
    if most is None:  # no limit: the test can see overlap, so the limits above are real
        assert server.max_in_flight > 2
    else:
        assert server.max_in_flight == most
    fetcher.close()


# -- bad data -------------------------------------------------------------------------------------

@pytest.fixture
def small_root(tmp_path: Path) -> Path:
    return write_v3_dataset(tmp_path / "ds", cameras=(), episodes_per_file=3, episode_lengths=(5, 6, 7))


SMALL = "data/chunk-000/file-000.parquet"


def _edit_episode_1(root: Path, edit: Callable[[dict[str, list]], None]) -> pa.Table:
    """Rewrite episode 1's rows (a dict of column lists) in the data file; return the original."""
    path = root / SMALL
    table = pq.read_table(path)
    parts = [_episode_rows(table, e) for e in (0, 1, 2)]
    rows = parts[1].to_pydict()
    edit(rows)
    parts[1] = pa.Table.from_pydict(rows, schema=table.schema)
    with pq.ParquetWriter(path, table.schema) as w:
        for part in parts:
            w.write_table(part)
    return table


def _drop_frame_2(rows: dict[str, list]) -> None:
    for values in rows.values():
        del values[2]


def _duplicate_frame_2(rows: dict[str, list]) -> None:
    for values in rows.values():
        values[3] = values[2]


def _wrong_index(rows: dict[str, list]) -> None:
    rows["index"][4] += 100


@pytest.mark.parametrize("edit, complaint", [
    (_drop_frame_2, r"5 rows where meta/episodes says length 6 \(frame_index \[2\] missing\)"),
    (_duplicate_frame_2, r"6 rows .*frame_index \[3\] missing; frame_index \[2\] duplicated"),
    (_wrong_index, r"frame_index 4 has index 109, expected 9"),
])
def test_bad_rows_are_named(small_root: Path, edit, complaint: str) -> None:
    original = _edit_episode_1(small_root, edit)
    meta = LeRobotMeta.load(str(small_root))
    reader = EpisodeTableReader(meta, RangeFetcher())
    with pytest.raises(EpisodeDataError, match=complaint) as exc:
        reader.read(meta.episode(1))
    message = str(exc.value)
    assert message.startswith(f"{small_root / SMALL}: episode 1: ") and "re-export" in message
    # The other episodes of the file are fine.
    assert reader.read(meta.episode(2)).equals(_episode_rows(original, 2))


def test_rows_out_of_frame_order_are_sorted(small_root: Path) -> None:
    original = _edit_episode_1(small_root, lambda rows: [v.reverse() for v in rows.values()])
    meta = LeRobotMeta.load(str(small_root))
    assert pq.read_table(small_root / SMALL)["frame_index"].to_pylist()[5:11] == [5, 4, 3, 2, 1, 0]
    got = EpisodeTableReader(meta, RangeFetcher()).read(meta.episode(1))
    assert got.equals(_episode_rows(original, 1))


def test_metadata_pointing_at_the_wrong_file(tab_root: Path) -> None:
    meta = LeRobotMeta.load(str(tab_root))
    reader = EpisodeTableReader(meta, RangeFetcher())
    # Statistics rule the file out without reading a row group.
    with pytest.raises(EpisodeDataError, match=r"file-000\.parquet: episode 4: no row group holds it"):
        reader.read(dataclasses.replace(meta.episode(4), data_file=0))
    # Without statistics the groups are read and the rows are not there.
    with pytest.raises(EpisodeDataError, match=r"file-001\.parquet: episode 0: 0 rows where .* length 1500"):
        reader.read(dataclasses.replace(meta.episode(0), data_file=1))
    with pytest.raises(EpisodeDataError, match=r"episode 4: meta/episodes says length 10 but .* \(9 frames\)"):
        reader.read(dataclasses.replace(meta.episode(4), length=10))


def test_missing_and_unreadable_data_files(small_root: Path) -> None:
    meta = LeRobotMeta.load(str(small_root))
    (small_root / SMALL).write_bytes(b"not parquet" * 100)
    with pytest.raises(EpisodeDataError, match=rf"{SMALL}: not a readable parquet file"):
        EpisodeTableReader(meta, RangeFetcher()).read(meta.episode(0))
    (small_root / SMALL).unlink()
    with pytest.raises(EpisodeDataMissingError, match=rf"{SMALL}: not found, but meta/episodes puts episode 2"):
        EpisodeTableReader(meta, RangeFetcher()).read(meta.episode(2))
    assert issubclass(EpisodeDataMissingError, FileNotFoundError)


# -- the fetcher on its own -----------------------------------------------------------------------

def test_fetch_is_exact_or_names_the_url(tab_root: Path, http_server) -> None:
    server = http_server(tab_root)
    local = (tab_root / BIG).read_bytes()
    fetcher = RangeFetcher()
    assert fetcher.fetch(str(tab_root / BIG), 10, 0) == b""
    with pytest.raises(StreamError, match=rf"{tab_root / BIG}: asked for 100 bytes at offset {len(local) - 10}"):
        fetcher.fetch(str(tab_root / BIG), len(local) - 10, 100)
    with pytest.raises(StreamError, match=rf"{server.url_for(BIG)}: asked for 100 bytes"):
        fetcher.fetch(server.url_for(BIG), len(local) - 10, 100)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        fetcher.fetch(str(tab_root / "nope.parquet"), 0, 10)
    with pytest.raises(FileNotFoundError, match=rf"{server.url}/nope.parquet"):
        fetcher.fetch(server.url + "/nope.parquet", 0, 10)
    with pytest.raises(ValueError, match="start and length"):
        fetcher.fetch(str(tab_root / BIG), -1, 10)
    for bad in ({"http_connections": 0}, {"http_subranges": 0}, {"min_subrange": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RangeFetcher(**bad)


def test_counters_and_fetcher_pickle(tab_root: Path) -> None:
    counters = FetchCounters()
    fetcher = RangeFetcher(counters=counters, http_connections=2, http_subranges=3)
    fetcher.fetch(str(tab_root / BIG), 0, 100)
    copy = pickle.loads(pickle.dumps(fetcher))
    assert copy.counters.as_dict() == {"bytes_fetched": 100, "requests": 1, "retries": 0}
    copy.fetch(str(tab_root / BIG), 0, 50)
    assert counters.bytes_fetched == 100 and copy.counters.bytes_fetched == 150
    assert counters.merge(copy.counters.as_dict()).as_dict() == {"bytes_fetched": 250, "requests": 3,
                                                                 "retries": 0}
    assert (copy.http_connections, copy.http_subranges) == (2, 3)


def test_range_file_seeks_and_reads_ahead(tab_root: Path) -> None:
    local = (tab_root / BIG).read_bytes()
    counters = FetchCounters()
    f = RangeFetcher(counters=counters).open_file(str(tab_root / BIG), len(local))
    assert isinstance(f, RangeFile) and f.seekable() and f.readable()
    f.seek(-100, 2)
    assert f.read(40) == local[-100:-60] and f.read(40) == local[-60:-20]
    assert counters.requests == 1 and counters.bytes_fetched == 100  # readahead stops at the end
    f.seek(1000)
    assert f.read(10) == local[1000:1010] and f.read(10) == local[1010:1020] and f.tell() == 1020
    assert counters.requests == 2 and counters.bytes_fetched == 100 + 65_536
    f.seek(200_000)
    assert f.read(70_000) == local[200_000:270_000] and counters.requests == 3
    f.seek(len(local) + 5)
    assert f.read(10) == b""
    f.close()
    with pytest.raises(ValueError):
        f.read(1)


def test_a_small_file_is_one_request_for_all_its_episodes(tab_root: Path, http_server) -> None:
    # ONE_GROUP is a few KiB: the footer read fetches all of it, and every episode of the file is
    # then read from those bytes (no second request for the row group).
    server = http_server(tab_root)
    meta = LeRobotMeta.load(server.url + "/")
    counters = FetchCounters()
    reader = EpisodeTableReader(meta, RangeFetcher(counters=counters))
    size = (tab_root / ONE_GROUP).stat().st_size
    assert size < 64 * 1024
    for e in (6, 7, 8):
        assert reader.read(meta.episode(e)).equals(expected(tab_root, e))
    assert get_ranges(server, ONE_GROUP) == [(0, size)]
    assert counters.requests == 1 and counters.bytes_fetched == size


def test_a_large_file_fetches_its_footer_once_then_only_the_row_groups(tab_root: Path, http_server) -> None:
    server = http_server(tab_root)
    meta = LeRobotMeta.load(server.url + "/")
    reader = EpisodeTableReader(meta, RangeFetcher())
    size = (tab_root / BIG).stat().st_size
    for e in (0, 1, 2):
        reader.read(meta.episode(e))
    ranges = get_ranges(server, BIG)
    footer = [(a, b) for a, b in ranges if b == size]
    assert footer == [(max(0, size - 64 * 1024), size)]
    groups = [row_group_span(tab_root / BIG, i) for i in range(3)]
    # Every other request is exactly one needed row group outside the fetched tail.
    assert sorted(r for r in ranges if r not in footer) == sorted(g for g in groups if g[0] < footer[0][0])
