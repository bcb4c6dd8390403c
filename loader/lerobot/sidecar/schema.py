"""MP4 sidecar, schema v3: an NPZ of per-file sample arrays plus a JSON manifest.

Layout (an ordinary ``.npz``, so ``np.load`` reads it too)::

    __manifest__.npy                 uint8: UTF-8 JSON (see SidecarManifest)
    f00000/sample_pts.npy            float64 seconds (presentation time, edit delay applied)
    f00000/sample_durations.npy      int64, media timescale, decode order
    f00000/sample_composition_offsets.npy
    f00000/sample_sizes.npy          int64 bytes
    f00000/sample_offsets.npy        int64 absolute byte offsets in the MP4
    f00000/sync_samples.npy          int64 0-based indices of sync (key) samples
    f00001/...

Per-file ids (``f00000``...) are assigned in sorted path order, so the manifest names every
member and nothing depends on a relative path being a safe zip member name. Members carry a
fixed timestamp and are written in id order: the same inputs give byte-identical sidecars.
The manifest never holds credentials: ``data_root`` is stored without userinfo, query or
fragment, and files are named by their path relative to the root.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from loader.formats.atomic import atomic_writer

from .errors import SidecarError, SidecarSchemaError

SIDECAR_SCHEMA_VERSION = 3
MANIFEST_MEMBER = "__manifest__"
INT_ARRAYS = ("sample_durations", "sample_composition_offsets", "sample_sizes", "sample_offsets",
              "sync_samples")
# Every per-file array; sample_pts is the one float array.
ARRAY_NAMES = ("sample_pts", *INT_ARRAYS)
# Arrays with one value per sample (sync_samples holds indices instead).
PER_SAMPLE = ("sample_pts", "sample_durations", "sample_composition_offsets", "sample_sizes",
              "sample_offsets")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed member timestamps: deterministic bytes
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def file_id(index: int) -> str:
    return f"f{index:05d}"


def member_name(fid: str, array: str) -> str:
    return f"{fid}/{array}"


def public_root(data_root: str) -> str:
    """``data_root`` as it may be stored or logged: no userinfo, query string or fragment.

    Userinfo carries basic-auth passwords and tokens; a query carries presigned signatures
    (``X-Amz-Signature``, ``token=``). Local paths are returned unchanged.
    """
    if not _SCHEME.match(data_root):
        return data_root
    parts = urlsplit(data_root)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass(frozen=True)
class SidecarFile:
    """One MP4 file's manifest entry (its arrays live under ``<id>/...`` in the NPZ)."""

    id: str
    path: str                      # relative to the dataset root
    size: int
    fingerprint: str | None        # fs.file_identity(...).fingerprint when indexed
    stable: bool                   # False: the backend has no stable identity -> always stale
    ftyp: bytes
    stsd: bytes                    # the whole stsd box, verbatim
    timescale: int
    track_id: int
    codec: str
    width: int
    height: int
    mdat: tuple[tuple[int, int], ...]   # (offset, size) of each mdat box
    edit: dict[str, int] | None
    sample_count: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "path": self.path, "size": self.size, "fingerprint": self.fingerprint,
            "stable": self.stable, "ftyp": base64.b64encode(self.ftyp).decode("ascii"),
            "stsd": base64.b64encode(self.stsd).decode("ascii"), "timescale": self.timescale,
            "track_id": self.track_id, "codec": self.codec, "width": self.width,
            "height": self.height, "mdat": [list(m) for m in self.mdat],
            "edit": None if self.edit is None else dict(self.edit),
            "sample_count": self.sample_count,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SidecarFile:
        edit = d.get("edit")
        return cls(
            id=str(d["id"]), path=str(d["path"]), size=int(d["size"]),
            fingerprint=None if d.get("fingerprint") is None else str(d["fingerprint"]),
            stable=bool(d["stable"]), ftyp=base64.b64decode(d["ftyp"]),
            stsd=base64.b64decode(d["stsd"]), timescale=int(d["timescale"]),
            track_id=int(d["track_id"]), codec=str(d["codec"]), width=int(d["width"]),
            height=int(d["height"]), mdat=tuple((int(o), int(s)) for o, s in d["mdat"]),
            edit=None if edit is None else {str(k): int(v) for k, v in edit.items()},
            sample_count=int(d["sample_count"]),
        )


@dataclass(frozen=True)
class SidecarManifest:
    """The manifest of a schema-v3 sidecar (stored as JSON in ``__manifest__``)."""

    repo_id: str
    revision: str | None
    data_root: str                 # public form (see public_root)
    files: tuple[SidecarFile, ...]
    subset: bool = False
    episodes: tuple[int, ...] | None = None   # the episodes of a subset sidecar
    created_by: str = "loader.lerobot.sidecar"
    schema_version: int = SIDECAR_SCHEMA_VERSION
    _by_path: dict[str, SidecarFile] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_path = {f.path: f for f in self.files}
        if len(by_path) != len(self.files):
            raise SidecarError("sidecar manifest lists the same MP4 path twice")
        if len({f.id for f in self.files}) != len(self.files):
            raise SidecarError("sidecar manifest uses the same file id twice")
        if public_root(self.data_root) != self.data_root:
            raise ValueError("SidecarManifest.data_root must not carry credentials; pass "
                             "public_root(data_root)")
        object.__setattr__(self, "_by_path", by_path)

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    def file(self, rel: str) -> SidecarFile:
        try:
            return self._by_path[rel]
        except KeyError:
            raise KeyError(f"{rel!r} is not indexed by this sidecar ({len(self.files)} files)") from None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema_version": self.schema_version, "repo_id": self.repo_id,
            "revision": self.revision, "data_root": self.data_root, "subset": self.subset,
            "created_by": self.created_by, "files": [f.to_dict() for f in self.files],
        }
        if self.subset:
            d["episodes"] = list(self.episodes or ())
        return d

    def to_json_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SidecarManifest:
        episodes = d.get("episodes")
        return cls(
            schema_version=int(d["schema_version"]), repo_id=str(d["repo_id"]),
            revision=None if d.get("revision") is None else str(d["revision"]),
            data_root=str(d["data_root"]), subset=bool(d.get("subset", False)),
            episodes=None if episodes is None else tuple(int(e) for e in episodes),
            created_by=str(d.get("created_by", "")),
            files=tuple(SidecarFile.from_dict(f) for f in d["files"]),
        )


def check_arrays(arrays: Mapping[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """Coerce to the schema dtypes (exact conversions only) and check shapes; return a new dict."""
    out: dict[str, np.ndarray] = {}
    for name in ARRAY_NAMES:
        if name not in arrays:
            raise SidecarError(f"{where}: array {name!r} is missing")
        a = np.asarray(arrays[name])
        want = np.float64 if name == "sample_pts" else np.int64
        if a.ndim != 1:
            raise SidecarError(f"{where}: {name} must be 1-D, got shape {a.shape}")
        if a.dtype != want:
            if not np.can_cast(a.dtype, want, casting="safe"):
                raise SidecarError(f"{where}: {name} has dtype {a.dtype}, expected {np.dtype(want)}")
            a = a.astype(want)
        out[name] = a
    n = len(out["sample_pts"])
    for name in PER_SAMPLE:
        if len(out[name]) != n:
            raise SidecarError(f"{where}: {name} has {len(out[name])} values for {n} samples")
    sync = out["sync_samples"]
    if len(sync) and (sync.min() < 0 or sync.max() >= n or np.any(np.diff(sync) <= 0)):
        raise SidecarError(f"{where}: sync_samples must be strictly increasing indices in [0, {n})")
    return out


def _write_npy(zf: zipfile.ZipFile, name: str, array: np.ndarray) -> None:
    info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED  # int64 tables of constants compress very well
    info.external_attr = 0o644 << 16
    with zf.open(info, "w", force_zip64=True) as fh:
        np.lib.format.write_array(fh, np.ascontiguousarray(array), allow_pickle=False)


class SidecarWriter:
    """Streams per-file arrays into an NPZ on an open binary file; the manifest goes in last.

    Only one file's arrays are held at a time, so memory does not grow with the number of
    sources (the zip's central directory, a few hundred bytes per file, does).
    """

    def __init__(self, fh: IO[bytes]):
        self._zf = zipfile.ZipFile(fh, "w", allowZip64=True)
        self._written: dict[str, int] = {}

    def add(self, fid: str, arrays: Mapping[str, np.ndarray]) -> int:
        """Write one file's arrays under ``fid``; return its sample count."""
        if fid in self._written:
            raise ValueError(f"file id {fid} written twice")
        checked = check_arrays(arrays, fid)
        for name in ARRAY_NAMES:
            _write_npy(self._zf, member_name(fid, name), checked[name])
        self._written[fid] = len(checked["sample_pts"])
        return self._written[fid]

    def finish(self, manifest: SidecarManifest) -> None:
        """Write the manifest (after checking it names exactly the arrays written) and close."""
        ids = {f.id: f for f in manifest.files}
        if set(ids) != set(self._written):
            missing = sorted(set(ids) - set(self._written))
            extra = sorted(set(self._written) - set(ids))
            raise SidecarError(f"manifest and arrays disagree: no arrays for {missing}, "
                               f"arrays without a manifest entry: {extra}")
        for fid, f in ids.items():
            if f.sample_count != self._written[fid]:
                raise SidecarError(f"{f.path}: manifest says {f.sample_count} samples, arrays "
                                   f"hold {self._written[fid]}")
        _write_npy(self._zf, MANIFEST_MEMBER, np.frombuffer(manifest.to_json_bytes(), dtype=np.uint8))
        self._zf.close()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._zf.close()


def write_sidecar(path: str | os.PathLike[str], manifest: SidecarManifest,
                  arrays: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    """Write a whole sidecar atomically; ``arrays`` maps each manifest path to its arrays."""
    with atomic_writer(path) as fh:
        w = SidecarWriter(fh)
        try:
            for f in sorted(manifest.files, key=lambda f: f.id):
                w.add(f.id, arrays[f.path])
            w.finish(manifest)
        except BaseException:
            w.abort()
            raise


def _read_npy(zf: zipfile.ZipFile, name: str, where: str) -> np.ndarray:
    try:
        with zf.open(f"{name}.npy") as fh:
            return np.lib.format.read_array(fh, allow_pickle=False)
    except KeyError:
        raise SidecarError(f"{where}: array {name!r} is missing; rebuild the sidecar") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise SidecarError(f"{where}: array {name!r} is unreadable ({e}); rebuild the sidecar") from e


class Sidecar:
    """A schema-v3 sidecar opened for reading: ``.manifest`` (dict), ``.files``, ``.arrays(rel)``."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            self._zf = zipfile.ZipFile(self.path)
        except FileNotFoundError:
            raise
        except (zipfile.BadZipFile, OSError) as e:
            raise SidecarError(f"{self.path}: not a sidecar NPZ ({e}); rebuild it") from e
        try:
            self.info = self._read_manifest()
            self._check_members()
        except BaseException:
            self._zf.close()
            raise
        self.manifest: dict[str, Any] = self.info.to_dict()
        self.files: list[str] = self.info.paths

    def _read_manifest(self) -> SidecarManifest:
        if f"{MANIFEST_MEMBER}.npy" not in self._zf.namelist():
            raise SidecarSchemaError(
                f"{self.path}: no {MANIFEST_MEMBER} member, so this is not a schema-v"
                f"{SIDECAR_SCHEMA_VERSION} sidecar (an older sidecar?); rebuild it")
        raw = _read_npy(self._zf, MANIFEST_MEMBER, str(self.path))
        try:
            d = json.loads(raw.astype(np.uint8, copy=False).tobytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SidecarError(f"{self.path}: manifest is not valid JSON ({e}); rebuild it") from e
        version = d.get("schema_version") if isinstance(d, dict) else None
        if version != SIDECAR_SCHEMA_VERSION:
            raise SidecarSchemaError(
                f"{self.path}: sidecar schema version {version!r}, this loader reads version "
                f"{SIDECAR_SCHEMA_VERSION}; rebuild it (ensure_sidecar rebuilds old caches "
                "automatically; a published one must be rebuilt before publishing)")
        try:
            return SidecarManifest.from_dict(d)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, SidecarError):
                raise
            raise SidecarError(f"{self.path}: malformed manifest ({type(e).__name__}: {e}); "
                               "rebuild the sidecar") from e

    def _check_members(self) -> None:
        names = set(self._zf.namelist())
        missing = [member_name(f.id, a) for f in self.info.files for a in ARRAY_NAMES
                   if f"{member_name(f.id, a)}.npy" not in names]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise SidecarError(f"{self.path}: {len(missing)} arrays named by the manifest are "
                               f"missing ({shown}); rebuild the sidecar")

    def file(self, rel: str) -> SidecarFile:
        return self.info.file(rel)

    def arrays(self, rel: str) -> dict[str, np.ndarray]:
        """The six arrays of MP4 file ``rel`` (int64, ``sample_pts`` float64), checked."""
        f = self.info.file(rel)
        where = f"{self.path} [{rel}]"
        raw = {name: _read_npy(self._zf, member_name(f.id, name), where) for name in ARRAY_NAMES}
        for name, a in raw.items():
            want = np.float64 if name == "sample_pts" else np.int64
            if a.dtype != want:
                raise SidecarError(f"{where}: {name} has dtype {a.dtype}, schema v3 stores {np.dtype(want)}")
        out = check_arrays(raw, where)
        if len(out["sample_pts"]) != f.sample_count:
            raise SidecarError(f"{where}: manifest says {f.sample_count} samples, arrays hold "
                               f"{len(out['sample_pts'])}; rebuild the sidecar")
        return out

    def close(self) -> None:
        self._zf.close()

    def __enter__(self) -> Sidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_sidecar(path: str | os.PathLike[str]) -> Sidecar:
    """Open a schema-v3 sidecar; raise SidecarSchemaError / SidecarError with what to do."""
    return Sidecar(path)


def sidecar_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of the sidecar file's bytes: the key of its compact index."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def episodes_tuple(episodes: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if episodes is None else tuple(sorted({int(e) for e in episodes}))


__all__ = [
    "ARRAY_NAMES", "INT_ARRAYS", "MANIFEST_MEMBER", "SIDECAR_SCHEMA_VERSION", "Sidecar",
    "SidecarFile", "SidecarManifest", "SidecarWriter", "check_arrays", "file_id", "member_name",
    "episodes_tuple", "public_root", "read_sidecar", "sidecar_digest", "write_sidecar",
]
