"""A cheap identity of a source's raw files: a listing (names, sizes, mtimes or ETags), no reads."""

from __future__ import annotations

import hashlib

from pid_platform.sharding.storage import SourceStore


def source_fingerprint(store: SourceStore, source: str) -> tuple[str, int]:
    """(digest, number of files) of ``source``; the digest changes when any file is added,
    removed, or rewritten."""
    h = hashlib.sha256()
    files = 0
    for modality in store.list_modalities(source):
        listing = store.list_files(source, modality)
        h.update(f"\0{modality}".encode())
        for e in listing.entries:
            h.update(f"\0{e.name}\0{e.size}\0{e.fingerprint}".encode())
        files += len(listing.entries)
    return h.hexdigest()[:16], files
