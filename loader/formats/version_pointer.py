"""A build published to an object store: versions side by side, one pointer naming the current.

An object store has no rename, so a build there stays atomic by addressing: every version of a
source's output lives under ``<output>/versions/<version>/`` (the same layout as a local output
folder: tars, key indexes, ``wdinfo.json``), and ``<output>/pid-current.json`` names the one
readers use. The pointer is written last, in one PUT, after every object of its version; a
reader follows it and sees the old version or the new one, never a mix. A version stops being
current when the pointer moves on; it is recorded under ``retired`` with the time, and removed
only by an explicit cleanup once its grace period is over (readers may still be streaming it).

Pointer, ``format_version`` 1::

    {"format_version": 1, "version": "<id>", "manifests": ["aspect_ratio_1_1/wdinfo.json", ...],
     "retired": {"<older id>": <unix seconds it stopped being current>, ...},
     "built_by": "<host> pid <pid>"}

``manifests`` are relative to the version's folder, so a reader needs no listing. ``uses``
(optional) lists the older versions whose folders hold tars this version's manifests list: a
version that only added a modality keeps the other modalities' tars where they were written
(its manifests' ``root`` names that version's folder, ``sibling_root``) and writes its new tars
there too; the cleanup never deletes a version the current one uses, and one it stops using is
retired with it. ``built_by``
(optional, for people) names the build that moved the pointer here: a build that lost a race
to it says whose version won.

The pointer changes only by a conditional PUT (``If-Match`` on the ETag the writer read, or
``If-None-Match: *`` for the first one), after the version's objects were checked against its
manifests; ``pid_platform/sharding/commit/s3_output.py`` holds the writer's side.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from loader.formats.errors import FormatError, short_repr
from loader.formats.strict_doc import is_number, load_json_doc

POINTER_NAME = "pid-current.json"
VERSIONS_DIR = "versions"
POINTER_FORMAT_VERSION = 1
MAX_BUILT_BY_CHARS = 200
MAX_POINTER_BYTES = 16 * 1024 * 1024  # a version id and a few manifests; "retired" grows by one line a build
_VERSION_ID = re.compile(r"^[0-9a-f]{8,64}$")


@dataclass(frozen=True)
class VersionPointer:
    version: str
    manifests: list[str]
    retired: dict[str, float] = field(default_factory=dict)
    built_by: str | None = None
    uses: list[str] = field(default_factory=list)

    def version_dir(self) -> str:
        """The version's folder, relative to the output (the pointer's folder)."""
        return version_dir(self.version)

    def manifest_paths(self) -> list[str]:
        """The manifests, relative to the output."""
        return [posixpath.join(self.version_dir(), m) for m in self.manifests]

    def to_bytes(self) -> bytes:
        doc = {"format_version": POINTER_FORMAT_VERSION, "version": self.version,
               "manifests": sorted(self.manifests), "retired": dict(sorted(self.retired.items()))}
        if self.built_by:
            doc["built_by"] = self.built_by
        if self.uses:
            doc["uses"] = sorted(self.uses)
        return json.dumps(doc, indent=1).encode() + b"\n"


def version_dir(version: str) -> str:
    return f"{VERSIONS_DIR}/{version}"


# The root of a manifest at ``versions/<v>/[<leaf>/]wdinfo.json`` naming the same folder of
# another version: ``../<id>`` (flat) or ``../../<id>/<leaf>``. The one relative root allowed
# to leave its manifest's folder (``wdinfo.check_wdinfo``): it stays inside the output's versions.
SIBLING_ROOT = re.compile(r"^\.\./(?:(?P<id1>[0-9a-f]{8,64})|\.\./(?P<id2>[0-9a-f]{8,64})/(?P<leaf>[^/.][^/]*))$")


def sibling_root(version: str, leaf: str) -> str:
    """The root that makes a manifest in folder ``leaf`` ("" in flat mode) of one version read
    its tars from the same folder of ``version``."""
    return f"../{version}" if not leaf else f"../../{version}/{leaf}"


def sibling_version(root: str) -> str | None:
    """The version a sibling root (``sibling_root``) names; None for any other root."""
    m = SIBLING_ROOT.match(root)
    return None if m is None else (m.group("id1") or m.group("id2"))


def parse_pointer(data: bytes, origin: str) -> VersionPointer:
    """The pointer in ``data`` (read from ``origin``); ``FormatError`` names what is wrong."""
    # The strict reader: a pointer in a bucket others can write to may hold NaN, 1e400, a key twice.
    doc: Any = load_json_doc(data, origin, max_bytes=MAX_POINTER_BYTES, fix="rebuild the output")
    if not isinstance(doc, dict) or doc.get("format_version") != POINTER_FORMAT_VERSION:
        raise FormatError(f"{origin}: not a version pointer of format_version {POINTER_FORMAT_VERSION}; "
                          "rebuild the output with this version of pid-platform")
    version, manifests, retired = doc.get("version"), doc.get("manifests"), doc.get("retired", {})
    if not isinstance(version, str) or not _VERSION_ID.match(version):
        raise FormatError(f"{origin}: 'version' must be a hex version id, got {short_repr(version)}")
    if not isinstance(manifests, list) or not all(
        isinstance(m, str) and m and not m.startswith("/") and ".." not in m.split("/") for m in manifests
    ):
        raise FormatError(f"{origin}: 'manifests' must list paths inside the version folder, got {short_repr(manifests)}")
    if not isinstance(retired, dict) or not all(
        isinstance(k, str) and _VERSION_ID.match(k) and is_number(v, 0, math.inf) for k, v in retired.items()
    ):
        raise FormatError(f"{origin}: 'retired' must map version ids to times, got {short_repr(retired)}")
    built_by = doc.get("built_by")
    if built_by is not None and not isinstance(built_by, str):
        raise FormatError(f"{origin}: 'built_by' must be a string, got {type(built_by).__name__}")
    uses = doc.get("uses", [])
    if not isinstance(uses, list) or not all(isinstance(u, str) and _VERSION_ID.match(u) for u in uses):
        raise FormatError(f"{origin}: 'uses' must list version ids, got {short_repr(uses)}")
    return VersionPointer(version, list(manifests), {k: float(v) for k, v in retired.items()},
                          built_by[:MAX_BUILT_BY_CHARS] if built_by else None, list(uses))
