"""Twin-tar samples for one process: tasks (runs of one shard's members) in, samples out.

Zip mode reads every modality tar of a shard in lockstep and checks that each tuple shares one
key. Index mode is driven by the parquet key index and tolerates missing, duplicate and
out-of-order members within a bounded look-ahead. A sample is one dict: ``__key__``,
``__shard__``, ``__index__``, ``__epoch__``, ``__pad__``, ``__bucket__``, ``__sid__`` and a
``<modality>.<ext>`` field per modality (``__missing__`` under ``missing_key_policy="partial"``).

An epoch plan hands a worker a shard in several batches, one after another as a rule. The
reader keeps the tars of the shards it read last open where it stopped (``KEEP_OPEN`` shards),
so the next batch of a shard starts with no open, no seek and no key-index lookup; members a
batch does not want are passed reading their headers only (a seek on a local tar). Each sample
is built once, as the dict handed on: no per-member dicts, no grouping pass.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

from loader.formats.errors import FormatError, short_repr
from loader.formats.pid_names import split_pid_member_name
from loader.formats.twin_tar import TarReadError
from loader.io import urls
from loader.io.config import StreamConfig
from loader.io.heap import keep_heap_for_batches
from loader.wds.consumed import SID_SHIFT
from loader.wds.epoch_plan import Task
from loader.wds.errors import CountMismatchError, MissingKeyError, ShardReadError, TwinMismatchError
from loader.wds.members import OpenTar, open_stream, split_key
from loader.wds.shard_table import TarSample

log = logging.getLogger(__name__)

KEEP_OPEN = 4  # shards whose tars stay open between tasks (x modalities file descriptors)
PREPARE_BATCHES = 32  # read ahead: planned batches whose tars are opened before they are read, at most
PULL_PER_BATCH = 4  # read ahead: batches planned ahead per batch read, at most (the ramp to the budget)
PREPARED = 32  # read ahead: tars opened ahead, at most (their bytes are bounded by the ReadAhead's budget)
SMALL_SHARE = 32  # read ahead: a tar this many times smaller than its shard's largest is fetched whole (_small_tars)
TAR_TAIL = 22 * 512  # a tar's bytes after its last member at most: 2 end-of-archive blocks + a 10 KiB record's padding
SKIP_AHEAD = 8  # further ahead than this, a reader with header offsets reopens there instead of skipping
_READ_ERRORS = (TarReadError, EOFError, OSError)

_INDEX_CACHE: OrderedDict[tuple, tuple] = OrderedDict()
_INDEX_CACHE_SIZE = 32   # shards: a worker reads its batches of one shard one after another
_INDEX_CACHE_LOCK = threading.Lock()
# Key indexes being read on a thread of this process (read_indexes_soon): cache key -> (pid, the read).
_INDEX_PENDING: dict[tuple, tuple[int, Future]] = {}


def read_index(shard: TarSample, modalities: tuple[str, ...], offsets: bool = True):
    """``(keys, {modality: header offsets})`` from the shard's key index, or None without one.

    ``offsets=False``: keys only (the offset columns cost as much again to decode), for a reader
    that starts at the shard's first sample anyway. The last few shards' indexes are kept: an
    epoch plan hands a worker several batches of one shard, and each may need it.
    """
    if not shard.key_index:
        return None
    key = (shard.key_index, shard.sample_count, tuple(modalities), offsets)
    hit = _cached_index(key)
    if hit is not None:
        return hit
    with _INDEX_CACHE_LOCK:
        pending = _INDEX_PENDING.get((*key[:3], True))
    if pending is not None and pending[0] == os.getpid():  # being read already (a forked copy's never ends)
        pending[1].exception()
        hit = _cached_index(key)
        if hit is not None:
            return hit  # else it failed: read again here, where the error is met and reported
    return _read_and_cache(key, shard, modalities, offsets)


def _cached_index(key: tuple):
    with _INDEX_CACHE_LOCK:
        hit = _INDEX_CACHE.get(key)
        if hit is None and not key[3]:  # the keys of an index read with its offsets will do
            hit = _INDEX_CACHE.get(with_offsets := (*key[:3], True))
            if hit is not None:
                _INDEX_CACHE.move_to_end(with_offsets)
                return hit
        if hit is not None:
            _INDEX_CACHE.move_to_end(key)
        return hit


def _read_and_cache(key: tuple, shard: TarSample, modalities: tuple[str, ...], offsets: bool):
    got = _read_index_uncached(shard, modalities, offsets)
    with _INDEX_CACHE_LOCK:
        _INDEX_CACHE[key] = got
        while len(_INDEX_CACHE) > _INDEX_CACHE_SIZE:
            _INDEX_CACHE.popitem(last=False)
    return got


def read_indexes_soon(shards, modalities: tuple[str, ...] | None, options,
                      tasks: Iterable[Task] = ()) -> int:
    """Right after the manifests are read: a remote dataset's key indexes are read now, on a few
    threads, while the loader and its plan are made: every one of a dataset of at most
    ``_INDEX_CACHE_SIZE`` shards (each is read this epoch, whatever the plan, and all stay
    cached), else those of the first shards ``tasks`` (the plan) reads, ``_INDEX_CACHE_SIZE`` at
    most. Instrumented, the key indexes were asked for 40-70 ms after the manifests came (the
    plan, the DataLoader) and every first batch waited for them: at 0 workers its tars' limits,
    at 2 workers the fork (``read_indexes_before_fork``). A read of one still on the way waits
    for it (``read_index``); failures are left for the reader to meet and report. Returns the
    reads started."""
    config = options.stream_config or StreamConfig()
    roots = getattr(shards, "roots", None)
    if (config.read_ahead_bytes <= 0 or options.verify is not None or not roots
            or all(urls.is_local(r) for r in roots)):
        return 0
    ids = (t.shard_id for t in tasks) if len(shards) > _INDEX_CACHE_SIZE else range(len(shards))
    wanted = _first_shards(shards, ids, modalities)
    if not wanted:
        return 0
    pool = ThreadPoolExecutor(min(config.read_ahead_connections, len(wanted)), thread_name_prefix="key-index-soon")

    def one(key: tuple, shard: TarSample, mods: tuple[str, ...]) -> None:
        try:
            _read_and_cache(key, shard, mods, True)
        finally:
            with _INDEX_CACHE_LOCK:
                _INDEX_PENDING.pop(key, None)

    with _INDEX_CACHE_LOCK:
        for key, (shard, mods) in wanted.items():
            if key not in _INDEX_PENDING:
                _INDEX_PENDING[key] = (os.getpid(), pool.submit(one, key, shard, mods))
    pool.shutdown(wait=False)  # its threads end with the last read
    return len(wanted)


def read_indexes_before_fork(shards, tasks: Iterable[Task], modalities: tuple[str, ...] | None, options) -> int:
    """In the training process, just before DataLoader workers are forked from it: read the key
    indexes of the first shards ``tasks`` read (remote shards read ahead; ``_INDEX_CACHE_SIZE`` at
    most), on a few threads at once, so that every worker starts with them in its copy of the
    cache, and make the S3 client the workers will use. Instrumented at 2 workers, each worker
    read every key index again (the batches of a shard alternate between workers), and made its
    own client: 0.15-0.25 s of CPU and two times to first byte before its first batch. Failures
    are left for the workers to meet and report. Returns the key indexes read."""
    config = options.stream_config or StreamConfig()
    if config.read_ahead_bytes <= 0 or options.verify is not None:
        return 0
    roots = getattr(shards, "roots", None) or []

    def make_client() -> None:
        # The client the workers will use, made whatever the cache holds (instrumented: when
        # read_indexes_soon had read every key index, none was made, and each worker made its
        # own before its first GET: 15-40 ms each); once per process, a second call returns it.
        if any(urls.scheme(r) == "s3" for r in roots):
            from loader.io.s3_client import client_for_fork

            client_for_fork(config)

    with _INDEX_CACHE_LOCK:  # no thread of read_indexes_soon may be mid-read (or hold the lock) at the fork
        pending = [f for pid, f in _INDEX_PENDING.values() if pid == os.getpid()]
    if pending:
        make_client()  # while the reads on the way wait for bytes
    for f in pending:
        f.exception()
    wanted = _first_shards(shards, (t.shard_id for t in tasks), modalities)
    if not wanted:
        make_client()
        return 0

    def one(item) -> None:
        # Best effort: the worker that needs an index that failed here reads it again and reports it.
        with contextlib.suppress(Exception):
            read_index(*item)

    with ThreadPoolExecutor(min(config.read_ahead_connections, len(wanted)), thread_name_prefix="key-index") as pool:
        reads = [pool.submit(one, item) for item in wanted.values()]
        make_client()  # while the indexes' first bytes are on the way
        for r in reads:
            r.result()
    return len(wanted)


def _first_shards(shards, shard_ids: Iterable[int], modalities: tuple[str, ...] | None) -> dict:
    """Cache key -> (shard, modalities) of the remote shards read first (``shard_ids``: the plan's
    tasks' shards, in order) whose key index is not cached: ``_INDEX_CACHE_SIZE`` at most (the
    reader reads on from there)."""
    wanted: dict[tuple, tuple[TarSample, tuple[str, ...]]] = {}
    for seen, shard_id in enumerate(shard_ids):
        if len(wanted) >= _INDEX_CACHE_SIZE or seen >= _INDEX_CACHE_SIZE * PREPARE_BATCHES:
            break
        shard = shards[shard_id]
        if not shard.key_index or urls.is_local(shard.root):
            continue
        mods = tuple(modalities or shard.keys)
        if not index_cached(shard, mods):
            wanted.setdefault((shard.key_index, shard.sample_count, mods, True), (shard, mods))
    return wanted


def index_cached(shard: TarSample, modalities: tuple[str, ...], offsets: bool = True) -> bool:
    """Whether ``read_index(shard, modalities, offsets)`` would answer without a read."""
    with _INDEX_CACHE_LOCK:
        return (shard.key_index, shard.sample_count, tuple(modalities), offsets) in _INDEX_CACHE


def _read_index_uncached(shard: TarSample, modalities: tuple[str, ...], offsets: bool):
    from loader.formats.key_index import read_key_columns

    with open_stream(shard.key_index) as fh:
        data = fh.read()  # small, and parquet wants to seek: remote streams do not
    try:
        index = read_key_columns(data, modalities, offsets=offsets, sizes=offsets, origin=shard.key_index)
    except FormatError as exc:
        raise ShardReadError(f"shard {shard.path}: {exc}") from None
    keys = index.keys
    if len(keys) != shard.sample_count:
        raise CountMismatchError(
            f"shard {shard.path}: its key index {shard.key_index} lists {len(keys)} samples, the manifest "
            f"counts {shard.sample_count}; rebuild the manifest or the shard, or set shard_error_policy='skip'"
        )
    for m, offs in index.offsets.items():
        # One more offset: where the last member ends (the end-of-archive blocks), so a read-ahead
        # of a shard's last task stops there rather than at the tar's record padding.
        size = index.sizes.get(m, [None])[-1] if keys else None
        offs.append(None if size is None or offs[-1] is None else offs[-1] + 512 + -(-size // 512) * 512)
    return keys, index.offsets


def _bad_key(shard: TarSample, url: str, i: int, name: str) -> ShardReadError:
    return ShardReadError(
        f"shard {shard.path}: member {i} of {url} is named {short_repr(name)}; format_version 1 names "
        "members '<key>.<ext>' with no '/' or '.' in the key (a path such as '../x' or '/abs' is never "
        "a key) - the tar was not written by this build: rebuild it, or set shard_error_policy='skip'"
    )


def _escapes(key: str) -> bool:
    """A key (of a PiD-written tar) that would leave a folder if someone saved a file by it."""
    return key.startswith("/") or "\\" in key or key == ".." or key.startswith("../") or "/../" in key \
        or key.endswith("/..")


def _check_index_keys(shard: TarSample, keys: list[str], stats) -> None:
    """Keys of a key index written by others: refused under format 1, counted for PiD's tars."""
    joined = "\n".join(keys)  # substring tests at memory speed, not a loop per key
    if not shard.pid_names:
        # Dots are left to index mode's longest-known-prefix rule (foreign names); a path never is.
        if "/" in joined or "\\" in joined or "\n\n" in joined or joined.startswith("\n") or (keys and not keys[-1]):
            i, name = next((i, k) for i, k in enumerate(keys) if not k or "/" in k or "\\" in k)
            raise ShardReadError(
                f"shard {shard.path}: its key index {shard.key_index} lists key {short_repr(name)} (sample {i}); "
                "format_version 1 keys hold no '/' (a path such as '../x' or '/abs' is never a key) - rebuild "
                "the shard and its key index, or set shard_error_policy='skip'"
            )
    elif ".." in joined or "/" in joined or "\\" in joined:
        stats.escaping_keys += sum(1 for k in keys if _escapes(k))


def _task_end(task: Task) -> int:
    """The member after the task's last."""
    return max((b for _, b in task.ranges), default=0)


def _limits(index, mods: tuple[str, ...], last: int, count: int) -> dict[str, int | None]:
    """Per modality, the byte a read of the members before ``last`` ends at: the next member's
    header included (the tar reader reads it with the last member's padding; after the last
    member, the first end-of-archive block); None: the tar's end."""
    return {m: None if (o := index[1][m][min(last, count)]) is None else o + 512 for m in mods}


def _small_tars(index, mods: tuple[str, ...], count: int, config: StreamConfig | None) -> dict[str, int]:
    """Read ahead, the modality tars of a shard fetched whole, each in one GET for all of its
    batches in the process, by where their members end: those within a quarter of a read-ahead
    block (1 MiB by default) and 1/``SMALL_SHARE`` of the shard's largest tar (captions beside
    photos). Instrumented at 2 workers: the batches of a shard alternate between the workers, so
    each batch's captions (33 KB) were a GET of their own, 33 of 78 GETs, where the whole caption
    tar is 100 KB. The bytes of the other workers' batches fetched with them stay within
    1/``SMALL_SHARE`` of the shard's, and a worker that reads a shard's batches in a row fetches
    nothing more."""
    ends = _limits(index, mods, count, count)
    known = [e for e in ends.values() if e is not None]
    if len(known) < 2:
        return {}
    small = min((config or StreamConfig()).read_ahead_block // 4, max(known) // SMALL_SHARE)
    return {m: e for m, e in ends.items() if e is not None and e <= small}


def _field(modality: str, ext: str) -> str:
    return f"{modality}.{ext}" if ext else modality


class _Fields(dict):
    """``<modality>.<ext>`` field names of one modality, made once per extension."""

    def __init__(self, modality: str):
        super().__init__()
        self.modality = modality

    def __missing__(self, ext: str) -> str:
        self[ext] = f = _field(self.modality, ext)
        return f


class _Tars:
    """A shard's modality tars, open; ``pos`` is the member index the next read is for."""

    def __init__(self, shard: TarSample, modalities: tuple[str, ...], starts: dict[str, int], pos: int,
                 opts, stats, verify: bool, ahead=None, limits: dict[str, int | None] | None = None,
                 ahead_to: int | None = None, order: int = 0, wholes: dict[str, int] | None = None):
        self.shard, self.modalities, self.pos, self.verify = shard, modalities, pos, verify
        self.ahead_to = ahead_to  # read-ahead: the member the streams' limits end before (None: no limit)
        self.early_last: int | None = None  # opened before the key index came: the end of the task it was opened for
        self._tars: list[OpenTar] | None = None
        self._nexts: list | None = None
        self._opts, self._stats = opts, stats
        # Read ahead, every modality's stream asks for its first bytes before any is read, and
        # the tars are parsed only when a read wants their members: a tar opened at byte 0
        # reads its first header at once, and ``prepare`` must not wait for those bytes.
        self.streams = ({m: ahead.open(shard.url(m), starts[m], (limits or {}).get(m), order, (wholes or {}).get(m))
                         for m in modalities} if ahead else None)
        self._starts = starts
        if self.streams is None:
            self._open_tars()
        self.split = split_pid_member_name if shard.pid_names else split_key
        self.lookahead: list[_Lookahead] | None = None  # index mode's readers
        self.known: dict[str, int] | None = None
        self.keys: list[str] | None = None  # the key index's keys, once read

    def _open_tars(self) -> list[OpenTar]:
        shard, streams = self.shard, dict(self.streams or {})
        tars: list[OpenTar] = []
        try:
            for m in self.modalities:
                sha = (shard.sha256 or {}).get(m) if self.verify else None
                tars.append(OpenTar(shard.url(m), self._starts[m], self._opts.stream_config, self._stats.stream, sha,
                                    members=shard.sample_count, stream=streams.pop(m, None)))
        except BaseException:
            for t in tars:
                t.close()
            for stream in streams.values():
                stream.close()
            self.streams = None
            self._tars = []
            raise
        self._tars = tars
        self._nexts = [t.cursor.next for t in tars]
        return tars

    @property
    def tars(self) -> list[OpenTar]:
        return self._tars if self._tars is not None else self._open_tars()

    @property
    def nexts(self) -> list:
        if self._nexts is None:
            self._open_tars()
        return self._nexts

    def read_error(self, exc: BaseException) -> ShardReadError:
        """A read failure as the loader's error, naming the tar it happened in."""
        origin = getattr(exc, "origin", None) or getattr(exc, "filename", None)
        tars = self._tars or self.tars
        tar = next((t for t in tars if t.url == origin), tars[0])
        return tar.read_error(exc)

    def want(self, limits: dict[str, int | None], upto: int, order: int) -> None:
        """Read ahead up to these byte limits (the member ``upto`` ends before them), for the
        batch at ``order`` in the plan."""
        for m in self.modalities:
            self.stream(m).want(limits[m], order)
        self.ahead_to = upto

    def stream(self, m: str):
        """The read-ahead stream of modality ``m``."""
        if self._tars is None:
            return self.streams[m]
        return self._tars[self.modalities.index(m)].stream

    def check_sha256(self) -> None:
        for m, t in zip(self.modalities, self.tars, strict=True):
            t.check_sha256((self.shard.sha256 or {})[m])

    def close(self) -> None:
        if self._tars is None:
            for stream in (self.streams or {}).values():
                stream.close()
            self._tars = []
            self._nexts = []
        for t in self._tars:
            t.close()


class _Lookahead:
    """One modality's members, searchable by key within a bounded read-ahead buffer."""

    def __init__(self, nxt, known: dict, limit: int, stats):
        self.nxt, self.known, self.limit, self.stats = nxt, known, limit, stats
        self.buffer: dict[str, tuple[str, bytes]] = {}
        self.seen: set[str] = set()
        self.exhausted = False

    def take(self, key: str) -> tuple[str, bytes] | None:
        if self.buffer and key in self.buffer:
            return self.buffer.pop(key)
        if self.exhausted or (got := self._next()) is None:
            return None
        name, data = got
        # The usual case, members in index order: the name is "<key>.<ext>" with no other dot,
        # so no longer known key can claim it and split_key's search is not needed.
        cut = len(key) + 1
        if name.startswith(key) and name[cut - 1 : cut] == "." and name.find(".", cut) < 0 and key not in self.seen:
            self.seen.add(key)
            return name[cut:], data
        return self._search(key, name, data)

    def _search(self, key: str, name: str, data: bytes) -> tuple[str, bytes] | None:
        """Read on (``name``/``data`` is the member just read) until ``key``, buffering others."""
        read = 1
        while True:
            k, ext = split_key(name, self.known)
            if k not in self.known:
                self.stats.unindexed_members += 1
            elif k in self.seen or k in self.buffer:
                self.stats.duplicates += 1  # first copy wins
            else:
                self.seen.add(k)
                if k == key:
                    return ext, data
                if len(self.buffer) >= self.limit:
                    self.buffer.pop(next(iter(self.buffer)))  # oldest: it can no longer be in order
                self.buffer[k] = (ext, data)
            if read >= self.limit or (got := self._next()) is None:
                return None
            name, data = got
            read += 1

    def _next(self) -> tuple[str, bytes] | None:
        got = self.nxt()
        if got is None:
            self.exhausted = True
        return got


class TwinReader:
    """Reads tasks of twin-tar shards into samples, for one process (a DataLoader worker or the
    training process): it holds open files, so each process makes its own and closes it."""

    def __init__(self, shards, modalities: tuple[str, ...] | None, options, stats):
        self.shards, self.modalities, self.options, self.stats = shards, modalities, options, stats
        keep_heap_for_batches()
        self._open: OrderedDict[tuple[int, str], _Tars] = OrderedDict()
        self._prepared: OrderedDict[tuple, _Tars] = OrderedDict()  # tars opened ahead, by (shard, mode, first, mods)
        self._indexes: dict[tuple, Future] = {}  # key indexes being read ahead
        self._order = 0  # read ahead: the place in the plan of the batch prepared or read now
        config = options.stream_config
        reads_ahead = (config.read_ahead_bytes if config is not None else StreamConfig.read_ahead_bytes) > 0
        self._ahead = False if reads_ahead else None  # False: a ReadAhead is made at the first remote tar
        self._fields: dict[tuple[str, ...], list[_Fields]] = {}

    def _fields_of(self, mods: tuple[str, ...]) -> list[_Fields]:
        """The field names of these modalities, made once per reader: a mixture's batch is a
        task per source or more, and each would make them again."""
        key = tuple(mods)
        fields = self._fields.get(key)
        if fields is None:
            fields = self._fields[key] = [_Fields(m) for m in key]
        return fields

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()
        while self._prepared:
            self._prepared.popitem()[1].close()
        self._indexes.clear()
        if self._ahead:
            self._ahead.close()
            self._ahead = False

    def _drop(self, shard_id: int, mode: str) -> None:
        tars = self._open.pop((shard_id, mode), None)
        if tars is not None:
            tars.close()

    def samples(self, epoch: int, task: Task) -> list[dict]:
        """The samples of one task, in member order (a shard error under ``shard_error_policy=
        "skip"`` ends them early, counted)."""
        out: list[dict] = []
        self.read(epoch, task, out)
        return out

    def read(self, epoch: int, task: Task, out: list[dict]) -> None:
        """Append the samples of one task to ``out``, in member order. A list, not a generator:
        a batch is collected whole before it is handed on anyway, and appending costs less than
        passing each sample up through generator frames."""
        kept = self._open.get((task.shard_id, self.options.mode))
        # A shard read on from an earlier task (a mixture switches shards every sample or two):
        # its tars hold the shard already, no row of the table to rebuild.
        shard: TarSample = kept.shard if kept is not None else self.shards[task.shard_id]
        opts, stats = self.options, self.stats
        mods = self.modalities or shard.keys
        where = (epoch, task.shard_id, task.pad, shard.bucket)
        before = len(out)
        try:
            try:
                (self._zip if opts.mode == "zip" else self._index)(shard, task, mods, where, out)
            except TwinMismatchError:
                self._drop(task.shard_id, "zip")
                if not (opts.mode == "zip" and opts.zip_fallback_to_index and shard.key_index):
                    raise
                # Zip mode checks a whole tuple before appending any of it, so every member up to
                # the last sample appended is complete: index mode reads the rest of the task.
                done = out[-1]["__index__"] if len(out) > before else -1
                stats.zip_fallbacks += 1
                log.warning("shard %s: zip mode mismatch after member %d, falling back to index mode",
                            shard.path, done)
                rest = tuple((max(a, done + 1), b) for a, b in task.ranges if b > done + 1)
                self._index(shard, Task(task.shard_id, rest, task.pad), mods, where, out)
        except ShardReadError:
            self._drop(task.shard_id, "zip")
            self._drop(task.shard_id, "index")
            if opts.shard_error_policy == "raise":
                raise
            stats.shard_errors += 1
            log.exception("skipping the rest of shard %s", shard.path)
        finally:
            stats.samples += len(out) - before
        stats.shards += 1

    # ------------------------------------------------------------------ opening and reusing

    def _tars(self, shard: TarSample, task: Task, mods: tuple[str, ...], mode: str, first: int) -> _Tars:
        """The shard's tars positioned before member ``first``: kept open from an earlier task
        when they are at or a little before it, else opened at its key-index offsets (or taken
        from those ``prepare`` opened ahead)."""
        verify = self.options.verify is not None
        key = (task.shard_id, mode)
        last = _task_end(task)
        ahead = self._ahead_for(shard)
        tars = self._open.pop(key, None)
        # Tars ``prepare`` opened for this task win over kept ones that would go on into it: they
        # hold its first bytes already, and the kept ones' limits end where this task starts (a
        # prepare that ran while the kept tars were being opened saw neither; closing these
        # instead dropped bytes fetched for this very task).
        twin = self._prepared.pop((task.shard_id, mode, first, mods), None)
        if tars is not None and twin is None and tars.modalities == mods and not verify:
            gap = first - tars.pos
            # Zip mode passes members cheaply (headers only); past a few, a key index's offset is cheaper.
            # Read ahead by ranges, a gap's bytes are fetched for nothing: the offset always wins.
            skip = mode == "zip" and gap > 0 and (not shard.key_index or (ahead is None and gap <= SKIP_AHEAD))
            if gap == 0 or skip:
                self._want(shard, tars, mods, last)
                self._keep(key, tars)
                return tars
        if tars is not None:
            tars.close()
        tars = twin
        if tars is not None:
            try:
                self._want(shard, tars, mods, last)  # opened early: waits for the key index here
            except BaseException:
                tars.close()
                raise
        else:
            tars = self._open_at(shard, task, mods, mode, first, last, ahead)
        if not verify:
            self._keep(key, tars)
        return tars

    def _open_at(self, shard: TarSample, task: Task, mods: tuple[str, ...], mode: str, first: int, last: int,
                 ahead) -> _Tars:
        """The shard's tars opened before member ``first`` (at the key index's offsets where it has
        them); read ahead, their streams fetch the bytes up to member ``last`` and no further."""
        verify = self.options.verify is not None
        starts, pos, keys, limits, ahead_to, wholes = {m: 0 for m in mods}, 0, None, None, None, None
        if (first > 0 or ahead is not None) and not verify:  # a checksum covers the whole tar: read it from byte 0
            index = self._key_index(shard, mods)
            if index is not None and all(m in index[1] for m in mods):
                keys = index[0]
                if first == 0:
                    pass
                elif mode == "zip":
                    starts, pos = {m: index[1][m][first] for m in mods}, first
                else:  # members may come out of order: start at the earliest one the task wants
                    wanted = [i for a, b in task.ranges for i in range(a, b)]
                    # A key kept without a modality added later has no offset there (null): the
                    # task's other members of that modality decide, else the tar's start.
                    starts = {m: min((o for i in wanted if (o := index[1][m][i]) is not None), default=0)
                              for m in mods}
                    pos = first
                if ahead is not None:
                    limits, ahead_to = _limits(index, mods, last, shard.sample_count), last
                    wholes = _small_tars(index, mods, shard.sample_count, self.options.stream_config)
        tars = _Tars(shard, mods, starts, pos, self.options, self.stats, verify, ahead, limits, ahead_to,
                     self._order, wholes)
        tars.keys = keys
        return tars

    def _want(self, shard: TarSample, tars: _Tars, mods: tuple[str, ...], last: int) -> None:
        """Read-ahead tars fetch on up to member ``last`` (their limits end earlier)."""
        if tars.ahead_to is None or last <= tars.ahead_to:
            return
        index = self._key_index(shard, mods)  # cached: the tars were opened from it (or are on the way)
        if index is None or not all(m in index[1] for m in mods):
            tars.ahead_to = None  # opened early, and no offsets to bound them: read on to the end
            for m in mods:
                tars.stream(m).want(None, self._order)
            return
        tars.want(_limits(index, mods, last, shard.sample_count), last, self._order)

    def _ahead_for(self, shard: TarSample):
        """The process's ``ReadAhead`` if this shard's tars are read through one, else None."""
        if self._ahead is None or urls.is_local(shard.root):
            return None
        return self._ahead_for_root()

    def prepare(self, tasks) -> bool:
        """Start fetching the tars of tasks this reader will read soon (remote shards with a key
        index, read ahead): the next task of a shard open here raises its streams' limits;
        another shard's tars are opened at the task's offsets, their first bytes on the way.
        False while a key index it needs is still being read (call again later). What cannot be
        prepared (a shard error) is left for ``read`` to meet and report."""
        if self._ahead is None or self.options.verify is not None:
            return True
        mode, done = self.options.mode, True
        for task in tasks:
            if not task.ranges:
                continue
            kept = self._open.get((task.shard_id, mode))
            shard = kept.shard if kept is not None else self.shards[task.shard_id]
            if not shard.key_index or self._ahead_for(shard) is None:
                continue
            mods = self.modalities or shard.keys
            first, last = min(a for a, _ in task.ranges), _task_end(task)
            if not self._index_soon(shard, mods):
                done = False  # its key index is on the way: a later call sets the tars' limits
                if first == 0 and kept is None:
                    self._open_early(shard, task, mods, mode)
                continue
            chained = [t for k, t in self._prepared.items() if k[0] == task.shard_id and k[1] == mode and k[3] == mods]
            if kept is not None and kept.modalities == mods:
                chained.append(kept)
            try:
                for t in chained:
                    if t.ahead_to == 0 and t.early_last is not None:
                        # Opened early, its index here now: its limits first, so that a later task
                        # of the shard goes on in it (its bytes are on the way there), not in a
                        # second stream that closes this one with them unread (a flaky drop, 1 in 4).
                        self._want(shard, t, mods, t.early_last)
                # Tars that read this task already, or go on into it: no second stream.
                follows = next((t for t in chained if t.ahead_to is not None and t.pos <= first <= t.ahead_to), None)
                if follows is not None:
                    self._want(shard, follows, mods, last)
                    continue
                key = (task.shard_id, mode, first, mods)
                if key not in self._prepared:
                    if len(self._prepared) >= PREPARED:
                        # Full: this task waits for a later call. Making room by closing the
                        # oldest closed the tars read soonest, their bytes fetched and dropped
                        # (instrumented: 13% of the bytes at 2 workers over 25 shards).
                        done = False
                        continue
                    self._prepared[key] = self._open_at(shard, task, mods, mode, first, last, self._ahead)
            except (ShardReadError, OSError):
                continue
            while len(self._prepared) > PREPARED:
                self._prepared.popitem(last=False)[1].close()
        return done

    def _open_early(self, shard: TarSample, task: Task, mods: tuple[str, ...], mode: str) -> None:
        """A task that starts at the shard's first member, its key index still on the way: the
        tars are opened at byte 0 now, asking ahead one read-ahead block each (their first
        members), so those bytes come with the key index, not one time to first byte after it.
        Instrumented at 0 workers, the reader's first bytes waited on three first-byte times in a
        row (manifest, key index, range). The index raises the limits when it comes (``_want``:
        ``ahead_to`` 0 until then); a task that ends before a block reads on into the next one,
        which its shard's next task reads from the same tars. Only where the manifest lists the
        tars' sizes."""
        key = (task.shard_id, mode, 0, mods)
        sizes = shard.sizes or {}
        if key in self._prepared or len(self._prepared) >= PREPARED or not all(m in sizes for m in mods):
            return
        block = (self.options.stream_config or StreamConfig()).read_ahead_block
        # Short of the tar's end by its largest tail (end-of-archive blocks, record padding): the
        # reader never reads there, so no byte asked for now is fetched for nothing.
        limits = {m: max(0, min(block, sizes[m] - TAR_TAIL)) for m in mods}
        tars = self._prepared[key] = _Tars(shard, mods, {m: 0 for m in mods}, 0, self.options, self.stats, False,
                                           self._ahead, limits, 0, self._order)
        tars.early_last = _task_end(task)

    def plan_ahead(self, batches: Iterable) -> Iterator:
        """``batches`` (planned batches) as they come, each prepared before it is read: as many
        batches ahead as the read-ahead's byte budget has room for (``PREPARE_BATCHES`` at most,
        reached ``PULL_PER_BATCH - 1`` batches further per batch read). While a read waits for
        bytes, the planning goes on (``ReadAhead.while_waiting``): a key index read meanwhile
        opens its shard's tars at once, and the budget handed back is spent again."""
        roots = getattr(self.shards, "roots", None)
        local = roots is not None and all(urls.is_local(r) for r in roots)
        if self._ahead is None or self.options.verify is not None or local:
            yield from batches
            return
        window: deque = deque()  # [batch, its tasks, prepared?, its place in the plan]
        it, seq, ended = iter(batches), 0, False

        def pull(n: int) -> None:
            nonlocal seq, ended
            for _ in range(n):
                # A full budget stops planning further ahead, never the next batch: with an empty
                # window the plan would end there, its remaining batches silently never read (seen
                # under S3 503s: the budget still held by retried ranges when the window emptied).
                if ended or len(window) >= PREPARE_BATCHES or (window and self._ahead and not self._ahead.has_room()):
                    return
                pb = next(it, None)
                if pb is None:
                    ended = True
                    return
                window.append([pb, pb.reading()[0], False, seq])
                seq += 1

        planning = [False]

        def prepare_window() -> None:
            planning[0] = True  # a read inside the planning must not plan again
            try:
                # The batches' ranges of one tar go out as a few large GETs (no ReadAhead yet: none to plan).
                with self._ahead.plan() if self._ahead else nullcontext():
                    for entry in window:  # again: a key index asked for last time may be here now
                        if not entry[2]:
                            self._order = entry[3]
                            entry[2] = self.prepare(entry[1])
            finally:
                planning[0] = False

        def while_waiting() -> list[Future]:
            """A read waits for bytes: plan on, and name the key-index reads the plan waits for."""
            if planning[0]:
                return []
            order = self._order  # the batch being read keeps its place for the rest of its read
            try:
                pull(PULL_PER_BATCH)
                prepare_window()
            finally:
                self._order = order
            return [f for f in self._indexes.values() if not f.done()] if not all(e[2] for e in window) else []

        def head():
            if not window[0][2]:  # the batch read next waits for its key indexes anyway: then all go
                for task in window[0][1]:
                    shard = self.shards[task.shard_id]
                    fut = self._indexes.get((shard.key_index, self.modalities or shard.keys))
                    if fut is not None:
                        fut.exception()
                prepare_window()
            pb, _, _, self._order = window.popleft()  # what the batch's read opens or extends comes first
            return pb

        # A few more batches planned ahead per batch read, while the budget has room: the first
        # batch is read at once, and the read-ahead grows to the budget over the next few.
        ahead = self._ahead_for_plan()
        if ahead is not None:
            ahead.while_waiting = while_waiting
        try:
            while True:
                pull(PULL_PER_BATCH)
                if not window:
                    return
                prepare_window()
                yield head()
        finally:
            if ahead is not None:
                ahead.while_waiting = None

    def _ahead_for_plan(self):
        """The process's ``ReadAhead`` for a plan of remote shards (made now, so the planning can
        hook into its waits); None for local ones."""
        roots = getattr(self.shards, "roots", None)
        if not roots:
            return None
        return next((a for r in roots if not urls.is_local(r) and (a := self._ahead_for_root()) is not None), None)

    def _ahead_for_root(self):
        if self._ahead is False:
            from loader.io.read_ahead import ReadAhead

            self._ahead = ReadAhead(self.options.stream_config, self.stats.stream)
        return self._ahead or None

    def _key_index(self, shard: TarSample, mods: tuple[str, ...]):
        """``read_index(shard, mods)``, waiting for it where a fetch thread reads it already."""
        fut = self._indexes.pop((shard.key_index, mods), None)
        if fut is not None:
            fut.exception()  # done, one way or the other: read_index answers from its cache or fails itself
        return read_index(shard, mods)

    def _index_soon(self, shard: TarSample, mods: tuple[str, ...]) -> bool:
        """Whether the shard's key index (with offsets) is read; if not, have it read on a fetch
        thread, so its time to first byte overlaps the reading of the batches before."""
        if index_cached(shard, mods):
            return True
        key = (shard.key_index, mods)
        fut = self._indexes.get(key)
        if fut is None:
            self._indexes[key] = self._ahead.call(read_index, shard, mods)
            return False
        if fut.done():
            del self._indexes[key]
            return True  # read (and cached), or failed: the caller meets the error itself
        return False

    def _keep(self, key: tuple[int, str], tars: _Tars) -> None:
        self._open[key] = tars
        while len(self._open) > KEEP_OPEN:
            self._open.popitem(last=False)[1].close()

    def _finish(self, key: tuple[int, str], tars: _Tars) -> None:
        """The shard's last sample was read: close its tars (checked against their sha256)."""
        self._open.pop(key, None)
        try:
            if tars.verify:
                tars.check_sha256()
        finally:
            tars.close()

    # ------------------------------------------------------------------ zip mode

    def _zip(self, shard: TarSample, task: Task, mods: tuple[str, ...], where: tuple, out: list[dict]) -> None:
        epoch, shard_id, pad, bucket = where
        n = shard.sample_count
        first = task.ranges[0][0]
        tars = self._tars(shard, task, mods, "zip", first)
        verify = tars.verify
        nexts, split = tars.nexts, tars.split
        plain = split is split_key  # PiD's rule re-joins dots: no shortcut
        fields = self._fields_of(mods)
        rest = tuple(zip(mods[1:], nexts[1:], fields[1:], strict=True))
        nxt0, mod0, fields0 = nexts[0], mods[0], fields[0]
        sid = shard_id << SID_SHIFT
        template = {"__key__": "", "__shard__": shard_id, "__index__": 0, "__epoch__": epoch, "__pad__": pad,
                    "__bucket__": bucket, "__sid__": 0}
        copy, append = template.copy, out.append
        try:
            for a, b in task.ranges:
                while tars.pos < a:
                    self._zip_skip(tars)
                for i in range(a, b):
                    got = nxt0()
                    if got is None:
                        self._zip_ended(tars, i, [None, *(nx() for _, nx, _ in rest)])
                    name = got[0]
                    if plain:  # split_key, inline: this runs once per sample
                        dot = name.find(".")
                        key, ext = (name, "") if dot < 0 else (name[:dot], name[dot + 1 :])
                        if not key or "/" in name or "\\" in name:  # format 1: "<key>.<ext>", no path
                            raise _bad_key(shard, shard.url(mod0), i, name)
                    else:
                        key, ext = split(name)
                        if _escapes(key):
                            self.stats.escaping_keys += 1
                    sample = copy()
                    sample["__key__"], sample["__index__"], sample["__sid__"] = key, i, sid | i
                    sample[fields0[ext]] = got[1]
                    stem = key + "."
                    cut = len(stem)
                    for m, nx, f in rest:
                        other = nx()
                        if other is None:
                            self._zip_ended(tars, i, [got, *([None] * len(rest))])
                        name = other[0]
                        # The twin's name is "<key>.<ext>" as a rule: its key is ours, unsplit.
                        if plain and name.startswith(stem) and "/" not in name[cut:]:
                            k, e = key, name[cut:]
                        else:
                            k, e = split(name)
                        if k != key:
                            raise TwinMismatchError(
                                f"shard {shard.path} member {i}: key {key!r} in {shard.url(mod0)} but {k!r} in "
                                f"{shard.url(m)}; the twins are out of sync - rebuild the shard or use mode='index'"
                            )
                        sample[f[e]] = other[1]
                    append(sample)
                tars.pos = b
            if verify or tars.pos >= n:
                # The task that reads a shard's last sample reads on to the tar's end: a member
                # past the manifest's count is an error, not a sample silently never served.
                while tars.pos < n:
                    self._zip_skip(tars)
                extra = [nx() for nx in nexts]
                if any(x is not None for x in extra):
                    raise CountMismatchError(
                        f"shard {shard.path}: {shard.url(mod0)} holds more than the {n} samples its manifest "
                        "counts; rebuild the manifest or the shard, or set shard_error_policy='skip'"
                    )
                self._finish((shard_id, "zip"), tars)
        except _READ_ERRORS as exc:
            raise tars.read_error(exc) from exc
        finally:
            if verify:  # never kept open: read from byte 0 each time
                tars.close()

    def _zip_skip(self, tars: _Tars) -> None:
        """Pass one tuple of members (headers read, names compared), for a task that starts later."""
        names = [t.cursor.skip() for t in tars.tars]
        if None in names:
            self._zip_ended(tars, tars.pos, names)
        keys = [tars.split(nm)[0] for nm in names]
        for m, k in zip(tars.modalities[1:], keys[1:], strict=True):
            if k != keys[0]:
                shard = tars.shard
                raise TwinMismatchError(
                    f"shard {shard.path} member {tars.pos}: key {keys[0]!r} in {shard.url(tars.modalities[0])} but "
                    f"{k!r} in {shard.url(m)}; the twins are out of sync - rebuild the shard or use mode='index'"
                )
        tars.pos += 1

    @staticmethod
    def _zip_ended(tars: _Tars, pos: int, got: list) -> None:
        shard, mods = tars.shard, tars.modalities
        lack = [m for m, x in zip(mods, got, strict=True) if x is None]
        have = [m for m, x in zip(mods, got, strict=True) if x is not None]
        if have:
            raise TwinMismatchError(
                f"shard {shard.path}: tars of {lack} end at member {pos} while {have} go on "
                f"({shard.url(lack[0])} vs {shard.url(have[0])}); rebuild the shard or use mode='index'"
            )
        raise CountMismatchError(
            f"shard {shard.path}: {shard.url(mods[0])} ends after {pos} samples, its manifest counts "
            f"{shard.sample_count}; rebuild the manifest or the shard, or set shard_error_policy='skip'"
        )

    # ------------------------------------------------------------------ index mode

    def _index(self, shard: TarSample, task: Task, mods: tuple[str, ...], where: tuple, out: list[dict]) -> None:
        opts, stats = self.options, self.stats
        wanted = [i for a, b in task.ranges for i in range(a, b)]
        if not wanted:
            return
        if not shard.key_index:
            raise MissingKeyError(f"shard {shard.path}: mode='index' needs a key index, and its manifest lists none")
        epoch, shard_id, pad, bucket = where
        tars = self._tars(shard, task, mods, "index", wanted[0])
        if tars.keys is None:
            # Keys only: a reader from byte 0 sees every member, and tars kept open carry their keys.
            tars.keys = read_index(shard, mods, offsets=False)[0]
        keys = tars.keys
        if tars.lookahead is None:
            _check_index_keys(shard, keys, self.stats)
            tars.known = dict(zip(keys, range(len(keys))))  # noqa: B905 - the same length
            tars.lookahead = [_Lookahead(nx, tars.known, opts.lookahead, stats) for nx in tars.nexts]
        takes = [r.take for r in tars.lookahead]
        fields = self._fields_of(mods)
        sid = shard_id << SID_SHIFT
        try:
            for i in wanted:
                key = keys[i]
                found = [take(key) for take in takes]
                tars.pos = i + 1
                if None not in found:  # the usual case, spelled out: this loop runs once per sample
                    sample = {"__key__": key, "__shard__": shard_id, "__index__": i, "__epoch__": epoch,
                              "__pad__": pad, "__bucket__": bucket, "__sid__": sid | i}
                    for f, (ext, data) in zip(fields, found):  # noqa: B905 - same length by construction
                        sample[f[ext]] = data
                    out.append(sample)
                    continue
                lacking = [m for m, v in zip(mods, found, strict=True) if v is None]
                for m in lacking:
                    stats.missing_keys[m] += 1
                if opts.missing_key_policy == "error":
                    raise MissingKeyError(
                        f"shard {shard.path}: key {key!r} missing from {[shard.url(m) for m in lacking]}; "
                        "set missing_key_policy='skip' or 'partial' to read on"
                    )
                log.warning("shard %s: key %r missing from %s (%s)", shard.path, key, lacking, opts.missing_key_policy)
                if opts.missing_key_policy == "skip":
                    continue
                sample = {"__key__": key, "__shard__": shard_id, "__index__": i, "__epoch__": epoch,
                          "__pad__": pad, "__bucket__": bucket, "__sid__": sid | i, "__missing__": tuple(lacking)}
                for m, v in zip(mods, found, strict=True):
                    if v is not None:
                        sample[_field(m, v[0])] = v[1]
                out.append(sample)
            if tars.verify:
                for nx in tars.nexts:  # read each tar to its end: its checksum is compared there
                    while nx() is not None:
                        pass
            if tars.verify or tars.pos >= shard.sample_count:
                self._finish((shard_id, "index"), tars)
        except _READ_ERRORS as exc:
            raise tars.read_error(exc) from exc
        finally:
            if tars.verify:  # never kept open: read from byte 0 each time
                tars.close()
