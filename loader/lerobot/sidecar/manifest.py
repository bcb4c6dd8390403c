"""The sidecar manifest: what each MP4 file's entry holds, and its JSON in both layouts.

Written (LeRobot's layout, ``manifest_json``): LeRobot's own payload, with our fields ADDED
beside LeRobot's and never renamed, so LeRobot's reader accepts our sidecars and we accept its::

    {"version": 3,
     "sidecar": {"schema_version": 3, "repo_id", "revision", "data_root",
                 "source_files": [[path, size], ...], "source_fingerprints": {path: fp | null},
                 + ours: "subset", "episodes" (subset only), "created_by"},
     "files": [{"file_path", "file_size",
                "mp4": {LeRobot's: "file_path", "file_size", "ftyp" (hex), "moov_offset",
                        "mdat_offset", "mdat_payload_offset", "mdat_payload_size", "faststart",
                        "codec", "timescale", "duration", "track_id", "width", "height",
                        "stsd_body" (hex),
                        + ours: "edit", "mdat", "sample_count", "stable"}}, ...]}

``files`` is in sorted path order and file ``i``'s arrays are the members ``<i>/<array>``.
An entry LeRobot wrote has none of our fields: its fingerprint (if any) comes from
``source_fingerprints``, its sample count from its arrays, and without a fingerprint its identity
is its size alone (``identity == "size"``, see validate.py).

Read only (the layout published before, ``__manifest__``): a flat JSON object with
``schema_version``, ``files[{id, path, size, fingerprint, stable, ftyp/stsd base64, ...}]``.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from loader.io import urls

from .errors import SidecarError, SidecarSchemaError

SIDECAR_SCHEMA_VERSION = 3       # our schema, and LeRobot's sidecar.schema_version
PAYLOAD_VERSION = 3              # LeRobot's top-level "version" of manifest_json
IDENTITY_FINGERPRINT = "fingerprint"   # size + fingerprint (what we write)
IDENTITY_SIZE = "size"           # size only: a LeRobot entry without a source fingerprint
_BOX_HEADER = 8
_LARGE_BOX_HEADER = 16


def file_id(index: int) -> str:
    """The member prefix of the file at ``index`` in sorted path order (LeRobot's layout)."""
    return str(index)


def public_root(data_root: str) -> str:
    """``data_root`` as it may be stored or logged: no userinfo, query string or fragment.

    Userinfo carries basic-auth passwords and tokens; a query carries presigned signatures
    (``X-Amz-Signature``, ``token=``). Local paths are returned unchanged.
    """
    if not urls.has_scheme(data_root):
        return data_root
    parts = urlsplit(data_root)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def episodes_tuple(episodes: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if episodes is None else tuple(sorted({int(e) for e in episodes}))


def _box_body(box: bytes) -> bytes:
    # A 64-bit size (size field 1) puts the real size after the type: a 16-byte header.
    return box[_LARGE_BOX_HEADER if int.from_bytes(box[:4], "big") == 1 else _BOX_HEADER:]


def _stsd_box(body: bytes) -> bytes:
    return (len(body) + _BOX_HEADER).to_bytes(4, "big") + b"stsd" + body


@dataclass(frozen=True)
class SidecarFile:
    """One MP4 file's manifest entry (its arrays are the members ``<id>/<array>``)."""

    id: str
    path: str                      # relative to the dataset root
    size: int
    fingerprint: str | None        # fs.file_identity(...).fingerprint when indexed
    stable: bool                   # False: the backend has no stable identity -> always stale
    ftyp: bytes                    # the whole ftyp box, verbatim
    stsd: bytes                    # the whole stsd box
    timescale: int
    track_id: int
    codec: str
    width: int
    height: int
    mdat: tuple[tuple[int, int], ...]   # (offset, size) of each mdat box
    edit: dict[str, int] | None
    sample_count: int
    moov_offset: int | None = None      # None: read from a __manifest__ sidecar, which lacks it
    duration: int | None = None         # media ticks (sum of sample durations)
    identity: str = IDENTITY_FINGERPRINT

    # -- the __manifest__ layout (read only; to_dict is also the in-memory summary) -------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "path": self.path, "size": self.size, "fingerprint": self.fingerprint,
            "stable": self.stable, "ftyp": base64.b64encode(self.ftyp).decode("ascii"),
            "stsd": base64.b64encode(self.stsd).decode("ascii"), "timescale": self.timescale,
            "track_id": self.track_id, "codec": self.codec, "width": self.width,
            "height": self.height, "mdat": [list(m) for m in self.mdat],
            "edit": None if self.edit is None else dict(self.edit),
            "sample_count": self.sample_count, "moov_offset": self.moov_offset,
            "duration": self.duration, "identity": self.identity,
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

    # -- LeRobot's layout ------------------------------------------------------------------------

    def to_mp4(self) -> dict[str, Any]:
        """The ``mp4`` object: LeRobot's ``Mp4Index`` fields, then ours (added, never renamed)."""
        if self.moov_offset is None or self.duration is None:
            raise SidecarError(f"{self.path}: no moov_offset/duration (the entry comes from an old "
                               "__manifest__ sidecar); rebuild the sidecar instead of rewriting it")
        # LeRobot keeps one mdat; ours may list several. Its header is 8 bytes unless the box
        # needs a 64-bit size (what FFmpeg writes); LeRobot reads these fields but does not use
        # them to fetch bytes (sample_offsets are absolute).
        mdat_offset, mdat_size = self.mdat[0] if self.mdat else (0, 0)
        header = _LARGE_BOX_HEADER if mdat_size > 0xFFFFFFFF else _BOX_HEADER
        return {
            "file_path": self.path, "file_size": self.size, "ftyp": self.ftyp.hex(),
            "moov_offset": self.moov_offset, "mdat_offset": mdat_offset,
            "mdat_payload_offset": mdat_offset + header,
            "mdat_payload_size": max(mdat_size - header, 0),
            "faststart": self.moov_offset < mdat_offset, "codec": self.codec,
            "timescale": self.timescale, "duration": self.duration, "track_id": self.track_id,
            "width": self.width, "height": self.height, "stsd_body": _box_body(self.stsd).hex(),
            # ours:
            "edit": None if self.edit is None else dict(self.edit),
            "mdat": [list(m) for m in self.mdat], "sample_count": self.sample_count,
            "stable": self.stable,
        }

    @classmethod
    def from_item(cls, index: int, item: Mapping[str, Any], fingerprint: str | None,
                  sample_count: int | None) -> SidecarFile:
        """An entry of LeRobot's ``files`` list; ``sample_count`` from the arrays when the entry
        has none (LeRobot's). Raises KeyError/TypeError/ValueError on a malformed entry."""
        mp4 = item["mp4"]
        if not isinstance(mp4, Mapping):
            raise TypeError(f"files[{index}].mp4 is not an object")
        ours = "stable" in mp4
        count = mp4["sample_count"] if ours else sample_count
        if count is None:
            raise ValueError(f"files[{index}] has no sample count")
        edit = mp4.get("edit")
        if ours:
            mdat = tuple((int(o), int(s)) for o, s in mp4["mdat"])
        else:   # LeRobot's one mdat: (offset, header + payload)
            offset = int(mp4["mdat_offset"])
            mdat = ((offset, int(mp4["mdat_payload_offset"]) - offset + int(mp4["mdat_payload_size"])),)
        stable = bool(mp4["stable"]) if ours else fingerprint is not None
        return cls(
            id=file_id(index), path=str(item["file_path"]), size=int(item["file_size"]),
            fingerprint=fingerprint, stable=stable, ftyp=bytes.fromhex(mp4["ftyp"]),
            stsd=_stsd_box(bytes.fromhex(mp4["stsd_body"])), timescale=int(mp4["timescale"]),
            track_id=int(mp4["track_id"]), codec=str(mp4["codec"]), width=int(mp4["width"]),
            height=int(mp4["height"]), mdat=mdat,
            edit=None if edit is None else {str(k): int(v) for k, v in edit.items()},
            sample_count=int(count), moov_offset=int(mp4["moov_offset"]),
            duration=int(mp4["duration"]),
            identity=IDENTITY_FINGERPRINT if ours or fingerprint is not None else IDENTITY_SIZE,
        )


@dataclass(frozen=True)
class SidecarManifest:
    """A schema-v3 sidecar's manifest (LeRobot's ``manifest_json`` on disk, see the module doc)."""

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

    def numbered(self) -> SidecarManifest:
        """The same manifest with files in path order and ids = positions (LeRobot's rule)."""
        files = tuple(replace(f, id=file_id(i)) for i, f in enumerate(sorted(self.files, key=lambda f: f.path)))
        return replace(self, files=files)

    def to_dict(self) -> dict[str, Any]:
        """A flat summary (the ``__manifest__`` keys): what ``Sidecar.manifest`` shows."""
        d: dict[str, Any] = {
            "schema_version": self.schema_version, "repo_id": self.repo_id,
            "revision": self.revision, "data_root": self.data_root, "subset": self.subset,
            "created_by": self.created_by, "files": [f.to_dict() for f in self.files],
        }
        if self.subset:
            d["episodes"] = list(self.episodes or ())
        return d

    def to_payload(self) -> dict[str, Any]:
        """LeRobot's ``manifest_json`` object with our fields added. Files must be numbered."""
        ordered = sorted(self.files, key=lambda f: f.path)
        if [f.id for f in ordered] != [file_id(i) for i in range(len(ordered))]:
            raise SidecarError("file ids must be the positions in sorted path order "
                               "(0, 1, ...); use SidecarManifest.numbered()")
        sidecar: dict[str, Any] = {
            "schema_version": self.schema_version, "repo_id": self.repo_id,
            "revision": self.revision, "data_root": self.data_root,
            "source_files": [[f.path, f.size] for f in ordered],
            "source_fingerprints": {f.path: f.fingerprint for f in ordered},
            # ours:
            "subset": self.subset, "created_by": self.created_by,
        }
        if self.subset:
            sidecar["episodes"] = list(self.episodes or ())
        return {"version": PAYLOAD_VERSION, "sidecar": sidecar,
                "files": [{"file_path": f.path, "file_size": f.size, "mp4": f.to_mp4()} for f in ordered]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SidecarManifest:
        """The ``__manifest__`` layout (already checked to be schema version 3)."""
        episodes = d.get("episodes")
        return cls(
            schema_version=int(d["schema_version"]), repo_id=str(d["repo_id"]),
            revision=None if d.get("revision") is None else str(d["revision"]),
            data_root=str(d["data_root"]), subset=bool(d.get("subset", False)),
            episodes=None if episodes is None else tuple(int(e) for e in episodes),
            created_by=str(d.get("created_by", "")),
            files=tuple(SidecarFile.from_dict(f) for f in d["files"]),
        )

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any], where: str,
                     sample_counts: Mapping[int, int]) -> SidecarManifest:
        """LeRobot's ``manifest_json`` (version checked by the caller). ``sample_counts``: the
        arrays' lengths of entries without our ``sample_count``, by position."""
        sc = payload["sidecar"]
        version = sc.get("schema_version")
        if version != SIDECAR_SCHEMA_VERSION:
            raise SidecarSchemaError(
                f"{where}: sidecar.schema_version {version!r}, this loader reads "
                f"{SIDECAR_SCHEMA_VERSION}; rebuild it")
        fps = sc.get("source_fingerprints") or {}
        if isinstance(fps, list):   # tolerate [[path, fp], ...], like source_files
            fps = {str(p): fp for p, fp in fps}
        if not isinstance(fps, Mapping):
            raise TypeError("sidecar.source_fingerprints is neither an object nor a list of pairs")
        files = payload["files"]
        if not isinstance(files, list):
            raise TypeError("files is not a list")
        entries = []
        for i, item in enumerate(files):
            fp = fps.get(item["file_path"])
            entries.append(SidecarFile.from_item(i, item, None if fp in (None, "") else str(fp),
                                                 sample_counts.get(i)))
        paths = [f.path for f in entries]
        if paths != sorted(paths):
            raise SidecarError(f"{where}: files are not in sorted path order, so member <i> "
                               "would name the wrong file; rebuild the sidecar")
        sizes = {str(p): s for p, s in sc.get("source_files") or ()}
        for f in entries:
            if f.path in sizes and sizes[f.path] is not None and int(sizes[f.path]) != f.size:
                raise SidecarError(f"{where}: {f.path} has file_size {f.size} but source_files says "
                                   f"{sizes[f.path]}; rebuild the sidecar")
        episodes = sc.get("episodes")
        return cls(
            schema_version=int(version), repo_id=str(sc["repo_id"]),
            revision=None if sc.get("revision") is None else str(sc["revision"]),
            data_root=str(sc["data_root"]), subset=bool(sc.get("subset", False)),
            episodes=None if episodes is None else tuple(int(e) for e in episodes),
            created_by=str(sc.get("created_by", "lerobot")), files=tuple(entries),
        )


def needs_arrays_for_count(payload: Mapping[str, Any]) -> list[int]:
    """Positions of entries without our ``sample_count`` (LeRobot's): their count is read from
    the ``sample_pts`` array header."""
    return [i for i, item in enumerate(payload.get("files") or [])
            if not (isinstance(item, Mapping) and isinstance(item.get("mp4"), Mapping)
                    and "sample_count" in item["mp4"])]


def fingerprints_match(stored: str, current: str) -> bool:
    """Does a stored fingerprint name the same bytes as the current one?

    Ours are self-describing (``etag:<ETag>``, ``s3:etag=<ETag>[;version=..]``); LeRobot's may be
    the bare ETag or content hash, quotes or not. Both sides reduce to that value to compare.
    """
    return stored == current or _bare(stored) == _bare(current)


def _bare(fp: str) -> str:
    if fp.startswith("etag:"):
        fp = fp[len("etag:"):]
    elif fp.startswith("s3:etag="):
        fp = fp[len("s3:etag="):].split(";", 1)[0]
    return fp.strip('"')
