"""Read a published sidecar back: follow the pointer, download the NPZ, check its sha256.

The read side of ``publish_layout.py``: training passes it to ``ensure_sidecar`` as the
``published`` callable (training only ever reads; the build side publishes). A pointer that names
anything but a plain file beside it is refused (a pointer must not be able to point outside).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import quote

from loader.formats.atomic import atomic_writer
from loader.io import StreamConfig, open_url, urls
from loader.io import roots as fs
from loader.lerobot.sidecar.publish_layout import (
    SIDECAR_BRANCH,
    SIDECAR_DIR,
    check_pointed_bytes,
    pointed_sidecar,
    pointer_name,
    read_pointer,
)

_CHUNK = 1 << 20


def published_home(repo_id: str, data_root: str) -> str:
    """Where a dataset's sidecars are published: the ``lerobot-sidecars`` branch of a Hub dataset
    (for ``hf://`` roots), else the dataset root itself (an ``s3://`` bucket root, a folder)."""
    if urls.is_hf(data_root):
        return f"hf://datasets/{repo_id}@{quote(SIDECAR_BRANCH, safe='')}"
    return data_root


def fetch_published(home: str, revision: str | None, dest: str | os.PathLike[str], *,
                    config: StreamConfig | None = None) -> Path | None:
    """Download the sidecar published under ``home`` for ``revision`` to ``dest``; None if there
    is none. Raises PublishError if the pointer or the bytes it names do not match."""
    rel_pointer = f"{SIDECAR_DIR}/{pointer_name(revision)}"
    try:
        raw = fs.read_bytes(home, rel_pointer, config=config)
    except FileNotFoundError:
        return None
    where = fs.url(home, rel_pointer)
    doc = read_pointer(raw, where)
    name = pointed_sidecar(doc, where)
    digest, size = hashlib.sha256(), 0
    dest = Path(dest)
    with atomic_writer(dest) as out, open_url(fs.url(home, f"{SIDECAR_DIR}/{name}"), config=config) as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            out.write(chunk)
        check_pointed_bytes(doc, where, name, digest.hexdigest(), size)
    return dest
