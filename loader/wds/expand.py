"""Twin-tar expansion: ``url_opener -> tar_file_expander -> group_by_keys``.

Zip mode reads every modality tar of a shard in lockstep and checks that each tuple shares one
key. Index mode is driven by the parquet key index and tolerates missing, duplicate and
out-of-order members within a bounded look-ahead. Either way, members come out renamed
``<key>.<modality>.<ext>`` (``process_sample``) and ``group_by_keys`` turns them into samples;
an end-of-shard marker keeps two shards' samples from ever merging.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

from loader.formats.errors import FormatError
from loader.formats.pid_names import split_pid_member_name
from loader.io.config import StreamStats
from loader.wds.epoch_plan import Task
from loader.wds.errors import CountMismatchError, MissingKeyError, ShardReadError, TwinMismatchError
from loader.wds.members import iter_members, split_key
from loader.wds.shard_table import TarSample

log = logging.getLogger(__name__)

EOS = {"__eos__": True}  # end-of-shard marker
MISSING_POLICIES = ("skip", "error", "partial")
DECODE_ERROR_POLICIES = ("raise", "skip")
MAX_KEYS_KEPT = 1000  # keys listed per counter in the stats; the count itself is exact


@dataclass
class ExpandStats:
    """Counts a training job can log; nothing is dropped without being counted here."""

    samples: int = 0
    shards: int = 0
    missing_keys: Counter = field(default_factory=Counter)  # modality -> keys skipped or partial
    duplicates: int = 0
    unindexed_members: int = 0
    shard_errors: int = 0
    zip_fallbacks: int = 0
    decode_errors: int = 0  # samples skipped under on_decode_error="skip"
    decode_error_keys: Counter = field(default_factory=Counter)  # their keys (the first MAX_KEYS_KEPT)
    stream: StreamStats = field(default_factory=StreamStats)  # remote reads: bytes, retries...

    def as_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream.as_dict(),
            "samples": self.samples, "shards": self.shards, "missing_keys": dict(self.missing_keys),
            "duplicates": self.duplicates, "unindexed_members": self.unindexed_members,
            "shard_errors": self.shard_errors, "zip_fallbacks": self.zip_fallbacks,
            "decode_errors": self.decode_errors, "decode_error_keys": dict(self.decode_error_keys),
        }

    def note_decode_error(self, key: str) -> None:
        self.decode_errors += 1
        if key in self.decode_error_keys or len(self.decode_error_keys) < MAX_KEYS_KEPT:
            self.decode_error_keys[key] += 1


@dataclass(frozen=True)
class ExpandOptions:
    mode: str = "zip"  # "zip" | "index"
    missing_key_policy: str = "skip"
    zip_fallback_to_index: bool = False
    lookahead: int = 1024  # index mode: members read ahead per modality while looking for a key
    shard_error_policy: str = "raise"  # "raise" | "skip"
    stream_config: Any = None
    verify: str | None = None  # "sha256": hash each tar whole while streaming, against its manifest

    def __post_init__(self) -> None:
        if self.mode not in ("zip", "index"):
            raise ValueError(f"mode must be 'zip' or 'index', got {self.mode!r}")
        if self.missing_key_policy not in MISSING_POLICIES:
            raise ValueError(f"missing_key_policy must be one of {MISSING_POLICIES}, got {self.missing_key_policy!r}")
        if self.shard_error_policy not in ("raise", "skip"):
            raise ValueError(f"shard_error_policy must be 'raise' or 'skip', got {self.shard_error_policy!r}")
        if self.verify not in (None, "sha256"):
            raise ValueError(f"verify must be None or 'sha256', got {self.verify!r}")


def _wanted(task: Task):
    for a, b in task.ranges:
        yield from range(a, b)


_INDEX_CACHE: OrderedDict[tuple, tuple] = OrderedDict()
_INDEX_CACHE_SIZE = 32   # shards: a worker reads its batches of one shard one after another
_INDEX_CACHE_LOCK = threading.Lock()


def _read_index(shard: TarSample, modalities: tuple[str, ...], offsets: bool = True):
    """``(keys, {modality: header offsets})`` from the shard's key index, or None without one.

    ``offsets=False``: keys only (the offset columns cost as much again to decode), for a reader
    that starts at the shard's first sample anyway. The last few shards' indexes are kept: an
    epoch plan hands a worker several batches of one shard, and each would read it again.
    """
    if not shard.key_index:
        return None
    key = (shard.key_index, shard.sample_count, tuple(modalities), offsets)
    with _INDEX_CACHE_LOCK:
        hit = _INDEX_CACHE.get(key)
        if hit is not None:
            _INDEX_CACHE.move_to_end(key)
            return hit
    got = _read_index_uncached(shard, modalities, offsets)
    with _INDEX_CACHE_LOCK:
        _INDEX_CACHE[key] = got
        while len(_INDEX_CACHE) > _INDEX_CACHE_SIZE:
            _INDEX_CACHE.popitem(last=False)
    return got


def _read_index_uncached(shard: TarSample, modalities: tuple[str, ...], offsets: bool):
    from loader.formats.key_index import read_key_columns
    from loader.wds.members import open_stream

    with open_stream(shard.key_index) as fh:
        data = fh.read()  # small, and parquet wants to seek: remote streams do not
    try:
        index = read_key_columns(data, modalities, offsets=offsets, origin=shard.key_index)
    except FormatError as exc:
        raise ShardReadError(f"shard {shard.path}: {exc}") from None
    keys = index.keys
    if len(keys) != shard.sample_count:
        raise CountMismatchError(
            f"shard {shard.path}: its key index {shard.key_index} lists {len(keys)} samples, the manifest "
            f"counts {shard.sample_count}; rebuild the manifest or the shard, or set shard_error_policy='skip'"
        )
    return keys, index.offsets


def _checksum(shard: TarSample, modality: str, opts: ExpandOptions) -> str | None:
    if opts.verify is None:
        return None
    return (shard.sha256 or {}).get(modality)


def _member(key: str, modality: str, ext: str, data: bytes, index: int, where: tuple) -> dict:
    epoch, shard_id, pad, bucket = where
    return {"key": key, "modality": modality, "ext": ext, "data": data, "index": index,
            "epoch": epoch, "shard_id": shard_id, "pad": pad, "bucket": bucket}


def _zip_members(shard: TarSample, task: Task, modalities: tuple[str, ...], opts: ExpandOptions,
                 stats: Any, where: tuple) -> Iterator[dict]:
    first = task.ranges[0][0]
    starts = {m: 0 for m in modalities}
    skip = first
    verify = opts.verify is not None
    if first > 0 and not verify:  # a checksum covers the whole tar: read it from byte 0
        index = _read_index(shard, modalities)
        if index is not None and all(m in index[1] for m in modalities):
            starts = {m: index[1][m][first] for m in modalities}
            skip = 0
    iters = [iter_members(shard.url(m), starts[m], opts.stream_config, stats.stream, _checksum(shard, m, opts))
             for m in modalities]
    wanted = iter(_wanted(task))
    nxt = next(wanted, None)
    pos = first - skip
    # The task that reads a shard's last sample also reads on to the tar's end: a member past
    # the manifest's count is an error, not a sample silently never served.
    to_the_end = verify or task.ranges[-1][1] >= shard.sample_count
    split = split_pid_member_name if shard.pid_names else split_key  # PiD-written: PiD's keys
    for tup in zip_longest(*iters):
        if nxt is None and not to_the_end:
            return
        if pos >= shard.sample_count:
            raise CountMismatchError(
                f"shard {shard.path}: {shard.url(modalities[0])} holds more than the {shard.sample_count} "
                "samples its manifest counts; rebuild the manifest or the shard, or set shard_error_policy='skip'"
            )
        if any(t is None for t in tup):
            have = [m for m, t in zip(modalities, tup, strict=True) if t is not None]
            lack = [m for m, t in zip(modalities, tup, strict=True) if t is None]
            raise TwinMismatchError(
                f"shard {shard.path}: tars of {lack} end at member {pos} while {have} go on "
                f"({shard.url(lack[0])} vs {shard.url(have[0])}); rebuild the shard or use mode='index'"
            )
        keys = [split(name) for name, _ in tup]
        k0 = keys[0][0]
        for m, (k, _) in zip(modalities[1:], keys[1:], strict=True):
            if k != k0:
                raise TwinMismatchError(
                    f"shard {shard.path} member {pos}: key {k0!r} in {shard.url(modalities[0])} but {k!r} in "
                    f"{shard.url(m)}; the twins are out of sync - rebuild the shard or use mode='index'"
                )
        if pos == nxt:
            for m, (key, ext), (_, data) in zip(modalities, keys, tup, strict=True):
                yield _member(key, m, ext, data, pos, where)
            nxt = next(wanted, None)
        pos += 1
    if nxt is not None:
        raise CountMismatchError(
            f"shard {shard.path}: {shard.url(modalities[0])} ends after {pos} samples, its manifest counts "
            f"{shard.sample_count}; rebuild the manifest or the shard, or set shard_error_policy='skip'"
        )


class _Lookahead:
    """One modality's members, searchable by key within a bounded read-ahead buffer."""

    def __init__(self, it: Iterator[tuple[str, bytes]], known: dict, limit: int, stats: ExpandStats):
        self.it, self.known, self.limit, self.stats = it, known, limit, stats
        self.buffer: dict[str, tuple[str, bytes]] = {}
        self.seen: set[str] = set()
        self.exhausted = False

    def take(self, key: str) -> tuple[str, bytes] | None:
        if self.buffer and key in self.buffer:
            return self.buffer.pop(key)
        if self.exhausted:
            return None
        try:
            name, data = next(self.it)
        except StopIteration:
            self.exhausted = True
            return None
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
            if read >= self.limit:
                return None
            try:
                name, data = next(self.it)
            except StopIteration:
                self.exhausted = True
                return None
            read += 1


def _index_members(shard: TarSample, task: Task, modalities: tuple[str, ...], opts: ExpandOptions,
                   stats: ExpandStats, where: tuple) -> Iterator[dict]:
    wanted = list(_wanted(task))
    # Offsets only when a reader starts past the first sample; from byte 0 it sees every member.
    seek = bool(wanted) and wanted[0] > 0 and not opts.verify
    index = _read_index(shard, modalities, offsets=seek)
    if index is None:
        raise MissingKeyError(f"shard {shard.path}: mode='index' needs a key index, and its manifest lists none")
    keys, offsets = index
    known = dict(zip(keys, range(len(keys))))  # noqa: B905 - the same length
    readers = []
    for m in modalities:
        start = min(offsets[m][i] for i in wanted) if seek and m in offsets else 0
        members = iter_members(shard.url(m), start, opts.stream_config, stats.stream, _checksum(shard, m, opts))
        readers.append(_Lookahead(members, known, opts.lookahead, stats))
    takes = [r.take for r in readers]
    epoch, shard_id, pad, bucket = where
    for i in wanted:
        key = keys[i]
        found = [take(key) for take in takes]
        if None not in found:  # the usual case, spelled out: this loop runs once per sample
            for m, (ext, data) in zip(modalities, found):  # noqa: B905 - same length by construction
                yield {"key": key, "modality": m, "ext": ext, "data": data, "index": i,
                       "epoch": epoch, "shard_id": shard_id, "pad": pad, "bucket": bucket}
            continue
        lacking = [m for m, v in zip(modalities, found, strict=True) if v is None]
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
        for m, v in zip(modalities, found, strict=True):
            if v is not None:
                yield _member(key, m, v[0], v[1], i, where)
        yield {**_member(key, None, "", b"", i, where), "missing": tuple(lacking)}
    if opts.verify is not None:
        for r in readers:  # read each tar to its end: its checksum is compared there
            for _ in r.it:
                pass


def url_opener(tasks: Iterable[tuple[int, Task]], shards) -> Iterator[dict]:
    """Attach the shard description to each task (streams open lazily, one per modality)."""
    for epoch, task in tasks:
        yield {"epoch": epoch, "task": task, "shard": shards[task.shard_id]}


def tar_file_expander(opened: Iterable[dict], modalities: tuple[str, ...] | None, opts: ExpandOptions,
                      stats: ExpandStats) -> Iterator[dict]:
    for item in opened:
        shard: TarSample = item["shard"]
        task: Task = item["task"]
        mods = modalities or shard.keys
        mode = opts.mode
        where = (item["epoch"], task.shard_id, task.pad, shard.bucket)
        last_index = -1  # member index of the last sample zip mode handed on (all modalities)
        try:
            try:
                gen = _zip_members if mode == "zip" else _index_members
                for member in gen(shard, task, mods, opts, stats, where):
                    last_index = member["index"]
                    yield member
            except TwinMismatchError:
                if not (mode == "zip" and opts.zip_fallback_to_index and shard.key_index):
                    raise
                stats.zip_fallbacks += 1
                log.warning("shard %s: zip mode mismatch after member %d, falling back to index mode",
                            shard.path, last_index)
                # Zip mode checks a whole tuple before handing any of it on, so every member up
                # to last_index is complete: index mode reads the rest of the task.
                rest = tuple((max(a, last_index + 1), b) for a, b in task.ranges if b > last_index + 1)
                yield from _index_members(shard, Task(task.shard_id, rest, task.pad), mods, opts, stats, where)
        except ShardReadError:
            if opts.shard_error_policy == "raise":
                raise
            stats.shard_errors += 1
            log.exception("skipping the rest of shard %s", shard.path)
        stats.shards += 1
        yield EOS


def process_sample(member: dict) -> dict:
    """Tag a member with its modality: ``id_0.jpg`` from ``image/`` becomes ``id_0.image.jpg``."""
    if member is EOS or member.get("modality") is None:
        return member
    ext = member["ext"]
    member["fname"] = f"{member['key']}.{member['modality']}.{ext}" if ext else f"{member['key']}.{member['modality']}"
    return member


def group_by_keys(members: Iterable[dict], stats: ExpandStats) -> Iterator[dict]:
    """Consecutive members with one key become one sample ``{"__key__", "image.jpg", ...}``."""
    current: dict | None = None
    for m in members:
        if m is EOS or (current is not None and m["key"] != current["__key__"]) or (
            current is not None and m["index"] != current["__index__"]
        ):
            if current is not None:
                stats.samples += 1
                yield current
                current = None
            if m is EOS:
                continue
        if current is None:
            current = {
                "__key__": m["key"], "__shard__": m["shard_id"], "__index__": m["index"],
                "__epoch__": m["epoch"], "__pad__": m["pad"], "__bucket__": m["bucket"],
            }
        if m.get("modality") is None:
            current["__missing__"] = m["missing"]
            continue
        suffix = m["fname"][len(m["key"]) + 1 :]  # "<modality>.<ext>"
        current[suffix] = m["data"]
    if current is not None:
        stats.samples += 1
        yield current
