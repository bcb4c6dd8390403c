"""``wdinfo.json``: one manifest per bucket leaf, the commit point of a build.

PiD's keys are kept so its readers work (``data_keys``, ``data_list``, ``data_list_key_count``,
``total_key_count``, ``root``). Added: ``format_version``, ``chunk_size``, and per tar (as lists
aligned with ``data_list``) its byte sizes and sha256 per modality and its key-index path. ``root`` is relative to the manifest's folder, so moved data
keeps working; PiD-written manifests (absolute ``root``, no ``chunk_size``) are read as well.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loader.formats.atomic import atomic_write_bytes
from loader.formats.errors import FormatError, short_repr
from loader.formats.layout import WDINFO_NAME, is_bucket_folder
from loader.formats.version_pointer import sibling_version
from loader.io import urls

__all__ = [
    "FORMAT_VERSION", "WDINFO_NAME", "TarEntry", "WdinfoColumns", "WdinfoManifest", "check_wdinfo",
    "ROOT_MODES", "derive_chunk_size", "manifest_bucket", "manifest_root", "parse_wdinfo", "read_wdinfo",
    "rewrite_root", "root_base", "write_wdinfo",
]
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TarEntry:
    path: str  # relative to <root>/<modality>/
    count: int
    bytes: dict[str, int] = field(default_factory=dict)  # modality -> tar size
    sha256: dict[str, str] = field(default_factory=dict)  # modality -> hex digest
    key_index: str | None = None  # relative to the manifest folder


@dataclass(frozen=True)
class WdinfoManifest:
    data_keys: list[str]
    tars: list[TarEntry]
    root: str = "."
    chunk_size: int = 0
    format_version: int = FORMAT_VERSION
    bucket: str | None = None
    source: str | None = None
    # Set when read from disk: the folder the manifest lives in.
    manifest_dir: str | None = None
    # The modalities the shards were cut with, when others were added later without re-cutting
    # (the size bound holds for these); None: all of ``data_keys``.
    plan_modalities: list[str] | None = None

    @property
    def data_list(self) -> list[str]:
        return [t.path for t in self.tars]

    @property
    def total_key_count(self) -> int:
        return sum(t.count for t in self.tars)

    def root_path(self) -> str:
        """Absolute (or URL) root the tar paths hang from."""
        if os.path.isabs(self.root) or urls.has_scheme(self.root) or self.manifest_dir is None:
            return self.root
        return os.path.normpath(os.path.join(self.manifest_dir, self.root))

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format_version": self.format_version,
            "root": self.root,
            "data_keys": list(self.data_keys),
            "data_list": self.data_list,
            "data_list_key_count": [t.count for t in self.tars],
            "total_key_count": self.total_key_count,
            "chunk_size": self.chunk_size,
        }
        if self.bucket is not None:
            doc["bucket"] = self.bucket
        if self.source is not None:
            doc["source"] = self.source
        if self.plan_modalities is not None:
            doc["plan_modalities"] = list(self.plan_modalities)
        # Per-tar details are columnar (one list per field, aligned with data_list): parsing
        # a million tars then costs a few flat lists, not a million small dicts.
        doc["tar_bytes"] = {m: [t.bytes.get(m, 0) for t in self.tars] for m in self.data_keys}
        doc["tar_sha256"] = {m: [t.sha256.get(m, "") for t in self.tars] for m in self.data_keys}
        doc["key_index"] = [t.key_index for t in self.tars]
        return doc


def derive_chunk_size(counts: list[int]) -> int:
    # PiD converts "samples read" to "shards read" by dividing by chunk_size; the largest
    # count makes that conversion skip too few shards rather than too many, so none is lost.
    # A build writes one value, the max over all its buckets, into every manifest: PiD keeps
    # the *first* manifest's chunk_size for a whole dataset, and whichever comes first is safe.
    return max(counts, default=0)


# -- roots -------------------------------------------------------------------------------------
#
# "relative" (the default): every manifest's root is ".", its own folder, so a moved or copied
# output keeps working for our reader. PiD's reader joins root to its working directory, so for
# a PiD job the roots must be absolute: "absolute" writes the output folder's absolute path, and
# a URL (s3://bucket/prefix) says where the output folder is (or will be) published.

ROOT_MODES = ("relative", "absolute")
ROOT_URL_SCHEMES = ("s3", "http", "https", "hf")  # what loader.io.opener opens


def root_base(mode: str, out: str | os.PathLike[str]) -> str | None:
    """What the roots of a build at ``out`` hang from: None (relative), the absolute path of
    ``out`` (``"absolute"``), or ``mode`` itself when it is a URL such as ``s3://bucket/prefix``.
    """
    if mode == "relative":
        return None
    if mode == "absolute":
        return os.path.abspath(out)
    scheme, rest = urls.split_scheme(mode)
    if scheme and scheme not in ROOT_URL_SCHEMES:
        raise FormatError(
            f"manifest root {short_repr(mode)}: the loader reads {', '.join(s + '://' for s in ROOT_URL_SCHEMES)} "
            "URLs (a root it cannot open would make every manifest unreadable); give one of those, 'relative' "
            "or 'absolute'"
        )
    if scheme and rest.strip("/"):
        if "@" in rest.split("/", 1)[0] or "?" in mode or "#" in mode:
            raise FormatError(f"manifest root {short_repr(mode)} carries credentials, a query or a fragment; give a plain URL")
        return mode.rstrip("/")
    raise FormatError(
        f"manifest root {short_repr(mode)}: use 'relative' (the default), 'absolute' (the output folder's absolute "
        "path) or the URL the output folder is published at (s3://bucket/prefix)"
    )


def manifest_root(base: str | None, leaf: str) -> str:
    """The ``root`` of the manifest in ``<out>/<leaf>`` (``leaf`` "" in flat mode) under ``base``."""
    if base is None:
        return "."
    if not leaf:
        return base
    return urls.join(base, leaf)


def rewrite_root(path: str | os.PathLike[str], root: str) -> bool:
    """Set the ``root`` of the manifest at ``path``, every other field kept as written (also a
    PiD-written one's); True when it changed. The manifest is checked first, and replaced atomically."""
    path = Path(path)
    try:
        doc = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}: invalid JSON ({exc}); rebuild the manifest") from None
    check_wdinfo(doc, str(path))
    if doc.get("root") == root:
        return False
    doc = {**doc, "root": root} if "root" in doc else {"root": root, **doc}
    check_wdinfo(doc, str(path))
    atomic_write_bytes(path, json.dumps(doc, separators=(",", ":")).encode() + b"\n")
    return True


def write_wdinfo(folder: str | os.PathLike[str], manifest: WdinfoManifest) -> Path:
    path = Path(folder) / WDINFO_NAME
    # Compact: a manifest can list a million tars; `python -m json.tool` pretty-prints it.
    data = json.dumps(manifest.to_json(), separators=(",", ":")).encode() + b"\n"
    atomic_write_bytes(path, data)
    return path


_ESCAPING = re.compile(r"(?:^|\n|/)\.\.(?:/|\n|$)|(?:^|\n)/|\\")


def _escaping_entry(paths: list, field_name: str, origin: str) -> None:
    """Refuse a path list with an absolute entry or one that climbs out with ``..``.

    Substring tests over the joined list: a million entries cost a few ms, not a Python loop
    per entry.
    """
    try:
        joined = "\n".join(paths)
    except TypeError:
        raise FormatError(f"{origin}: {field_name} must list strings (paths)") from None
    if joined.count("\n") != len(paths) - 1 and paths:
        raise FormatError(f"{origin}: a {field_name} entry holds a line break; rebuild the manifest")
    # Substring tests run at memory speed; the regular expression only confirms a suspect.
    suspect = ".." in joined or "\\" in joined or joined.startswith("/") or "\n/" in joined
    if suspect and _ESCAPING.search(joined) is not None:
        entry = next(p for p in paths if _ESCAPING.search(p))  # the error path: a loop is fine
        raise FormatError(
            f"{origin}: {field_name} entry {entry!r} leaves the manifest's folder (absolute, '..' or a "
            "backslash); entries are relative paths below it - refusing to read files elsewhere"
        )


@dataclass(frozen=True)
class WdinfoColumns:
    """A manifest checked against everything the format states, held as columns.

    The one reader of ``wdinfo.json``: :func:`parse_wdinfo` (one ``TarEntry`` per tar, for the
    build and its checks) and the training loader's discovery (a million tars as arrays) both
    start here, so neither accepts what the other refuses.
    """

    data_keys: list[str]
    data_list: list[str]
    counts: np.ndarray  # int64, aligned with data_list
    root: str  # as written: relative to the manifest folder, absolute (PiD) or a URL
    chunk_size: int
    format_version: int
    bucket: str | None
    source: str | None
    key_index: list[str | None] | None  # relative to the manifest folder
    tar_bytes: dict[str, list]  # modality -> sizes (lists of another length are left out)
    tar_sha256: dict[str, list]  # modality -> hex digests ("" where unknown)
    plan_modalities: list[str] | None = None  # what the shards were cut with, when not all data_keys

    @property
    def total_key_count(self) -> int:
        return int(self.counts.sum())


def check_wdinfo(doc: Any, origin: str) -> WdinfoColumns:
    """Check a parsed ``wdinfo.json`` against the format; ``FormatError`` names what is wrong.

    Refused: a ``format_version`` newer than this reader; negative, fractional or misaligned
    counts; a ``total_key_count`` that is not their sum; a relative ``root`` (but a sibling
    version's folder, ``version_pointer.sibling_root``), a ``data_list``
    or ``key_index`` entry or a ``data_keys`` name that leaves the manifest's folder (absolute
    roots, as PiD writes them, and URLs are accepted); a ``key_index`` list of another length.
    """
    if not isinstance(doc, dict):
        raise FormatError(f"{origin}: not a wdinfo manifest (a JSON object is expected)")
    version = doc.get("format_version", 0)  # 0: written by PiD
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise FormatError(f"{origin}: format_version {version!r} is not a version number; rebuild the manifest")
    if version > FORMAT_VERSION:
        raise FormatError(
            f"{origin}: format_version {version} is newer than this reader (it reads up to {FORMAT_VERSION}); "
            "upgrade pid-platform's loader to read it"
        )
    try:
        data_keys = list(doc["data_keys"])
        data_list = list(doc["data_list"])
        raw_counts = doc["data_list_key_count"]
        counts = np.asarray(raw_counts)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(
            f"{origin}: not a wdinfo manifest (missing or malformed {exc}); "
            "expected keys data_keys, data_list, data_list_key_count"
        ) from None
    n = len(data_list)
    if counts.ndim != 1 or len(counts) != n:
        raise FormatError(f"{origin}: data_list has {n} entries but data_list_key_count has {counts.size}")
    if n and counts.dtype.kind not in "iu":
        raise FormatError(f"{origin}: data_list_key_count must list whole numbers (samples per tar)")
    counts = counts.astype(np.int64, copy=False) if n else np.zeros(0, np.int64)
    if n and counts.min() < 0:
        bad = int(np.flatnonzero(counts < 0)[0])
        raise FormatError(
            f"{origin}: data_list_key_count[{bad}] is {int(counts[bad])} for {data_list[bad]!r}; "
            "a tar holds 0 or more samples - rebuild the manifest"
        )
    total = doc.get("total_key_count")
    if total is not None and (not isinstance(total, int) or total != int(counts.sum())):
        raise FormatError(
            f"{origin}: total_key_count {total!r} != sum of data_list_key_count {int(counts.sum())}; "
            "the manifest is inconsistent - rebuild it"
        )
    if not data_keys or not all(isinstance(k, str) and k and k not in (".", "..") for k in data_keys) or any(
        "/" in k or "\\" in k for k in data_keys
    ):
        raise FormatError(f"{origin}: data_keys {data_keys!r} must be modality folder names (no '/', not '..')")
    root = doc.get("root", ".")
    if not isinstance(root, str):
        raise FormatError(f"{origin}: root must be a string, got {root!r}")
    if not (os.path.isabs(root) or urls.has_scheme(root)) and sibling_version(root) is None:
        norm = posixpath.normpath(root.replace("\\", "/"))
        if norm == ".." or norm.startswith("../"):
            raise FormatError(
                f"{origin}: root {root!r} leaves the manifest's folder; a relative root must stay below "
                "it (write an absolute root or URL to read data elsewhere)"
            )
    _escaping_entry(data_list, "data_list", origin)
    key_index = doc.get("key_index") or None
    if key_index is not None:
        if not isinstance(key_index, list) or len(key_index) != n:
            got = len(key_index) if isinstance(key_index, list) else type(key_index).__name__
            raise FormatError(f"{origin}: key_index has {got} entries but data_list has {n}")
        _escaping_entry([k for k in key_index if k is not None], "key_index", origin)
    chunk = doc.get("chunk_size")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0):
        raise FormatError(f"{origin}: chunk_size {chunk!r} must be a whole number >= 0")
    plan_modalities = doc.get("plan_modalities")
    if plan_modalities is not None and (not isinstance(plan_modalities, list)
                                        or not all(isinstance(m, str) and m in data_keys for m in plan_modalities)):
        raise FormatError(f"{origin}: plan_modalities {short_repr(plan_modalities)} must list some of data_keys "
                          f"{data_keys}; rebuild the manifest")
    per_tar = {}
    for name in ("tar_bytes", "tar_sha256"):
        value = doc.get(name) or {}
        if not isinstance(value, dict):
            raise FormatError(f"{origin}: {name} must map modality -> list")
        per_tar[name] = {m: v for m, v in value.items() if isinstance(v, list) and len(v) == n}
    return WdinfoColumns(
        data_keys=data_keys,
        data_list=data_list,
        counts=counts,
        root=root,
        chunk_size=chunk or (int(counts.max()) if n else 0),  # derive_chunk_size, without a list
        format_version=version,
        bucket=doc.get("bucket"),
        source=doc.get("source"),
        key_index=key_index,
        tar_bytes=per_tar["tar_bytes"],
        tar_sha256=per_tar["tar_sha256"],
        plan_modalities=plan_modalities,
    )


def manifest_bucket(doc: Any, folder_name: str) -> str | None:
    """The aspect bucket a manifest lists: its ``bucket`` field, else (PiD writes none) the name
    of the folder it lies in when that is a bucket folder. Cheap: read before the full check, so
    a filter on buckets skips the manifests it leaves out."""
    bucket = doc.get("bucket") if isinstance(doc, dict) else None
    if bucket:
        return bucket
    return folder_name if is_bucket_folder(folder_name) else None


def parse_wdinfo(doc: dict[str, Any], manifest_dir: str | None, origin: str) -> WdinfoManifest:
    cols = check_wdinfo(doc, origin)
    n = len(cols.data_list)
    key_index = cols.key_index or [None] * n
    counts = cols.counts.tolist()
    tars = [
        TarEntry(
            p, c, {m: int(v[i]) for m, v in cols.tar_bytes.items()},
            {m: v[i] for m, v in cols.tar_sha256.items() if v[i]}, key_index[i],
        )
        for i, (p, c) in enumerate(zip(cols.data_list, counts, strict=True))
    ]
    return WdinfoManifest(
        data_keys=cols.data_keys,
        tars=tars,
        root=cols.root,
        chunk_size=cols.chunk_size,
        format_version=cols.format_version,
        bucket=cols.bucket,
        source=cols.source,
        manifest_dir=manifest_dir,
        plan_modalities=cols.plan_modalities,
    )


def read_wdinfo(path: str | os.PathLike[str]) -> WdinfoManifest:
    path = Path(path)
    try:
        doc = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}: invalid JSON ({exc}); rebuild the manifest") from None
    return parse_wdinfo(doc, str(path.parent), str(path))
