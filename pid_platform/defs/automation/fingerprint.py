"""A cheap identity of a source's raw files: a listing (names, sizes, mtimes or ETags), no reads.

Content-relevant only (``content_identity``): a local file's ctime and inode are left out, so a
``chmod -R``, ``chown``, hard link or restore that keeps mtimes requests no build."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from loader.formats.atomic import atomic_write_bytes
from pid_platform.sharding.commit.state import FINGERPRINT, state_dir
from pid_platform.sharding.intake.cache import content_identity
from pid_platform.sharding.storage import SourceStore

FINGERPRINT_NAME = FINGERPRINT


def source_fingerprint(store: SourceStore, source: str) -> tuple[str, int]:
    """(digest, number of files) of ``source``; the digest changes when any file is added,
    removed, or rewritten (its size or mtime), not when only its ctime or inode do."""
    h = hashlib.sha256()
    files = 0
    for modality in store.list_modalities(source):
        listing = store.list_files(source, modality)
        h.update(f"\0{modality}".encode())
        for batch in listing.files.to_batches(max_chunksize=64 * 1024):  # columns, a batch at a time
            d = batch.to_pydict()
            for name, size, fp in zip(d["name"], d["size"], d["fingerprint"], strict=True):
                h.update(f"\0{name}\0{size}\0{content_identity(fp)}".encode())
        files += len(listing)
    return h.hexdigest()[:16], files


def save_fingerprint(folder: Path, fingerprint: str) -> Path:
    """Record beside a staged build the fingerprint of the raw files it was made from; it moves
    with the build at the commit, so the committed build says which listing it reflects."""
    path = state_dir(folder) / FINGERPRINT_NAME
    atomic_write_bytes(path, json.dumps({"input_fingerprint": fingerprint}).encode())
    return path


def load_fingerprint(folder: Path) -> str | None:
    """The fingerprint recorded beside a build (``None``: a build made before it was recorded)."""
    try:
        return str(json.loads((state_dir(folder) / FINGERPRINT_NAME).read_bytes())["input_fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
