"""Intake outcomes kept by file identity: a rebuild validates only new or changed files.

Each file a build validated is kept with its outcome (valid, with the pixel size for an image,
or the reason it drops its sample), keyed by modality folder and name, and valid only while the
file's identity (``FileEntry.fingerprint``: local size, mtime, ctime and inode; S3 size and
ETag) is the one it was checked under. The cache is written into the staging folder with the
rest of the build state, so it is published with the version it describes, and a build that
stops before its commit leaves it there for the next one. A cache made under other validation
rules (``RULES_VERSION``) or at another validation level is ignored as a whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from loader.formats.atomic import atomic_writer
from pid_platform.sharding.storage import FileEntry

CACHE_NAME = "intake_cache.parquet"
# Bump when a check can give another outcome for the same bytes (a new rule, a fixed check):
# every cached outcome is then validated again.
RULES_VERSION = 1

# What was checked, which depends on the file's extension and folder (``intake._kind``).
IMAGE = "image"  # Pillow: pixel size and EXIF orientation; decodable (full level)
CAPTION = "caption"  # .json with a prompt, or UTF-8 .txt
SNIFF = "sniff"  # an embedding's head: not pickle (only ever kept when that check passed)


@dataclass(frozen=True, slots=True)
class FileOutcome:
    kind: str
    reason: str | None = None  # short drop reason ("unreadable_image", "bad_caption"); None: valid
    width: int | None = None  # displayed size of an image (EXIF orientation applied)
    height: int | None = None


class IntakeCache:
    """Outcomes by (modality, name), each with the identity of the bytes it was found for."""

    def __init__(self, level: str) -> None:
        self.level = level
        self._known: dict[tuple[str, str], tuple[str, FileOutcome]] = {}

    def __len__(self) -> int:
        return len(self._known)

    def get(self, entry: FileEntry, kind: str) -> FileOutcome | None:
        hit = self._known.get((entry.modality, entry.name))
        if hit is None or hit[0] != entry.fingerprint or hit[1].kind != kind:
            return None
        return hit[1]

    def put(self, entry: FileEntry, outcome: FileOutcome) -> None:
        self._known[(entry.modality, entry.name)] = (entry.fingerprint, outcome)

    def update(self, other: IntakeCache) -> None:
        self._known.update(other._known)

    @classmethod
    def load(cls, paths: Iterable[Path], level: str) -> IntakeCache:
        """The outcomes of the caches at ``paths`` (later ones win) made under the current rules
        at ``level``; a missing, unreadable or other-rules cache adds nothing."""
        cache = cls(level)
        for path in paths:
            cache.update(_read(path, level))
        return cache

    def save(self, path: Path) -> Path:
        rows = sorted(self._known.items())  # ((modality, name), (fingerprint, outcome))
        outcomes = [o for _, (_, o) in rows]
        table = pa.table({
            "modality": pa.array([m for (m, _), _ in rows], pa.string()),
            "name": pa.array([n for (_, n), _ in rows], pa.string()),
            "fingerprint": pa.array([fp for _, (fp, _) in rows], pa.string()),
            "kind": pa.array([o.kind for o in outcomes], pa.string()),
            "reason": pa.array([o.reason for o in outcomes], pa.string()),
            "width": pa.array([o.width for o in outcomes], pa.int32()),
            "height": pa.array([o.height for o in outcomes], pa.int32()),
        }).replace_schema_metadata({"rules_version": str(RULES_VERSION), "validate": self.level})
        with atomic_writer(path) as fh:
            pq.write_table(table, fh, compression="zstd")
        return Path(path)


def _read(path: Path, level: str) -> IntakeCache:
    cache = IntakeCache(level)
    try:
        table = pq.read_table(path)
        meta = table.schema.metadata or {}
        if meta.get(b"rules_version") != str(RULES_VERSION).encode() or meta.get(b"validate") != level.encode():
            return cache
        d = table.to_pydict()
        known = cache._known
        for m, n, fp, kind, reason, w, h in zip(
            d["modality"], d["name"], d["fingerprint"], d["kind"], d["reason"], d["width"], d["height"], strict=True
        ):
            known[(m, n)] = (fp, FileOutcome(kind, reason, w, h))
    except (OSError, ValueError, KeyError, pa.ArrowException):
        return IntakeCache(level)  # a cache only saves work: when in doubt, validate again
    return cache
