"""MP4 sidecar, schema v3: an NPZ of per-file sample arrays plus a JSON manifest.

Written in LeRobot's layout (an ordinary ``.npz``, so ``np.load`` and LeRobot's reader read it)::

    manifest_json.npy                0-d bytes (``|S<n>``): UTF-8 JSON, see manifest.py
    0/sample_pts.npy                 float64 seconds (presentation time, edit delay applied)
    0/sample_durations.npy           int64, media timescale, decode order
    0/sample_composition_offsets.npy
    0/sample_sizes.npy               int64 bytes
    0/sample_offsets.npy             int64 absolute byte offsets in the MP4
    0/sync_samples.npy               int64 0-based indices of sync (key) samples
    1/...

``i`` is the file's position in sorted path order (LeRobot's rule), so no relative path ever
becomes a zip member name. Members carry a fixed timestamp and are written in order with the
manifest last: the same inputs give byte-identical sidecars. The older layout
(``__manifest__.npy`` + ``f00000/...``), still in caches and on branches, is read too.
The manifest never holds credentials: ``data_root`` is stored without userinfo, query or
fragment, and files are named by their path relative to the root.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from loader.formats.atomic import atomic_writer

from .errors import SidecarError, SidecarSchemaError
from .manifest import (
    PAYLOAD_VERSION,
    SIDECAR_SCHEMA_VERSION,
    SidecarFile,
    SidecarManifest,
    episodes_tuple,
    file_id,
    needs_arrays_for_count,
    public_root,
)

MANIFEST_MEMBER = "manifest_json"        # LeRobot's name: what we write
LEGACY_MANIFEST_MEMBER = "__manifest__"  # the layout published before: read only
LAYOUT_LEROBOT = "lerobot"
LAYOUT_LEGACY = "legacy"
INT_ARRAYS = ("sample_durations", "sample_composition_offsets", "sample_sizes", "sample_offsets",
              "sync_samples")
# Every per-file array; sample_pts is the one float array.
ARRAY_NAMES = ("sample_pts", *INT_ARRAYS)
# Arrays with one value per sample (sync_samples holds indices instead).
PER_SAMPLE = ("sample_pts", "sample_durations", "sample_composition_offsets", "sample_sizes",
              "sample_offsets")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed member timestamps: deterministic bytes


def member_name(fid: str, array: str) -> str:
    return f"{fid}/{array}"


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
        # Not np.ascontiguousarray: it turns the 0-d manifest into a 1-element vector.
        a = np.asarray(array)
        np.lib.format.write_array(fh, a if a.flags.c_contiguous else a.copy(order="C"), allow_pickle=False)


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
        payload = json.dumps(manifest.to_payload(), sort_keys=True, separators=(",", ":"))
        # A 0-d bytes array, as np.savez(manifest_json=b"...") stores it (LeRobot's writer).
        _write_npy(self._zf, MANIFEST_MEMBER, np.array(payload.encode("utf-8")))
        self._zf.close()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._zf.close()


def write_sidecar(path: str | os.PathLike[str], manifest: SidecarManifest,
                  arrays: Mapping[str, Mapping[str, np.ndarray]]) -> SidecarManifest:
    """Write a whole sidecar atomically; ``arrays`` maps each manifest path to its arrays.

    Files are renumbered by sorted path (LeRobot's member rule); the written manifest is returned.
    """
    manifest = manifest.numbered()
    with atomic_writer(path) as fh:
        w = SidecarWriter(fh)
        try:
            for f in manifest.files:
                w.add(f.id, arrays[f.path])
            w.finish(manifest)
        except BaseException:
            w.abort()
            raise
    return manifest


def _read_npy(zf: zipfile.ZipFile, name: str, where: str) -> np.ndarray:
    try:
        with zf.open(f"{name}.npy") as fh:
            return np.lib.format.read_array(fh, allow_pickle=False)
    except KeyError:
        raise SidecarError(f"{where}: array {name!r} is missing; rebuild the sidecar") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise SidecarError(f"{where}: array {name!r} is unreadable ({e}); rebuild the sidecar") from e


class Sidecar:
    """A schema-v3 sidecar opened for reading: ``.manifest`` (a flat summary dict, see
    ``SidecarManifest.to_dict``), ``.info``, ``.files``, ``.arrays(rel)``; ``.layout`` says which
    layout the file has (``lerobot`` or ``legacy``) and ``.payload`` is LeRobot's JSON as read."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            self._zf = zipfile.ZipFile(self.path)
        except FileNotFoundError:
            raise
        except (zipfile.BadZipFile, OSError) as e:
            raise SidecarError(f"{self.path}: not a sidecar NPZ ({e}); rebuild it") from e
        self.payload: dict[str, Any] | None = None
        try:
            self._names = set(self._zf.namelist())
            self.info = self._read_manifest()
            self._check_members()
        except BaseException:
            self._zf.close()
            raise
        self.manifest: dict[str, Any] = self.info.to_dict()
        self.files: list[str] = self.info.paths

    def _read_manifest(self) -> SidecarManifest:
        if f"{MANIFEST_MEMBER}.npy" in self._names:
            self.layout = LAYOUT_LEROBOT
            return self._read_lerobot()
        if f"{LEGACY_MANIFEST_MEMBER}.npy" in self._names:
            self.layout = LAYOUT_LEGACY
            return self._read_legacy()
        raise SidecarSchemaError(
            f"{self.path}: neither a {MANIFEST_MEMBER} (LeRobot's layout) nor a "
            f"{LEGACY_MANIFEST_MEMBER} member, so this is not a schema-v{SIDECAR_SCHEMA_VERSION} "
            "sidecar (an older one?); rebuild it")

    def _json(self, member: str) -> Any:
        raw = _read_npy(self._zf, member, str(self.path))
        # LeRobot stores bytes as a 0-d |S array; the __manifest__ layout as a uint8 vector.
        if raw.dtype.kind != "S" and raw.dtype != np.uint8:
            raise SidecarError(f"{self.path}: {member} holds {raw.dtype} values, not UTF-8 JSON "
                               "bytes; rebuild the sidecar")
        try:
            return json.loads(np.ascontiguousarray(raw).tobytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SidecarError(f"{self.path}: {member} is not valid JSON ({e}); rebuild it") from e

    def _read_lerobot(self) -> SidecarManifest:
        d = self._json(MANIFEST_MEMBER)
        version = d.get("version") if isinstance(d, dict) else None
        if version != PAYLOAD_VERSION or not isinstance(d.get("sidecar"), dict):
            raise SidecarSchemaError(
                f"{self.path}: {MANIFEST_MEMBER} has version {version!r}, this loader reads "
                f"version {PAYLOAD_VERSION} (a 'sidecar' object, 'files', and six arrays per file "
                "including sample_composition_offsets); rebuild it (ensure_sidecar rebuilds old "
                "caches automatically; a published one must be rebuilt before publishing)")
        self.payload = d
        counts = {}
        for i in needs_arrays_for_count(d):
            counts[i] = _npy_length(self._zf, member_name(file_id(i), "sample_pts"), str(self.path))
        return self._parse(lambda: SidecarManifest.from_payload(d, str(self.path), counts))

    def _read_legacy(self) -> SidecarManifest:
        d = self._json(LEGACY_MANIFEST_MEMBER)
        version = d.get("schema_version") if isinstance(d, dict) else None
        if version != SIDECAR_SCHEMA_VERSION:
            raise SidecarSchemaError(
                f"{self.path}: sidecar schema version {version!r}, this loader reads version "
                f"{SIDECAR_SCHEMA_VERSION}; rebuild it (ensure_sidecar rebuilds old caches "
                "automatically; a published one must be rebuilt before publishing)")
        return self._parse(lambda: SidecarManifest.from_dict(d))

    def _parse(self, parse) -> SidecarManifest:
        try:
            return parse()
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, SidecarError):
                raise
            raise SidecarError(f"{self.path}: malformed manifest ({type(e).__name__}: {e}); "
                               "rebuild the sidecar") from e

    def _check_members(self) -> None:
        missing = [member_name(f.id, a) for f in self.info.files for a in ARRAY_NAMES
                   if f"{member_name(f.id, a)}.npy" not in self._names]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            older = (" (LeRobot's schema before 3 has no sample_composition_offsets)"
                     if any(m.endswith("/sample_composition_offsets") for m in missing) else "")
            raise SidecarSchemaError(f"{self.path}: {len(missing)} arrays named by the manifest are "
                                     f"missing ({shown}){older}; rebuild the sidecar")

    def file(self, rel: str) -> SidecarFile:
        return self.info.file(rel)

    def arrays(self, rel: str) -> dict[str, np.ndarray]:
        """The six arrays of MP4 file ``rel`` (int64, ``sample_pts`` float64), checked."""
        f = self.info.file(rel)
        where = f"{self.path} [{rel}]"
        raw = {name: _read_npy(self._zf, member_name(f.id, name), where) for name in ARRAY_NAMES}
        if self.layout == LAYOUT_LEGACY:
            for name, a in raw.items():
                want = np.float64 if name == "sample_pts" else np.int64
                if a.dtype != want:
                    raise SidecarError(f"{where}: {name} has dtype {a.dtype}, schema v3 stores {np.dtype(want)}")
        # LeRobot's reader takes any integer or float dtype; we take those converting exactly.
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


def _npy_length(zf: zipfile.ZipFile, name: str, where: str) -> int:
    """The length of a 1-D ``.npy`` member, from its header only."""
    try:
        with zf.open(f"{name}.npy") as fh:
            major, _ = np.lib.format.read_magic(fh)
            read_header = (np.lib.format.read_array_header_1_0 if major == 1
                           else np.lib.format.read_array_header_2_0)
            shape, _, _ = read_header(fh)
    except KeyError:
        raise SidecarSchemaError(f"{where}: array {name!r} is missing; rebuild the sidecar") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise SidecarError(f"{where}: array {name!r} is unreadable ({e}); rebuild the sidecar") from e
    if len(shape) != 1:
        raise SidecarError(f"{where}: {name} must be 1-D, got shape {shape}; rebuild the sidecar")
    return int(shape[0])


def read_sidecar(path: str | os.PathLike[str]) -> Sidecar:
    """Open a schema-v3 sidecar; raise SidecarSchemaError / SidecarError with what to do."""
    return Sidecar(path)


def sidecar_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of the sidecar file's bytes: the key of its compact index."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


__all__ = [
    "ARRAY_NAMES", "INT_ARRAYS", "LAYOUT_LEGACY", "LAYOUT_LEROBOT", "LEGACY_MANIFEST_MEMBER",
    "MANIFEST_MEMBER", "PAYLOAD_VERSION", "SIDECAR_SCHEMA_VERSION", "Sidecar", "SidecarFile",
    "SidecarManifest", "SidecarWriter", "check_arrays", "episodes_tuple", "file_id",
    "member_name", "public_root", "read_sidecar", "sidecar_digest", "write_sidecar",
]
