"""Intake outcomes kept by file identity: a rebuild validates only new or changed files.

Each file a build validated is kept with its outcome (valid, with the pixel size for an image,
or the reason it drops its sample), keyed by modality folder and name, and valid only while the
file's identity (``FileEntry.fingerprint``: local size, mtime, ctime and inode; S3 size and
ETag) is the one it was checked under, or while its content identity (``content_identity``:
size and mtime) is and its bytes still hash to the ``sha256`` kept with the outcome: a change of
ctime or inode alone (``chmod -R``, ``chown``, a hard link, a restore that keeps mtimes) costs a
read of the file, never a decode, and a rewrite that puts the old size and mtime back is still
seen. The hash covers the bytes the check read (a whole caption or decoded image, the head a
header check or a pickle sniff looked at), since the outcome depends on them alone; an outcome
without one (a cache written before the hashes) is checked again. The cache is written into the staging folder with the
rest of the build state, so it is published with the version it describes, and a build that
stops before its commit leaves it there for the next one. A cache made under other validation
rules (``RULES_VERSION``) or at another validation level is ignored as a whole.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loader.formats.atomic import atomic_writer
from pid_platform.sharding.compute import ascending, pc

CACHE_NAME = "intake_cache.parquet"
# Bump when a check can give another outcome for the same bytes (a new rule, a fixed check):
# every cached outcome is then validated again.
RULES_VERSION = 1

# A local file's listed identity is ``size:mtime_ns:ctime_ns:inode`` (``SourceStore.list_files``);
# its content identity drops the last two, which move without the bytes changing (chmod, chown,
# a hard link, a restore). An S3 ``size:etag`` has no such parts and stays as it is.
_LOCAL_IDENTITY = r"^(\d+:\d+):\d+:\d+$"


def content_identity(fingerprint: str) -> str:
    """What of a file's listed identity says its bytes may have changed: size and mtime of a
    local file, an S3 object's size:etag."""
    return re.sub(_LOCAL_IDENTITY, r"\1", fingerprint)


def content_identities(column: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """``content_identity`` of a column of listed identities."""
    return pc.replace_substring_regex(column, pattern=_LOCAL_IDENTITY, replacement=r"\1")


def content_hash(data: bytes) -> str:
    """What an outcome keeps of the bytes its check read (a whole file, or the head a header
    check or a pickle sniff looked at): ``<how many>:<sha256>``."""
    return f"{len(data)}:{hashlib.sha256(data).hexdigest()}"


def hashed_bytes(kept: str | None) -> int | None:
    """How many leading bytes of its file a kept ``content_hash`` covers (None: not one)."""
    head, sep, _ = (kept or "").partition(":")
    return int(head) if sep and head.isdigit() else None


# What was checked, which depends on the file's extension and folder (``intake._kind``).
IMAGE = "image"  # Pillow: pixel size and EXIF orientation; decodable (full level)
CAPTION = "caption"  # .json with a prompt, or UTF-8 .txt
SNIFF = "sniff"  # an embedding's head: not pickle (only ever kept when that check passed)


@dataclass(frozen=True, slots=True)
class FileOutcome:
    kind: str
    reason: str | None = None  # short drop reason ("unreadable_image", "bad_caption"); None: valid
    width: int | None = None  # displayed size of an image (EXIF orientation applied)
    height: int | None = None
    sha256: str | None = None  # of the bytes checked, where the check read them all (``content_hash``)


CACHE_SCHEMA = pa.schema([
    ("modality", pa.string()), ("name", pa.string()), ("fingerprint", pa.string()), ("kind", pa.string()),
    ("reason", pa.string()), ("width", pa.int32()), ("height", pa.int32()), ("sha256", pa.string()),
])
# Rows per row group of a saved cache: pyarrow's default, kept so the bytes stay those every
# earlier build wrote (a tasked build's cache equals the one-process build's, byte for byte).
ROW_GROUP_ROWS = 1024 * 1024


class IntakeCache:
    """Outcomes by (modality, name), each with the identity of the bytes it was found for.

    Held as tables and files of ``CACHE_SCHEMA`` rows, read one modality at a time: the intake
    looks a whole column of a modality's names up at once (``lookup``), and ten million outcomes
    are never all in memory as objects, nor all modalities' rows at once. Later sources win for
    the same file."""

    def __init__(self, level: str, table: pa.Table | None = None) -> None:
        self.level = level
        self._sources: list[pa.Table | Path] = [] if table is None else [table]
        self._held: tuple[str, pa.Table] | None = None  # the last modality merged

    def __len__(self) -> int:
        return sum(self.of_modality(m).num_rows for m in self.modalities())

    def add(self, outcomes: pa.Table) -> None:
        """Outcomes as rows of ``CACHE_SCHEMA``; they win over those held for the same files."""
        self._sources.append(outcomes.select(CACHE_SCHEMA.names).cast(CACHE_SCHEMA))
        self._held = None

    def modalities(self) -> list[str]:
        found: set[str] = set()
        for src in self._sources:
            found.update(_modalities_of(src))
        return sorted(found)

    def of_modality(self, modality: str) -> pa.Table:
        """The outcomes held for ``modality`` (the last one given for a file wins), sorted by name."""
        if self._held is None or self._held[0] != modality:
            self._held = None  # the previous modality's rows go before these are read
            self._held = (modality, _merged([_rows_of(src, modality) for src in self._sources]))
        return self._held[1]

    def release(self) -> None:
        """Let go of the rows read for the last modality looked up (read again when needed)."""
        self._held = None

    def lookup(self, modality: str, names: pa.Array) -> pa.Table:
        """The outcome held for each of ``names`` (files of ``modality``), aligned with them: a
        row of nulls where none is held. Whether it applies (fingerprint, kind) is the caller's."""
        sub = self.of_modality(modality)
        columns = ["fingerprint", "kind", "reason", "width", "height", "sha256"]
        if sub.num_rows == len(names) and (not len(names) or bool(pc.all(pc.equal(sub["name"], names)).as_py())):
            return sub.select(columns)  # the same files in the same order (a first build's plan step)
        return sub.select(columns).take(pc.index_in(names, value_set=sub["name"].combine_chunks()))

    @classmethod
    def load(cls, paths: Iterable[Path], level: str) -> IntakeCache:
        """The outcomes of the caches at ``paths`` (later ones win) made under the current rules
        at ``level``; a missing, unreadable or other-rules cache adds nothing. Their rows are
        read when a modality is looked up."""
        cache = cls(level)
        for path in paths:
            if _usable(Path(path), level):
                cache._sources.append(Path(path))
        return cache

    def save(self, path: Path) -> Path:
        """Written a row group at a time, modality after modality (the rows of one modality at
        most are held), in row groups of ``ROW_GROUP_ROWS`` across modalities."""
        schema = CACHE_SCHEMA.with_metadata({"rules_version": str(RULES_VERSION), "validate": self.level})
        with atomic_writer(path) as fh, pq.ParquetWriter(fh, schema, compression="zstd") as writer:
            pending: list[pa.Table] = []
            rows = 0
            for m in self.modalities():
                t = self.of_modality(m)
                while t.num_rows:
                    take = min(ROW_GROUP_ROWS - rows, t.num_rows)
                    pending.append(t.slice(0, take))
                    rows += take
                    t = t.slice(take)
                    if rows == ROW_GROUP_ROWS:
                        _write_group(writer, pending, schema)
                        pending, rows = [], 0
            if pending or not self.modalities():
                _write_group(writer, pending, schema)
        self._held = None
        return Path(path)


def _write_group(writer: pq.ParquetWriter, parts: list[pa.Table], schema: pa.Schema) -> None:
    group = pa.concat_tables(parts).combine_chunks() if parts else CACHE_SCHEMA.empty_table()
    writer.write_table(group.replace_schema_metadata(schema.metadata), row_group_size=ROW_GROUP_ROWS)


def _modalities_of(src: pa.Table | Path) -> set[str]:
    try:
        if isinstance(src, Path):
            src = pq.read_table(src, columns=["modality"])
        return set(pc.unique(src["modality"]).to_pylist())
    except (OSError, ValueError, KeyError, pa.ArrowException):
        return set()  # a cache only saves work: when in doubt, validate again


def _rows_of(src: pa.Table | Path, modality: str) -> pa.Table:
    try:
        if isinstance(src, Path):
            # Row groups whose statistics exclude the modality are not read.
            names = pq.read_schema(src).names
            t = pq.read_table(src, columns=[n for n in CACHE_SCHEMA.names if n in names],
                              filters=[("modality", "=", modality)])
            if "sha256" not in names:  # a cache from before the hashes: its outcomes hold by identity only
                t = t.append_column("sha256", pa.nulls(t.num_rows, pa.string()))
            return t.cast(CACHE_SCHEMA).replace_schema_metadata(None)
        mine = pc.equal(src["modality"], modality)
        if bool(pc.all(mine).as_py()) if src.num_rows else False:
            return src  # one modality's rows (an intake's, a modality at a time): not copied
        return src.filter(mine)
    except (OSError, ValueError, KeyError, pa.ArrowException):
        return CACHE_SCHEMA.empty_table()


def _merged(parts: list[pa.Table]) -> pa.Table:
    """One modality's rows of every source, each file once (the last source's row), by name."""
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return CACHE_SCHEMA.empty_table()
    if len(parts) == 1 and ascending(parts[0]["name"]):
        return parts[0]  # as read, in its chunks: ten million rows are not copied to be one
    table = pa.concat_tables(parts).combine_chunks()
    del parts
    table = table.append_column("_order", pa.array(np.arange(table.num_rows, dtype=np.int64)))
    # A file's later rows first, then each file's first row.
    table = table.take(pc.sort_indices(table, [("name", "ascending"), ("_order", "descending")]))
    name = table["name"].combine_chunks()
    first = np.ones(table.num_rows, dtype=bool)
    if table.num_rows > 1:
        first[1:] = ~pc.equal(name[1:], name[:-1]).to_numpy(zero_copy_only=False)
    return table.filter(pa.array(first)).drop_columns(["_order"]).combine_chunks()


def _usable(path: Path, level: str) -> bool:
    """A cache file made under the current rules at ``level``, with every column."""
    try:
        schema = pq.read_schema(path)
    except (OSError, ValueError, pa.ArrowException):
        return False
    meta = schema.metadata or {}
    if meta.get(b"rules_version") != str(RULES_VERSION).encode() or meta.get(b"validate") != level.encode():
        return False
    return all(n in schema.names for n in CACHE_SCHEMA.names if n != "sha256")
