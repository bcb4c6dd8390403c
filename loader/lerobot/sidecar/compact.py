"""The compact index: a sidecar's arrays as read-only memory-mapped files, small and shared.

Layout: one directory per (compact generation, sidecar content digest), one file per MP4::

    $HF_LEROBOT_HOME/streaming-indexes/g<GEN>-<sha256 of the NPZ>/<file id>.cidx

*Per-source files* (not one file per rank subset): a rank converts and maps only the MP4 files
it needs, and ranks whose subsets overlap still map the same pages, because a source's file
name depends only on the sidecar's bytes. Each file is written once, under a process lock,
through a temporary name and a rename; an existing file is never rewritten in place, so a
process that has it mapped keeps valid pages. A new sidecar (other digest) or a new compact
format (other generation) gets a new directory and is converted on first open; old directories
are left for whoever still maps them (delete them when no job runs).

A ``.cidx`` file::

    b"PIDCIDX1"  uint64-LE header length  header JSON  padding  array data (8-byte aligned)

The header lists each array as ``dense`` (dtype, offset from the data start, count) or
``range`` (start, step, count: a constant when step == 0). Integer arrays are stored densely in
the smallest integer dtype holding every value exactly; constants and arithmetic progressions
(durations, composition offsets, sizes, evenly spaced byte offsets) as a range;
``sample_pts`` stays float64 and ``sync_samples`` stays dense.

Views are read-only and keep the logical sample count: a dense array is an ``np.ndarray`` over
the mapping (``writeable=False``, in its compact dtype), a constant is
``np.broadcast_to(value, (count,))`` (int64, no memory), a progression is materialised once as
a read-only int64 array. Compact dtypes are exact but narrow: cast (``.astype(np.int64)`` or
``int(x)``) before arithmetic that can leave their range.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loader.formats.atomic import TMP_MARKER, atomic_writer

from .errors import CompactIndexError
from .paths import default_index_root
from .process_lock import process_lock
from .schema import ARRAY_NAMES, Sidecar, SidecarFile, SidecarManifest, sidecar_digest

log = logging.getLogger(__name__)

COMPACT_GENERATION = 1   # bump when the .cidx layout or encoding changes
MAGIC = b"PIDCIDX1"
SUFFIX = ".cidx"
_ALIGN = 8   # enough for every dtype; keeps per-file padding small
_PREFIX = struct.Struct("<8sQ")
_INT_DTYPES = (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.int64)
_DENSE_ONLY = ("sample_pts", "sync_samples")
DEFAULT_CONVERT_LOCK_TIMEOUT_S = 600.0
DEFAULT_MAX_OPEN_MAPS = 256   # each mapping holds one file descriptor


# -- encoding ------------------------------------------------------------------------------------

def smallest_int_dtype(a: np.ndarray) -> np.dtype:
    """The smallest integer dtype (unsigned preferred at equal size) holding every value of ``a``."""
    if a.size == 0:
        return np.dtype(np.uint8)
    lo, hi = int(a.min()), int(a.max())
    for dt in _INT_DTYPES:
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return np.dtype(dt)
    return np.dtype(np.int64)


def as_range(a: np.ndarray) -> tuple[int, int] | None:
    """(start, step) when ``a`` is constant or an arithmetic progression (n >= 1), else None."""
    n = len(a)
    if n == 0:
        return None
    start = int(a[0])
    step = int(a[1]) - start if n > 1 else 0
    if n > 2 and not np.all(np.diff(a) == step):
        return None
    # Check the reconstruction too: np.diff on int64 could wrap for extreme values.
    if n > 1 and int(a[-1]) != start + step * (n - 1):
        return None
    return start, step


def encode_arrays(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Array specs for a .cidx header and the dense payloads (offsets relative to data start)."""
    specs: dict[str, Any] = {}
    payloads: list[np.ndarray] = []
    offset = 0
    for name in ARRAY_NAMES:
        a = np.asarray(arrays[name])
        n = len(a)
        if name != "sample_pts" and name not in _DENSE_ONLY:
            r = as_range(a)
            if r is not None:
                specs[name] = {"kind": "range", "start": r[0], "step": r[1], "count": n}
                continue
        if name == "sample_pts":
            data = np.ascontiguousarray(a, dtype="<f8")
        else:
            dt = smallest_int_dtype(a).newbyteorder("<")
            data = np.ascontiguousarray(a.astype(dt, casting="unsafe"))
            if not np.array_equal(data, a):   # cannot happen with a correct dtype; be sure
                raise AssertionError(f"{name}: {dt} does not hold the values exactly")
        specs[name] = {"kind": "dense", "dtype": data.dtype.str, "offset": offset, "count": n}
        payloads.append(data)
        offset = _align(offset + data.nbytes)
    return specs, payloads


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def write_cidx(path: Path, header: dict[str, Any], payloads: Sequence[np.ndarray]) -> int:
    """Write a .cidx file atomically; return its size."""
    hjson = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    data_start = _align(_PREFIX.size + len(hjson))
    pos = 0
    with atomic_writer(path) as fh:
        fh.write(_PREFIX.pack(MAGIC, len(hjson)))
        fh.write(hjson)
        fh.write(b"\0" * (data_start - _PREFIX.size - len(hjson)))
        for p in payloads:
            pad = _align(pos) - pos
            fh.write(b"\0" * pad)
            fh.write(p.tobytes())
            pos += pad + p.nbytes
    return data_start + pos


# -- views ---------------------------------------------------------------------------------------

class CompactArrays(Mapping[str, np.ndarray]):
    """The six arrays of one MP4 file as read-only views (constants materialise lazily)."""

    def __init__(self, rel: str, specs: Mapping[str, Any], buf: mmap.mmap, data_start: int):
        self.rel = rel
        self._specs = dict(specs)
        self._buf = buf
        self._data_start = data_start
        self._cache: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._cache:
            return self._cache[name]
        spec = self._specs[name]
        n = int(spec["count"])
        if spec["kind"] == "dense":
            dt = np.dtype(spec["dtype"])
            if n == 0:
                arr = np.empty(0, dt)
            else:
                arr = np.frombuffer(self._buf, dtype=dt, count=n, offset=self._data_start + int(spec["offset"]))
        elif int(spec["step"]) == 0:
            arr = np.broadcast_to(np.int64(spec["start"]), (n,))
        else:
            arr = np.int64(spec["start"]) + np.int64(spec["step"]) * np.arange(n, dtype=np.int64)
        arr.flags.writeable = False
        self._cache[name] = arr
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(ARRAY_NAMES)

    def __len__(self) -> int:
        return len(ARRAY_NAMES)

    @property
    def sample_count(self) -> int:
        return int(self._specs["sample_pts"]["count"])

    def kind(self, name: str) -> str:
        """``dense`` (with its dtype, e.g. ``dense:<u2``), ``constant`` or ``range``."""
        spec = self._specs[name]
        if spec["kind"] == "dense":
            return f"dense:{np.dtype(spec['dtype']).name}"
        return "constant" if int(spec["step"]) == 0 else "range"

    def stored_nbytes(self, name: str) -> int:
        spec = self._specs[name]
        return np.dtype(spec["dtype"]).itemsize * int(spec["count"]) if spec["kind"] == "dense" else 0


@dataclass
class _Mapped:
    buf: mmap.mmap
    header: dict[str, Any]
    data_start: int
    size: int


def _read_cidx(path: Path, *, digest: str, entry: SidecarFile) -> _Mapped:
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < _PREFIX.size:
            raise CompactIndexError(f"{path}: truncated compact index ({size} bytes)")
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    magic, hlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC or _PREFIX.size + hlen > size:
        raise CompactIndexError(f"{path}: not a compact index file (bad magic or header)")
    try:
        header = json.loads(buf[_PREFIX.size:_PREFIX.size + hlen])
    except ValueError as e:
        raise CompactIndexError(f"{path}: unreadable compact index header ({e})") from e
    if (header.get("generation") != COMPACT_GENERATION or header.get("sidecar_digest") != digest
            or header.get("id") != entry.id or header.get("path") != entry.path):
        raise CompactIndexError(f"{path}: belongs to another sidecar, file or compact generation")
    data_start = _align(_PREFIX.size + hlen)
    for name in ARRAY_NAMES:
        spec = header["arrays"].get(name)
        count = None if spec is None else int(spec["count"])
        if count is None or (count > entry.sample_count if name == "sync_samples"
                             else count != entry.sample_count):
            raise CompactIndexError(f"{path}: array {name} missing or with the wrong length")
        if spec["kind"] == "dense":
            end = data_start + int(spec["offset"]) + np.dtype(spec["dtype"]).itemsize * int(spec["count"])
            if end > size:
                raise CompactIndexError(f"{path}: truncated (array {name} ends past the file)")
    return _Mapped(buf, header, data_start, size)


# -- the index -----------------------------------------------------------------------------------

@dataclass
class CompactIndex:
    """A sidecar's compact, memory-mapped index for some or all of its MP4 files."""

    sidecar_path: Path
    digest: str
    directory: Path
    info: SidecarManifest
    files: list[str]
    max_open_maps: int = DEFAULT_MAX_OPEN_MAPS
    _maps: OrderedDict[str, _Mapped] = field(default_factory=OrderedDict, repr=False)
    _views: OrderedDict[str, CompactArrays] = field(default_factory=OrderedDict, repr=False)
    _opened: frozenset[str] = field(default=frozenset(), repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._opened = frozenset(self.files)

    # Mappings and locks do not pickle; a DataLoader worker (spawn) maps the same files again.
    def __getstate__(self) -> dict[str, Any]:
        return {"sidecar_path": self.sidecar_path, "digest": self.digest,
                "directory": self.directory, "info": self.info, "files": self.files,
                "max_open_maps": self.max_open_maps}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    @classmethod
    def open(cls, npz_path: str | os.PathLike[str], *, cache_root: str | os.PathLike[str] | None = None,
             files: Iterable[str] | None = None,
             lock_timeout_s: float | None = DEFAULT_CONVERT_LOCK_TIMEOUT_S,
             max_open_maps: int = DEFAULT_MAX_OPEN_MAPS) -> CompactIndex:
        """Convert (first time only) and open the compact index of the sidecar at ``npz_path``.

        ``files``: the relative MP4 paths this process needs (default: all); only those are
        converted and only those can be asked for. ``cache_root`` defaults to
        ``$HF_LEROBOT_HOME/streaming-indexes``.
        """
        npz_path = Path(npz_path)
        root = Path(cache_root) if cache_root is not None else default_index_root()
        digest = sidecar_digest(npz_path)
        with Sidecar(npz_path) as sc:
            info = sc.info
            wanted = info.paths if files is None else sorted(set(files))
            for rel in wanted:
                info.file(rel)   # KeyError naming the file when it is not in the sidecar
            directory = root / f"g{COMPACT_GENERATION}-{digest}"
            idx = cls(npz_path, digest, directory, info, list(wanted), max_open_maps=max_open_maps)
            missing = [rel for rel in wanted if not idx._path(rel).exists()]
            if missing:
                idx._convert(sc, missing, lock_timeout_s)
        return idx

    @property
    def manifest(self) -> dict[str, Any]:
        return self.info.to_dict()

    def file(self, rel: str) -> SidecarFile:
        return self.info.file(rel)

    def sample_count(self, rel: str) -> int:
        return self.info.file(rel).sample_count

    def path_of(self, rel: str) -> Path:
        """The .cidx file holding ``rel``'s arrays."""
        return self._path(rel)

    def _path(self, rel: str) -> Path:
        return self.directory / f"{self.info.file(rel).id}{SUFFIX}"

    def arrays(self, rel: str) -> CompactArrays:
        """Read-only views of ``rel``'s six arrays (see the module docstring for dtypes)."""
        with self._lock:
            return self._arrays(rel)

    def _arrays(self, rel: str) -> CompactArrays:
        view = self._views.get(rel)
        if view is not None:
            self._views.move_to_end(rel)
            return view
        if rel not in self._opened:
            raise KeyError(f"{rel!r} was not opened: pass it in files= (opened: {len(self.files)} files)")
        m = self._map(rel)
        view = CompactArrays(rel, m.header["arrays"], m.buf, m.data_start)
        self._views[rel] = view
        # Dropping our reference is enough: views handed out keep their mapping alive.
        while len(self._views) > self.max_open_maps:
            old, _ = self._views.popitem(last=False)
            self._maps.pop(old, None)
        return view

    def _map(self, rel: str) -> _Mapped:
        entry = self.info.file(rel)
        path = self._path(rel)
        try:
            m = _read_cidx(path, digest=self.digest, entry=entry)
        except (CompactIndexError, FileNotFoundError) as e:
            # A damaged or vanished file is rewritten (by rename: mapped pages stay valid).
            log.warning("rebuilding compact index %s: %s", path, e)
            with Sidecar(self.sidecar_path) as sc:
                if sidecar_digest(self.sidecar_path) != self.digest:
                    raise CompactIndexError(
                        f"{self.sidecar_path} changed since this index was opened; open it again") from e
                self._convert(sc, [rel], DEFAULT_CONVERT_LOCK_TIMEOUT_S, force=True)
            m = _read_cidx(path, digest=self.digest, entry=entry)
        self._maps[rel] = m
        return m

    def _convert(self, sc: Sidecar, rels: Sequence[str], lock_timeout_s: float | None,
                 force: bool = False) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        lock = self.directory / ".lock"
        with process_lock(lock, timeout_s=lock_timeout_s,
                          purpose=f"convert {self.sidecar_path.name} to a compact index"):
            # Under the lock nobody else converts here: temporary files are from a dead process.
            for tmp in self.directory.glob(f"*{SUFFIX}{TMP_MARKER}*"):
                tmp.unlink(missing_ok=True)
            done = 0
            for rel in rels:
                path = self._path(rel)
                if path.exists() and not force:
                    continue   # another process converted it while we waited
                entry = self.info.file(rel)
                specs, payloads = encode_arrays(sc.arrays(rel))
                header = {"generation": COMPACT_GENERATION, "sidecar_digest": self.digest,
                          "id": entry.id, "path": entry.path, "arrays": specs}
                write_cidx(path, header, payloads)
                done += 1
            if done:
                log.info("converted %d of %d files of %s into %s", done, len(rels),
                         self.sidecar_path, self.directory)

    def close(self) -> None:
        """Forget the mappings (views handed out stay valid until they are dropped)."""
        with self._lock:
            self._views.clear()
            self._maps.clear()

    def __enter__(self) -> CompactIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- size report (for bench/) --------------------------------------------------------------------

@dataclass
class CompactReport:
    files: int
    samples: int
    int64_bytes: int            # the six arrays as schema-v3 stores them (8 bytes per value)
    compact_bytes: int          # the .cidx files on disk (headers and alignment included)
    compact_array_bytes: int    # dense payloads only
    npz_bytes: int              # the (deflated) NPZ file
    kinds: dict[str, dict[str, int]]   # array name -> {"constant": files, "range": .., "dense:uint16": ..}

    @property
    def ratio(self) -> float:
        """compact / int64 (smaller is better)."""
        return self.compact_bytes / self.int64_bytes if self.int64_bytes else 0.0

    def format(self) -> str:
        lines = [
            f"compact index: {self.files} files, {self.samples} samples",
            f"  int64 arrays   {self.int64_bytes:>12,d} B",
            f"  compact files  {self.compact_bytes:>12,d} B  ({self.ratio:.3f} x int64; "
            f"{self.compact_array_bytes:,d} B array data)",
            f"  sidecar NPZ    {self.npz_bytes:>12,d} B  (deflated)",
        ]
        for name in ARRAY_NAMES:
            kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.kinds.get(name, {}).items()))
            lines.append(f"  {name:<28} {kinds}")
        return "\n".join(lines)


def compact_report(npz_path: str | os.PathLike[str], *,
                   cache_root: str | os.PathLike[str] | None = None) -> CompactReport:
    """Open (converting if needed) the whole compact index and compare its size with int64."""
    idx = CompactIndex.open(npz_path, cache_root=cache_root)
    int64_bytes = compact_bytes = array_bytes = samples = 0
    kinds: dict[str, dict[str, int]] = {name: {} for name in ARRAY_NAMES}
    for rel in idx.files:
        view = idx.arrays(rel)
        samples += view.sample_count
        compact_bytes += idx.path_of(rel).stat().st_size
        for name in ARRAY_NAMES:
            int64_bytes += 8 * len(view[name])
            array_bytes += view.stored_nbytes(name)
            k = view.kind(name)
            kinds[name][k] = kinds[name].get(k, 0) + 1
    idx.close()
    return CompactReport(files=len(idx.files), samples=samples, int64_bytes=int64_bytes,
                         compact_bytes=compact_bytes, compact_array_bytes=array_bytes,
                         npz_bytes=Path(npz_path).stat().st_size, kinds=kinds)


def print_compact_report(npz_path: str | os.PathLike[str], *,
                         cache_root: str | os.PathLike[str] | None = None) -> CompactReport:
    """Print ``compact_report`` (what bench/bench_mp4_index.py calls) and return it."""
    report = compact_report(npz_path, cache_root=cache_root)
    print(report.format())
    return report
