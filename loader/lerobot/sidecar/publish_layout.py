"""Where a published sidecar lives, and the small JSON pointer published beside it.

One layout for every target, relative to the dataset root (a git tree, a Hub repo, an ``s3://`` root)::

    meta/mp4-sidecars/<stem>.json        the pointer: names the NPZ, its sha256 and size (written last)
    meta/mp4-sidecars/<data name>.npz    the sidecar NPZ (schema v3)

``<stem>`` is the pinned source revision (a full commit SHA for git and Hub targets; any plain
label for a bucket), or ``current`` when a bucket sidecar has no revision. Git and Hub targets
commit both files in one commit on the branch ``lerobot-sidecars``, the NPZ as ``<stem>.npz``.
A bucket has no commits, so its NPZ is content-addressed (``<stem>.<sha256[:16]>.npz``) and the
pointer is replaced last: a reader that follows the pointer always finds a whole, matching NPZ.
Readers follow the pointer, check ``sha256``, then check the sidecar itself (validate_sidecar).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

SIDECAR_BRANCH = "lerobot-sidecars"
SIDECAR_DIR = "meta/mp4-sidecars"
POINTER_FORMAT = "lerobot-mp4-sidecar-pointer"
POINTER_VERSION = 1
NO_REVISION_STEM = "current"

_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
_STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class PublishError(RuntimeError):
    """Publishing a sidecar failed or was refused; the message says why and what to do."""


class PublishRefused(PublishError):
    """The sidecar or the request can never be published as given; trying again will not help."""


class SubsetSidecarError(PublishRefused):
    """Only a sidecar of the whole dataset may be published; this one indexes some episodes."""


@dataclass(frozen=True)
class Published:
    """What a publish did. URLs never carry credentials."""

    target: str                 # the target, as shown to people
    sidecar_url: str            # where readers fetch the NPZ
    pointer_url: str            # where readers fetch the pointer
    sha256: str
    size: int
    commit: str | None = None   # git / Hub: the head of the sidecars branch afterwards
    parent: str | None = None   # git / Hub: that commit's parent (previous sidecar commit or the source)
    unchanged: bool = False     # the target already held exactly these bytes: nothing was written


def is_commit_sha(revision: str | None) -> bool:
    return bool(revision) and _COMMIT_SHA.fullmatch(revision) is not None


def require_commit_sha(revision: str | None, target: str) -> str:
    if not is_commit_sha(revision):
        raise PublishRefused(
            f"publishing to {target} needs a pinned source revision: a full 40-character commit SHA "
            f"(got {revision!r}); pass --revision <sha> (e.g. from `git rev-parse <branch>` or the "
            "Hub's commit list)"
        )
    return revision  # type: ignore[return-value]


def stem(revision: str | None) -> str:
    """The file stem for a revision; refuses anything that is not a plain file name."""
    if revision is None:
        return NO_REVISION_STEM
    if not _STEM.fullmatch(revision) or ".." in revision:
        raise PublishRefused(
            f"revision {revision!r} cannot name a published sidecar: use letters, digits, '.', '_' "
            "or '-' (a commit SHA, or a label such as v1.2)"
        )
    return revision


def pointer_name(revision: str | None) -> str:
    return f"{stem(revision)}.json"


def versioned_npz_name(revision: str | None) -> str:
    return f"{stem(revision)}.npz"


def addressed_npz_name(revision: str | None, sha256: str) -> str:
    return f"{stem(revision)}.{sha256[:16]}.npz"


def make_pointer(*, sidecar_name: str, sha256: str, size: int, manifest: dict) -> bytes:
    """The pointer's bytes: deterministic (no clock), so re-publishing the same sidecar changes nothing."""
    doc = {
        "format": POINTER_FORMAT,
        "pointer_version": POINTER_VERSION,
        "sidecar": sidecar_name,
        "sha256": sha256,
        "size": size,
        "schema_version": manifest["schema_version"],
        "repo_id": manifest["repo_id"],
        "revision": manifest["revision"],
        "files": len(manifest["files"]),
        "samples": sum(int(f["sample_count"]) for f in manifest["files"]),
        "subset": bool(manifest.get("subset", False)),
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def read_pointer(data: bytes, where: str) -> dict:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PublishError(f"{where}: not a sidecar pointer ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        raise PublishError(f"{where}: not a sidecar pointer (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    return doc


def pointed_sidecar(doc: dict, where: str) -> str:
    """The NPZ a pointer names: a plain ``.npz`` file beside the pointer, of the whole dataset
    (a pointer must not be able to point outside, nor at a subset)."""
    name = doc.get("sidecar")
    if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith(".") or not name.endswith(".npz"):
        raise PublishError(f"{where}: pointer names {name!r}, not a sidecar file beside it")
    if doc.get("subset"):
        raise PublishError(f"{where}: points at a subset sidecar, which must not be used as the dataset's")
    return name


def check_pointed_bytes(doc: dict, where: str, name: str, sha256: str, size: int) -> None:
    """The bytes read for ``name`` are the ones the pointer names (sha256 and size)."""
    if (sha256, size) != (doc.get("sha256"), doc.get("size")):
        raise PublishError(f"{where}: {name} has sha256 {sha256} and {size} bytes, the pointer "
                           f"says {doc.get('sha256')} and {doc.get('size')}; publish it again")
