"""Publishing a version that only added modalities: the other tars stay where they were written.

A version of an S3 output lives under ``versions/<id>/``, and a manifest's tars are
``<root>/<modality>/<path>``. When every tar of the staged version is either one the current
version lists with the same sha256 or a tar of a modality no current manifest lists (a modality
added to the committed plan, ``plan/add_modality.py``), the new version's manifests take the
root of the folder that holds the current tars (``version_pointer.sibling_root``), its new tars
are uploaded into that folder beside them, and its key indexes, manifests and settings into its
own folder. Nothing of the reused tars is uploaded or copied; the pointer's ``uses`` keeps the
cleanup away from the folder they are in.

The folder's own manifests never list the added modality, so its readers see nothing change.
A tar of a modality it already lists, or an object already there under an added one (another
version put it there), is never overwritten: the publish then copies as before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from loader.formats.version_pointer import (
    VersionPointer,
    sibling_root,
    sibling_version,
    version_dir,
)
from loader.formats.wdinfo import check_wdinfo
from pid_platform.sharding.state_doc import load_state_doc

# Written into the new version's folder before its first tar goes into another version's: a
# publish of the same version run again then takes those objects as its own (same id, same bytes).
MARKER = ".pid-build/in-place.json"


@dataclass(frozen=True)
class InPlace:
    base: str  # the version whose folder holds the tars
    reused: frozenset[str]  # tars (relative to a version folder) already there, listed with the same sha256
    placed: frozenset[str]  # tars of added modalities, written into the base's folder

    def version_id(self, staged_id: str) -> str:
        """The id of the version: the staged content's, and the folder its tars are in."""
        return hashlib.sha256(f"pid-in-place-1\0{staged_id}\0{self.base}".encode()).hexdigest()[:20]

    def marker(self) -> bytes:
        return json.dumps({"base": self.base, "placed": sorted(self.placed)}, indent=1).encode()


def home_of(current: VersionPointer, docs: dict[str, bytes]) -> str | None:
    """The version whose folder holds the tars of ``current`` (its manifests ``docs``): its own,
    or the one its roots name; None when they name several, or a root that is neither."""
    homes = set()
    for rel, data in docs.items():
        try:
            root = check_wdinfo(load_state_doc(data, rel), rel).root
        except ValueError:
            return None
        homes.add(current.version if root == "." else sibling_version(root))
    return homes.pop() if len(homes) == 1 and None not in homes else None


def published_manifests(staged: dict[str, bytes], base: str) -> dict[str, bytes]:
    """The staged manifests (path -> bytes, root ".") as a version published in place over
    ``base``'s folder publishes them: their roots name that folder."""
    found = {}
    for rel, data in staged.items():
        doc = {**load_state_doc(data, rel), "root": sibling_root(base, rel.rpartition("/")[0])}
        check_wdinfo(doc, rel)
        found[rel] = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
    return found


def free_to_place(vid: str, base: str, placed: frozenset[str], read: Callable[[str], bytes | None],
                  listing: Callable[[str], dict[str, int]]) -> bool:
    """Whether version ``vid`` may put the tars ``placed`` into ``base``'s folder: none is there
    yet, or its ``MARKER`` says an earlier run of it put them there."""
    if not placed or read(f"{version_dir(vid)}/{MARKER}") is not None:
        return True
    there = listing(version_dir(base))
    return not any(rel in there for rel in placed)  # another version's objects are not ours to replace


def decide_in_place(current: VersionPointer | None, old_docs: dict[str, bytes], reused: frozenset[str],
                    modality_of: dict[str, str], staged_id: str, read: Callable[[str], bytes | None],
                    listing: Callable[[str], dict[str, int]]) -> InPlace | None:
    """The in-place publish of a staged version whose tars are ``modality_of`` (path -> modality)
    and of which ``reused`` are the current version's (same sha256), or None. Its manifests are
    left to the caller (``published_manifests``): the plan decides before they exist."""
    if current is None or not reused:
        return None
    base = home_of(current, old_docs)
    if base is None:
        return None
    listed = {m for rel, data in old_docs.items() for m in check_wdinfo(load_state_doc(data, rel), rel).data_keys}
    placed = frozenset(rel for rel in modality_of if rel not in reused)
    if any(modality_of[rel] in listed for rel in placed):
        return None  # a changed tar of a modality the base lists: never overwritten under its readers
    found = InPlace(base, reused, placed)
    return found if free_to_place(found.version_id(staged_id), base, placed, read, listing) else None
