"""One episode's parquet rows, fetched by byte range and checked: ``EpisodeTableReader``.

A v3 data file holds several episodes (LeRobot writes one row group per episode, but any
grouping is valid). ``read`` fetches the file's footer once (cached per file, LRU), keeps the
row groups whose ``episode_index`` statistics can contain the episode (a group without
statistics stays a candidate, so such files may be read whole), reads only the wanted columns
of those groups (pyarrow coalesces them into few ranged requests), filters to the episode and
checks the rows against ``meta/episodes``: the row count, ``frame_index`` exactly
``0..length-1`` and ``index`` exactly ``dataset_from_index..dataset_to_index-1``.

Rows of a complete episode stored out of frame order are sorted by ``frame_index`` (LeRobot
writes them in order, so this costs one comparison); a missing, duplicated or out-of-range
``frame_index`` is an ``EpisodeDataError``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loader.io import roots as fs
from loader.lerobot.meta import EpisodeInfo, LeRobotMeta

from .ranges import DEFAULT_READAHEAD, RangeFetcher

__all__ = ["CHECK_COLUMNS", "EpisodeDataError", "EpisodeDataMissingError", "EpisodeTableReader"]

CHECK_COLUMNS = ("episode_index", "frame_index", "index")
_FIX = ("the data file and meta/episodes disagree: re-export the dataset with LeRobot (or rewrite "
        "this data file from its source); if the file is right, meta/episodes is stale and must be "
        "regenerated from the data files")
_SHOWN = 8  # values listed in a message before "..."


class EpisodeDataError(ValueError):
    """An episode's rows in its data file are missing, incomplete or inconsistent with
    ``meta/episodes``. The message names the file, the episode, what is wrong and the fix."""


class EpisodeDataMissingError(EpisodeDataError, FileNotFoundError):
    """The data file an episode points at is not under the dataset root."""


@dataclass(frozen=True)
class _Footer:
    """What one data file's footer says, kept so later episodes of the file fetch no footer."""

    url: str
    size: int
    metadata: pq.FileMetaData
    names: tuple[str, ...]                                 # top-level columns, in file order
    episode_bounds: tuple[tuple[int, int] | None, ...]     # per row group; None: no statistics
    tail_start: int = 0      # the file's last bytes, fetched with the footer in one request: row
    tail: bytes = b""        # groups inside them (a small file: all of them) need no request


class EpisodeTableReader:
    """Reads episodes' rows from a dataset's data parquet files through a ``RangeFetcher``.

    ``columns``: the columns ``read`` returns, in that order (None: every column of the file,
    in file order); ``episode_index``, ``frame_index`` and ``index`` are always read for the
    checks. ``footer_cache``: how many files' footers (and sizes) are kept. Thread-safe: a
    footer wanted by several threads at once is fetched once.
    """

    def __init__(self, meta: LeRobotMeta, fetcher: RangeFetcher, *, columns: Sequence[str] | None = None,
                 footer_cache: int = 16):
        if isinstance(footer_cache, bool) or footer_cache < 1:
            raise ValueError(f"footer_cache must be >= 1 file, got {footer_cache!r}")
        if columns is not None:
            if isinstance(columns, str):
                raise TypeError(f"columns must be a sequence of column names, not the string {columns!r}")
            columns = tuple(columns)
            dupes = sorted({c for c in columns if columns.count(c) > 1})
            if dupes:
                raise ValueError(f"columns lists {dupes} more than once")
        self.meta = meta
        self.fetcher = fetcher
        self.columns: tuple[str, ...] | None = columns
        self.footer_cache = int(footer_cache)
        self._footers: OrderedDict[str, Future[_Footer]] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, episode: EpisodeInfo) -> pa.Table:
        """Exactly the rows of ``episode``, in ``frame_index`` order, with the chosen columns."""
        rel = self.meta.data_rel(episode.data_chunk, episode.data_file)
        e = episode.episode_index
        first, stop = episode.dataset_from_index, episode.dataset_to_index
        if stop - first != episode.length:  # before any fetch: the rows could never match both
            raise EpisodeDataError(
                f"{fs.url(self.meta.root, rel)}: episode {e}: meta/episodes says length {episode.length} "
                f"but dataset_from_index..dataset_to_index is {first}..{stop} ({stop - first} frames); "
                "meta/episodes is inconsistent: regenerate it (re-export the dataset with LeRobot)")
        try:
            footer = self._footer(rel)
        except FileNotFoundError:
            raise EpisodeDataMissingError(
                f"{fs.url(self.meta.root, rel)}: not found, but meta/episodes puts episode "
                f"{episode.episode_index} in it; the dataset is incomplete: re-download or re-upload "
                "its data/ folder") from None
        wanted = self.columns if self.columns is not None else footer.names
        missing = [c for c in (*wanted, *CHECK_COLUMNS) if c not in footer.names]
        if missing:
            raise EpisodeDataError(
                f"{footer.url}: episode {e}: no column(s) {sorted(set(missing))} in the data file (it has "
                f"{list(footer.names)}); ask only for columns the dataset has (meta/info.json "
                "'features'), or re-export the dataset with LeRobot")
        groups = [i for i, bounds in enumerate(footer.episode_bounds)
                  if bounds is None or bounds[0] <= e <= bounds[1]]
        if not groups:
            raise EpisodeDataError(
                f"{footer.url}: episode {e}: no row group holds it (episode_index statistics of the "
                f"{len(footer.episode_bounds)} row groups exclude it); {_FIX}")
        read_columns = [*wanted, *(c for c in CHECK_COLUMNS if c not in wanted)]
        # readahead=0: pre_buffer already coalesces a row group's column chunks into few reads;
        # those inside the tail fetched with the footer are served from it.
        with self.fetcher.open_file(footer.url, footer.size, readahead=0,
                                    preload=(footer.tail_start, footer.tail)) as f:
            try:
                pf = pq.ParquetFile(f, metadata=footer.metadata, pre_buffer=True)
                table = pf.read_row_groups(groups, columns=read_columns, use_threads=False)
            except Exception as exc:
                if not _is_arrow_error(exc):
                    raise
                raise EpisodeDataError(
                    f"{footer.url}: episode {e}: row groups {groups} are not readable parquet ({exc}); "
                    "the file is corrupt or was replaced since its footer was read: re-upload it") from None
        table = table.filter(pc.equal(table.column("episode_index"), pa.scalar(e, pa.int64())))
        table = _checked(table, episode, footer.url)
        return table.select(list(wanted))

    # -- footers --------------------------------------------------------------------------------

    def _footer(self, rel: str) -> _Footer:
        with self._lock:
            future = self._footers.get(rel)
            owner = future is None
            if owner:
                future = self._footers[rel] = Future()
                while len(self._footers) > self.footer_cache:
                    # A pending one evicted here still reaches the threads already waiting on it.
                    self._footers.popitem(last=False)
            else:
                self._footers.move_to_end(rel)
        if owner:
            try:
                future.set_result(self._load_footer(rel))
            except BaseException as exc:
                future.set_exception(exc)
                with self._lock:  # a failure is not cached: the next read tries again
                    if self._footers.get(rel) is future:
                        del self._footers[rel]
        return future.result()

    def _load_footer(self, rel: str) -> _Footer:
        url = fs.url(self.meta.root, rel)
        size = fs.file_identity(self.meta.root, rel, config=self.fetcher.config).size
        # One request for the footer and what precedes it in pyarrow's footer read (the last
        # 64 KiB); only a larger footer costs another.
        tail_start = max(0, size - DEFAULT_READAHEAD)
        tail = self.fetcher.fetch(url, tail_start, size - tail_start)
        with self.fetcher.open_file(url, size, preload=(tail_start, tail)) as f:
            try:
                metadata = pq.ParquetFile(f).metadata
                names = tuple(metadata.schema.to_arrow_schema().names)
            except Exception as exc:
                if not _is_arrow_error(exc):
                    raise
                raise EpisodeDataError(
                    f"{url}: not a readable parquet file ({exc}); re-upload it, or re-export the "
                    "dataset with LeRobot") from None
        return _Footer(url=url, size=size, metadata=metadata, names=names,
                       episode_bounds=_episode_bounds(metadata), tail_start=tail_start, tail=tail)


def _is_arrow_error(exc: BaseException) -> bool:
    """pyarrow's own complaint about the bytes (corrupt, truncated, not parquet), as opposed to
    a stream error raised by our file object, which pyarrow passes through unchanged."""
    return isinstance(exc, pa.ArrowException) or type(exc) is OSError


def _episode_bounds(metadata: pq.FileMetaData) -> tuple[tuple[int, int] | None, ...]:
    leaf = next((j for j in range(metadata.num_columns)
                 if metadata.schema.column(j).path == "episode_index"), None)
    bounds: list[tuple[int, int] | None] = []
    for i in range(metadata.num_row_groups):
        stats = metadata.row_group(i).column(leaf).statistics if leaf is not None else None
        if stats is None or not stats.has_min_max:
            bounds.append(None)
        else:
            bounds.append((int(stats.min), int(stats.max)))
    return tuple(bounds)


def _shown(values: np.ndarray) -> str:
    items = values[:_SHOWN].tolist()
    return str(items)[:-1] + (", ...]" if len(values) > _SHOWN else "]")


def _checked(table: pa.Table, episode: EpisodeInfo, where: str) -> pa.Table:
    """``table`` (one episode's rows) in frame order, or an EpisodeDataError saying what is off."""
    e, length = episode.episode_index, episode.length
    first, stop = episode.dataset_from_index, episode.dataset_to_index
    for name in ("frame_index", "index"):
        nulls = table.column(name).null_count
        if nulls:
            raise EpisodeDataError(f"{where}: episode {e}: {nulls} null {name!r} value(s); {_FIX}")
    n = table.num_rows
    frames = table.column("frame_index").to_numpy()
    expected = np.arange(length, dtype=np.int64)
    if n != length or not np.array_equal(frames, expected):
        if n == length and np.array_equal(np.sort(frames), expected):
            table = table.take(pa.array(np.argsort(frames, kind="stable")))
            frames = expected
        else:
            values, counts = np.unique(frames, return_counts=True)
            problems = []
            lost = np.setdiff1d(expected, values)
            if lost.size:
                problems.append(f"frame_index {_shown(lost)} missing")
            dupes = values[counts > 1]
            if dupes.size:
                problems.append(f"frame_index {_shown(dupes)} duplicated")
            outside = values[(values < 0) | (values >= length)]
            if outside.size:
                problems.append(f"frame_index {_shown(outside)} outside 0..{length - 1}")
            raise EpisodeDataError(
                f"{where}: episode {e}: {n} rows where meta/episodes says length {length}"
                + (f" ({'; '.join(problems)})" if problems else "") + f"; {_FIX}")
    index = table.column("index").to_numpy()
    bad = np.flatnonzero(index != np.arange(first, stop, dtype=np.int64))
    if bad.size:
        k = int(bad[0])
        raise EpisodeDataError(
            f"{where}: episode {e}: frame_index {k} has index {int(index[k])}, expected {first + k} "
            f"(meta/episodes: dataset_from_index {first}); {bad.size} of {length} rows differ; {_FIX}")
    return table
