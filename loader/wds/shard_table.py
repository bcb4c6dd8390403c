"""TarSample and Wdinfo, held column-wise so millions of tars cost a few arrays, not objects."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa


def join_url(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


@dataclass(frozen=True)
class TarSample:
    """One shard: the tar at ``<root>/<modality>/<path>`` for each modality in ``keys``."""

    root: str
    path: str
    keys: tuple[str, ...]
    sample_count: int
    key_index: str | None = None  # full path/URL of the parquet key index, if any
    source_id: str = ""
    bucket: str | None = None
    shard_id: int = -1  # position in the ShardTable this came from
    sha256: dict[str, str] | None = None  # modality -> hex digest, kept only for verify="sha256"
    pid_names: bool = False  # PiD-written: member names split into key and extension as PiD's reader does
    sizes: dict[str, int] | None = None  # modality -> the tar's bytes, where the manifest lists them (remote tars)

    def url(self, modality: str) -> str:
        return join_url(self.root, modality, self.path)


class ShardTable(Sequence[TarSample]):
    """Column-wise list of shards. Strings are Arrow arrays; small lookup lists hold repeats."""

    def __init__(
        self, roots: list[str], root_ids: np.ndarray, paths: pa.Array, counts: np.ndarray,
        key_indexes: pa.Array, keys: list[tuple[str, ...]], keys_ids: np.ndarray,
        sources: list[str], source_ids: np.ndarray, buckets: list[str | None], bucket_ids: np.ndarray,
        dirs: list[str] | None = None, dir_ids: np.ndarray | None = None,
        sha256: dict[str, pa.Array] | None = None, checksums_digest: str = "",
        pid_names: np.ndarray | None = None, sizes: dict[str, np.ndarray] | None = None,
    ):
        self.roots = roots
        self.root_ids = root_ids.astype(np.int32, copy=False)
        self.paths = paths
        self.counts = counts.astype(np.int64, copy=False)
        self.key_indexes = key_indexes
        self.keys = keys
        self.keys_ids = keys_ids.astype(np.int32, copy=False)
        self.sources = sources
        self.source_ids = source_ids.astype(np.int32, copy=False)
        self.buckets = buckets
        self.bucket_ids = bucket_ids.astype(np.int32, copy=False)
        # key_indexes are relative to the manifest folder dirs[dir_ids[i]] (absolute when dirs is None)
        self.dirs = dirs
        self.dir_ids = None if dir_ids is None else dir_ids.astype(np.int32, copy=False)
        # Per-modality tar checksums, only when asked for (verify="sha256"): 64 bytes per tar each.
        self.sha256 = sha256
        # Digest of every listed tar checksum (empty without any): part of the fingerprint, so a
        # rebuild that changed a tar's content under the same name and count is another list.
        self.checksums_digest = checksums_digest
        # Per tar: listed by a PiD-written manifest (no format_version), so its member names are
        # split the way PiD's reader splits them (loader.formats.pid_names). None: none is.
        self.pid_names = None if pid_names is None else pid_names.astype(bool, copy=False)
        # Per modality, each tar's bytes as its manifest lists them (-1: not listed); None: none
        # listed. A remote tar's first ranges are asked for before its key index comes, and must
        # stop short of its end (loader.wds.twin_reader._open_early).
        self.sizes = None if sizes is None else {m: a.astype(np.int64, copy=False) for m, a in sizes.items()}

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return TarSample(
            root=self.roots[self.root_ids[i]],
            path=self.paths[i].as_py(),
            keys=self.keys[self.keys_ids[i]],
            sample_count=int(self.counts[i]),
            key_index=self._key_index(i),
            source_id=self.sources[self.source_ids[i]],
            bucket=self.buckets[self.bucket_ids[i]],
            shard_id=i,
            sha256=None if self.sha256 is None else {m: a[i].as_py() for m, a in self.sha256.items()},
            pid_names=self.pid_names is not None and bool(self.pid_names[i]),
            sizes=None if self.sizes is None else {m: int(a[i]) for m, a in self.sizes.items() if a[i] >= 0},
        )

    def _key_index(self, i: int) -> str | None:
        ki = self.key_indexes[i].as_py()
        if not ki or self.dirs is None:
            return ki or None
        return join_url(self.dirs[self.dir_ids[i]], ki)

    def __iter__(self) -> Iterator[TarSample]:
        return (self[i] for i in range(len(self)))

    @property
    def total_samples(self) -> int:
        return int(self.counts.sum())

    def fingerprint(self) -> str:
        """Identity of the shard list (paths, counts, modalities and, where the manifests list
        them, the tars' checksums): a resume state must match it.

        Computed once: the table never changes, and every checkpoint asks (a million paths
        are ~100 MB to hash).
        """
        cached = self.__dict__.get("_fingerprint")
        if cached is not None:
            return cached
        import hashlib

        h = hashlib.sha256()
        h.update(self.counts.tobytes())
        for buf in self.paths.buffers():
            if buf is not None:
                h.update(buf)
        # Modalities as a set: asking for ["image", "caption"] or ["caption", "image"] reads the
        # same shard list.
        h.update(repr([tuple(sorted(k)) for k in self.keys]).encode())
        if self.checksums_digest:  # the manifests list tar checksums: content counts too
            h.update(self.checksums_digest.encode())
        self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def __reduce__(self):
        # What rank 0 broadcasts (broadcast_object_list pickles): the columns in their compact
        # wire form, ~100x smaller for a million tars of a regular layout (loader.wds.compact).
        from loader.wds.compact import pack_ints, pack_strings

        columns = {
            "roots": self.roots, "keys": self.keys, "sources": self.sources, "buckets": self.buckets,
            "dirs": self.dirs, "checksums_digest": self.checksums_digest,
            "paths": pack_strings(self.paths), "key_indexes": pack_strings(self.key_indexes),
            "counts": pack_ints(self.counts),
            **{name: pack_ints(getattr(self, name))
               for name in ("root_ids", "keys_ids", "source_ids", "bucket_ids", "dir_ids")
               if getattr(self, name) is not None},
            "sha256": None if self.sha256 is None else {m: pack_strings(a) for m, a in self.sha256.items()},
            "fingerprint": self.__dict__.get("_fingerprint"),
            "pid_names": None if self.pid_names is None else pack_ints(self.pid_names),
            "sizes": None if self.sizes is None else {m: pack_ints(a) for m, a in self.sizes.items()},
        }
        return _unpack_shard_table, (columns,)

    def nbytes(self) -> int:
        arrays = (self.root_ids, self.counts, self.keys_ids, self.source_ids, self.bucket_ids)
        if self.dir_ids is not None:
            arrays += (self.dir_ids,)
        if self.pid_names is not None:
            arrays += (self.pid_names,)
        if self.sizes is not None:
            arrays += tuple(self.sizes.values())
        return int(sum(a.nbytes for a in arrays) + self.paths.nbytes + self.key_indexes.nbytes)


def _unpack_shard_table(columns: dict) -> ShardTable:
    from loader.wds.compact import unpack_ints, unpack_strings

    ints = {name: unpack_ints(columns[name]) if name in columns else None
            for name in ("counts", "root_ids", "keys_ids", "source_ids", "bucket_ids", "dir_ids")}
    sha256 = columns["sha256"]
    table = ShardTable(
        columns["roots"], ints["root_ids"], unpack_strings(columns["paths"]), ints["counts"],
        unpack_strings(columns["key_indexes"]), columns["keys"], ints["keys_ids"], columns["sources"],
        ints["source_ids"], columns["buckets"], ints["bucket_ids"], columns["dirs"], ints["dir_ids"],
        sha256=None if sha256 is None else {m: unpack_strings(a) for m, a in sha256.items()},
        checksums_digest=columns["checksums_digest"],
        pid_names=None if columns["pid_names"] is None else unpack_ints(columns["pid_names"]),
        sizes=None if columns.get("sizes") is None else {m: unpack_ints(a) for m, a in columns["sizes"].items()},
    )
    if columns["fingerprint"] is not None:
        table._fingerprint = columns["fingerprint"]
    return table


@dataclass(frozen=True)
class Wdinfo:
    tar_files: ShardTable
    total_key_count: int
    chunk_size: int
