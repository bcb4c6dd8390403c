"""``wdinfo.json``: one manifest per bucket leaf, the commit point of a build.

PiD's keys are kept so its readers work (``data_keys``, ``data_list``, ``data_list_key_count``,
``total_key_count``, ``root``). Added: ``format_version``, ``chunk_size``, and per tar (as lists
aligned with ``data_list``) its byte sizes and sha256 per modality and its key-index path. ``root`` is relative to the manifest's folder, so moved data
keeps working; PiD-written manifests (absolute ``root``, no ``chunk_size``) are read as well.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loader.formats.atomic import atomic_write_bytes
from loader.formats.errors import FormatError

WDINFO_NAME = "wdinfo.json"
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

    @property
    def data_list(self) -> list[str]:
        return [t.path for t in self.tars]

    @property
    def total_key_count(self) -> int:
        return sum(t.count for t in self.tars)

    def root_path(self) -> str:
        """Absolute (or URL) root the tar paths hang from."""
        if os.path.isabs(self.root) or "://" in self.root or self.manifest_dir is None:
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
        # Per-tar details are columnar (one list per field, aligned with data_list): parsing
        # a million tars then costs a few flat lists, not a million small dicts.
        doc["tar_bytes"] = {m: [t.bytes.get(m, 0) for t in self.tars] for m in self.data_keys}
        doc["tar_sha256"] = {m: [t.sha256.get(m, "") for t in self.tars] for m in self.data_keys}
        doc["key_index"] = [t.key_index for t in self.tars]
        return doc


def derive_chunk_size(counts: list[int]) -> int:
    # PiD converts "samples read" to "shards read" by dividing by chunk_size; the largest
    # count makes that conversion skip too few shards rather than too many, so none is lost.
    return max(counts, default=0)


def write_wdinfo(folder: str | os.PathLike[str], manifest: WdinfoManifest) -> Path:
    path = Path(folder) / WDINFO_NAME
    # Compact: a manifest can list a million tars; `python -m json.tool` pretty-prints it.
    data = json.dumps(manifest.to_json(), separators=(",", ":")).encode() + b"\n"
    atomic_write_bytes(path, data)
    return path


def parse_wdinfo(doc: dict[str, Any], manifest_dir: str | None, origin: str) -> WdinfoManifest:
    try:
        data_keys = list(doc["data_keys"])
        data_list = list(doc["data_list"])
        counts = [int(c) for c in doc["data_list_key_count"]]
    except (KeyError, TypeError) as exc:
        raise FormatError(
            f"{origin}: not a wdinfo manifest (missing or malformed {exc}); "
            "expected keys data_keys, data_list, data_list_key_count"
        ) from None
    if len(data_list) != len(counts):
        raise FormatError(
            f"{origin}: data_list has {len(data_list)} entries but data_list_key_count has {len(counts)}"
        )
    n = len(data_list)
    tar_bytes = {m: v for m, v in doc.get("tar_bytes", {}).items() if len(v) == n}
    tar_sha = {m: v for m, v in doc.get("tar_sha256", {}).items() if len(v) == n}
    key_index = doc.get("key_index") or [None] * n
    if len(key_index) != n:
        raise FormatError(f"{origin}: key_index has {len(key_index)} entries but data_list has {n}")
    tars = [
        TarEntry(
            p, c, {m: int(v[i]) for m, v in tar_bytes.items()}, {m: v[i] for m, v in tar_sha.items() if v[i]},
            key_index[i],
        )
        for i, (p, c) in enumerate(zip(data_list, counts, strict=True))
    ]
    total = doc.get("total_key_count")
    if total is not None and int(total) != sum(counts):
        raise FormatError(f"{origin}: total_key_count {total} != sum of data_list_key_count {sum(counts)}")
    chunk = doc.get("chunk_size")
    return WdinfoManifest(
        data_keys=data_keys,
        tars=tars,
        root=str(doc.get("root", ".")),
        chunk_size=int(chunk) if chunk else derive_chunk_size(counts),
        format_version=int(doc.get("format_version", 0)),  # 0: written by PiD
        bucket=doc.get("bucket"),
        source=doc.get("source"),
        manifest_dir=manifest_dir,
    )


def read_wdinfo(path: str | os.PathLike[str]) -> WdinfoManifest:
    path = Path(path)
    try:
        doc = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}: invalid JSON ({exc}); rebuild the manifest") from None
    return parse_wdinfo(doc, str(path.parent), str(path))
