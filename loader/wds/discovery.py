"""Find manifests (dataset name, path, folder or glob) and parse them into one ShardTable.

Every manifest is checked by the one wdinfo reader, ``loader.formats.wdinfo.check_wdinfo``
(counts, totals, paths that stay in the manifest's folder, format version); this module only
lays the checked columns side by side. PiD-written manifests are read too: an absolute
``root`` and no ``chunk_size`` (derived).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from loader.formats.catalog import CATALOG_NAME, Catalog, parse_catalog, read_catalog
from loader.formats.errors import FormatError
from loader.formats.layout import STATE_DIR
from loader.formats.version_pointer import POINTER_NAME, parse_pointer
from loader.formats.wdinfo import WDINFO_NAME, check_wdinfo, manifest_bucket
from loader.io import urls
from loader.mixture.definition import Mixture
from loader.wds.errors import ManifestError
from loader.wds.shard_table import ShardTable, Wdinfo, join_url

CATALOG_ENV = "PID_CATALOG"


def _is_url(s: str) -> bool:
    return urls.is_remote(s)


def find_manifests(spec: str | Sequence[str], catalog: str | None = None) -> list[str]:
    """Manifest paths for a dataset name, a wdinfo.json path/URL, a folder (searched
    recursively) or a glob; several specs may be given. Sorted, duplicates removed."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    found: set[str] = set()
    for s in specs:
        found.update(_find_one(s, catalog))
    return sorted(found)


def _bare_name(spec: str) -> bool:
    """A name as a catalog spells one: no path separator, not ``.``-relative, no glob, no URL."""
    return (bool(spec) and not _is_url(spec) and "/" not in spec and os.sep not in spec
            and not spec.startswith(".") and not any(c in spec for c in "*?["))


def _catalog_holding(spec: str, catalog: str | None) -> Catalog | None:
    """The catalog given (``catalog=``, else ``$PID_CATALOG``) when it holds the bare name ``spec``:
    such a name resolves there before the working directory, so a ``photos`` folder where the
    job runs does not replace the catalog's ``photos`` (``./photos`` names the folder)."""
    cat_path = catalog or os.environ.get(CATALOG_ENV)
    if not cat_path or not _bare_name(spec):
        return None
    cat = _catalog(cat_path)
    return cat if spec in cat.datasets or spec in cat.sources else None


def find_source_manifests(spec: str | Sequence[str], catalog: str | None = None) -> list[str]:
    """A mixture source's manifests: as ``find_manifests``, but a name the catalog holds is
    resolved as a source only (a dataset of that name is refused, never read in its place)."""
    if isinstance(spec, str):
        name = urls.without_file_scheme(spec)
        cat = _catalog_holding(name, catalog)
        if cat is not None:
            try:
                return cat.resolve(name, sources_only=True)
            except KeyError as exc:
                raise ManifestError(str(exc)) from None
    return find_manifests(spec, catalog)


def _find_one(spec: str, catalog: str | None) -> list[str]:
    spec = urls.without_file_scheme(spec)
    cat = _catalog_holding(spec, catalog)
    if cat is not None:
        return cat.resolve(spec)
    if _is_url(spec):
        if spec.endswith(".json"):
            return _all_manifests(_catalog(spec)) if spec.endswith(CATALOG_NAME) else [spec]
        return _find_under_prefix(spec.rstrip("/"))
    if os.path.isfile(spec):
        return [os.path.abspath(spec)]
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, POINTER_NAME)):
        return _follow_pointer(os.path.abspath(spec))
    if os.path.isdir(spec):
        # Escaped: a folder named like ``runs[2024]`` is a name here, not a pattern.
        hits = sorted(glob.glob(os.path.join(glob.escape(spec), "**", WDINFO_NAME), recursive=True))
        hits = [h for h in hits if STATE_DIR not in h.split(os.sep)]
        if not hits:
            raise ManifestError(f"no {WDINFO_NAME} under folder {spec}; build it first (pid-shard or Dagster)")
        return [os.path.abspath(h) for h in hits]
    if any(c in spec for c in "*?["):
        hits = sorted(glob.glob(spec, recursive=True))
        manifests = []
        for h in hits:
            manifests.extend(_find_one(h, catalog) if os.path.isdir(h) else [os.path.abspath(h)])
        if not manifests:
            raise ManifestError(f"glob {spec!r} matched no manifest")
        return manifests
    cat_path = catalog or os.environ.get(CATALOG_ENV)
    if not cat_path:
        raise ManifestError(
            f"{spec!r} is not a file, folder or glob, and no catalog is given to resolve it as a dataset "
            f"name; pass catalog=<output root or {CATALOG_NAME}> or set {CATALOG_ENV}"
        )
    try:
        return _catalog(cat_path).resolve(spec)
    except KeyError as exc:
        raise ManifestError(str(exc)) from None


def catalog_mixture(spec: str, catalog: str | None) -> Mixture | None:
    """The weighted mixture ``spec`` names in the catalog (``None``: ``spec`` is a path, URL,
    glob, a union dataset or a source; ``find_manifests`` resolves those)."""
    spec = urls.without_file_scheme(spec)
    cat = _catalog_holding(spec, catalog)
    if cat is not None:
        return cat.mixture(spec)
    if _is_url(spec) or os.path.exists(spec) or any(c in spec for c in "*?["):
        return None
    cat_path = catalog or os.environ.get(CATALOG_ENV)
    if not cat_path:
        return None
    return _catalog(cat_path).mixture(spec)


def _read_bytes(path: str) -> bytes | None:
    """The bytes at a path or URL; ``None`` when there is nothing there."""
    try:
        if _is_url(path):
            from loader.io import open_url

            with open_url(path) as fh:
                return fh.read()
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def _catalog(location: str) -> Catalog:
    """The catalog at a folder, a ``catalog.json`` path, or a URL of either."""
    if not _is_url(location):
        return read_catalog(location)
    path = location if location.endswith(".json") else join_url(location, CATALOG_NAME)
    data = _read_bytes(path)
    if data is None:
        raise ManifestError(f"catalog {path} not found; materialize dataset_catalog, or give a manifest or prefix")
    try:
        return parse_catalog(data, path)
    except FormatError as exc:
        raise ManifestError(str(exc)) from None


def _all_manifests(catalog: Catalog) -> list[str]:
    return sorted({m for source in catalog.sources for m in catalog.resolve(source)})


def _follow_pointer(prefix: str) -> list[str]:
    """The manifests of the version ``<prefix>/pid-current.json`` names (a build published to an
    object store: versions side by side, the pointer switched at the commit)."""
    where = join_url(prefix, POINTER_NAME) if _is_url(prefix) else os.path.join(prefix, POINTER_NAME)
    data = _read_bytes(where)
    if data is None:
        raise ManifestError(f"{where} not found")
    try:
        pointer = parse_pointer(data, where)
    except FormatError as exc:
        raise ManifestError(str(exc)) from None
    if _is_url(prefix):
        return [join_url(prefix, m) for m in pointer.manifest_paths()]
    return [os.path.join(prefix, *m.split("/")) for m in pointer.manifest_paths()]


def _find_under_prefix(prefix: str) -> list[str]:
    """A URL prefix: a published source (its pointer), an output root (its catalog, every
    source), or a single bucket folder (its ``wdinfo.json``), tried in that order."""
    if _read_bytes(join_url(prefix, POINTER_NAME)) is not None:
        return _follow_pointer(prefix)
    if _read_bytes(join_url(prefix, CATALOG_NAME)) is not None:
        return _all_manifests(_catalog(prefix))
    return [join_url(prefix, WDINFO_NAME)]


def _read_json(path: str) -> dict:
    try:
        if _is_url(path):
            from loader.io import open_url

            with open_url(path) as fh:
                return json.loads(fh.read())
        with open(path, "rb") as fh:
            return json.loads(fh.read())
    except FileNotFoundError:
        raise ManifestError(f"manifest {path} not found") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(f"manifest {path} is not valid JSON ({exc}); rebuild it") from None


MANIFEST_READS = 16  # remote manifests read at once


def _read_jsons(paths: list[str]) -> Iterator[dict]:
    """``_read_json`` of each path, in order; remote ones read several at once (one after
    another, each waited a whole time to first byte: 8 manifests took 0.25 s at 20 ms)."""
    if sum(1 for p in paths if _is_url(p)) < 2:
        yield from map(_read_json, paths)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(MANIFEST_READS, len(paths)), thread_name_prefix="manifests") as pool:
        futures = [pool.submit(_read_json, p) for p in paths]
        try:
            for fut in futures:
                yield fut.result()
        finally:
            for fut in futures:
                fut.cancel()


def _manifest_dir(path: str) -> str:
    return path.rsplit("/", 1)[0] if _is_url(path) else os.path.dirname(path)


def _url_join_norm(base: str, rel: str) -> str:
    """``s3://b/x/y`` + ``../z`` -> ``s3://b/x/z``: object stores take ``./`` literally."""
    return urls.join_norm(base, rel)


def _bucket_of(doc: dict, path: str) -> str | None:
    return manifest_bucket(doc, _manifest_dir(path).rstrip("/").rsplit("/", 1)[-1])


def _tar_sizes(values: list) -> np.ndarray:
    """A manifest's ``tar_bytes`` of one modality; -1 where a value is not a size (unchecked field)."""
    a = np.asarray(values)
    if a.dtype.kind in "iu":  # the usual case, at array speed (a million tars per second)
        return np.where(a > 0, a, -1).astype(np.int64)
    return np.asarray([v if type(v) is int and 0 < v < 1 << 62 else -1 for v in values], np.int64)


class _Columns:
    def __init__(self, keep_sha256: bool = False) -> None:
        self.roots: dict[str, int] = {}
        self.keys: dict[tuple[str, ...], int] = {}
        self.sources: dict[str, int] = {}
        self.buckets: dict[str | None, int] = {}
        self.root_ids: list[np.ndarray] = []
        self.keys_ids: list[np.ndarray] = []
        self.source_ids: list[np.ndarray] = []
        self.bucket_ids: list[np.ndarray] = []
        self.paths: list[pa.Array] = []
        self.counts: list[np.ndarray] = []
        self.key_indexes: list[pa.Array] = []
        self.dirs: dict[str, int] = {}
        self.dir_ids: list[np.ndarray] = []
        self.pid_names: list[np.ndarray] = []  # per manifest: PiD-written (no format_version)?
        self.chunk_size = 0
        self.keep_sha256 = keep_sha256
        self.sha256: list[tuple[int, dict[str, list]]] = []  # per manifest: (tars, modality -> digests)
        self.checksums = hashlib.sha256()  # over every listed tar checksum, for the fingerprint
        self.any_checksum = False
        self.sizes: list[tuple[int, dict[str, list]]] = []  # per manifest: (tars, modality -> tar bytes)

    @staticmethod
    def _id(table: dict, value) -> int:
        return table.setdefault(value, len(table))

    def add(self, path: str, doc: dict, modalities: Sequence[str] | None) -> None:
        cols = check_wdinfo(doc, path)  # FormatError names the manifest and the field
        data_keys, counts = cols.data_keys, cols.counts
        n = len(cols.data_list)
        if modalities:
            missing = [m for m in modalities if m not in data_keys]
            if missing:
                raise ManifestError(f"{path}: modalities {missing} requested but the manifest has {data_keys}")
            keys = tuple(modalities)
        else:
            keys = tuple(data_keys)
        root = cols.root
        mdir = _manifest_dir(path)
        if not (os.path.isabs(root) or urls.has_scheme(root)):
            root = _url_join_norm(mdir, root) if _is_url(mdir) else os.path.normpath(os.path.join(mdir, root))
        # PiD: chunk_size absent -> largest per-tar count (skips too few shards on resume, never too many).
        self.chunk_size = max(self.chunk_size, cols.chunk_size)
        # Key-index paths are relative to the manifest's folder (not to root); kept as written
        # and joined on access, so a million tars do not hold a million absolute paths.
        ki = cols.key_index
        key_index = pa.array(ki, pa.string()) if ki else pa.nulls(n, pa.string())
        if self.keep_sha256:
            lacking = [m for m in keys if m not in cols.tar_sha256 or not all(cols.tar_sha256[m])]
            if lacking and n:
                raise ManifestError(
                    f"{path}: verify='sha256' needs every tar's checksum, and tar_sha256 lacks some for "
                    f"{lacking}; rebuild the manifest with pid-shard, or read without verify"
                )
            self.sha256.append((n, {m: cols.tar_sha256[m] for m in keys if m in cols.tar_sha256}))
        for m in sorted(keys):
            digests = cols.tar_sha256.get(m)
            if digests:
                # A rebuild can change a tar (a renamed sample) and keep its name and count: its
                # checksum tells the shard lists apart, so an old resume state is refused.
                self.checksums.update(f"{len(self.counts)}:{m}:".encode())
                self.checksums.update("\n".join(d or "" for d in digests).encode())
                self.any_checksum = True
        self.pid_names.append(np.full(n, cols.format_version == 0, dtype=bool))
        # Remote tars only: a reader asks for their first ranges before their key index comes.
        remote = not urls.is_local(root)
        self.sizes.append((n, {m: cols.tar_bytes[m] for m in keys if m in cols.tar_bytes} if remote else {}))
        self.paths.append(pa.array(cols.data_list, pa.string()))
        self.counts.append(counts)
        self.key_indexes.append(key_index)
        for ids, table, value in (
            (self.root_ids, self.roots, root),
            (self.keys_ids, self.keys, keys),
            (self.source_ids, self.sources, str(cols.source or mdir)),
            (self.bucket_ids, self.buckets, _bucket_of(doc, path)),
            (self.dir_ids, self.dirs, mdir if _is_url(mdir) else os.path.abspath(mdir)),
        ):
            ids.append(np.full(n, self._id(table, value), dtype=np.int32))

    def _sha256_columns(self) -> dict[str, pa.Array] | None:
        if not self.keep_sha256:
            return None
        mods = sorted({m for _, part in self.sha256 for m in part})
        return {m: pa.array([d for n, part in self.sha256 for d in part.get(m) or [None] * n], pa.string())
                for m in mods}

    def _size_columns(self) -> dict[str, np.ndarray] | None:
        mods = sorted({m for _, part in self.sizes for m in part})
        if not mods:
            return None
        return {m: np.concatenate([_tar_sizes(part[m]) if m in part else np.full(n, -1, np.int64)
                                   for n, part in self.sizes])
                for m in mods}

    def table(self) -> ShardTable:
        def cat(parts, dtype):
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        def cat_pa(parts):
            return pa.concat_arrays(parts) if parts else pa.array([], pa.string())

        return ShardTable(
            list(self.roots), cat(self.root_ids, np.int32), cat_pa(self.paths), cat(self.counts, np.int64),
            cat_pa(self.key_indexes), list(self.keys), cat(self.keys_ids, np.int32),
            list(self.sources), cat(self.source_ids, np.int32), list(self.buckets), cat(self.bucket_ids, np.int32),
            list(self.dirs), cat(self.dir_ids, np.int32), sha256=self._sha256_columns(),
            checksums_digest=self.checksums.hexdigest() if self.any_checksum else "",
            pid_names=cat(self.pid_names, bool) if any(a.any() for a in self.pid_names) else None,
            sizes=self._size_columns(),
        )


def parse_manifests(
    paths: Iterable[str], *, modalities: Sequence[str] | None = None, aspect_ratios: Iterable[str] | None = None,
    keep_sha256: bool = False,
) -> Wdinfo:
    """One Wdinfo over all manifests (in the sorted order given); optional aspect-bucket filter.

    ``keep_sha256``: keep every tar's checksum in the table (for ``verify="sha256"``; 64 bytes
    per tar and modality), and refuse manifests that lack them.
    """
    wanted = set(aspect_ratios) if aspect_ratios is not None else None
    cols = _Columns(keep_sha256)
    used = 0
    paths = list(paths)
    for path, doc in zip(paths, _read_jsons(paths), strict=True):
        if wanted is not None and _bucket_of(doc, path) not in wanted:
            continue
        try:
            cols.add(path, doc, modalities)
        except FormatError as exc:
            raise ManifestError(str(exc)) from None
        used += 1
    if used == 0:
        raise ManifestError(
            "no manifest left to read" + (f" after the aspect-ratio filter {sorted(wanted)}" if wanted else "")
        )
    table = cols.table()
    chunk_size = cols.chunk_size
    del cols  # the per-manifest arrays; the table holds concatenated copies
    pa.default_memory_pool().release_unused()  # hand their pages back (mimalloc keeps them otherwise)
    return Wdinfo(table, table.total_samples, chunk_size)


def load_wdinfo(
    spec: str | Sequence[str], *, catalog: str | None = None, modalities: Sequence[str] | None = None,
    aspect_ratios: Iterable[str] | None = None, broadcast: bool = True, keep_sha256: bool = False,
) -> Wdinfo:
    """Discover and parse; with torch.distributed initialised only rank 0 reads, the rest receive."""
    from loader.wds.distributed import run_on_rank0_and_broadcast

    def work() -> Wdinfo:
        return parse_manifests(find_manifests(spec, catalog), modalities=modalities, aspect_ratios=aspect_ratios,
                               keep_sha256=keep_sha256)

    return run_on_rank0_and_broadcast(work) if broadcast else work()
