"""``ensure_sidecar``: a valid schema-v3 sidecar for a dataset revision, at training start.

Order: (1) the local revision-keyed cache entry, if valid; (2) a valid published sidecar
(``published()`` returns a downloaded file), copied into the cache; (3) a local build. Steps
(2) and (3) run under a process lock, so of the ranks or jobs that start together one installs
or builds and the others wait (up to ``lock_timeout_s``) and reuse it. Every install is a
temporary file renamed into place: a failed or killed build leaves the previous file intact.
Training is read-only: nothing is ever uploaded from here.

Cache entry: ``<cache_root>/<repo_id>/<revision>/<root digest>/mp4-sidecar.v3.npz``; the schema
version is in the name, so an older sidecar is rebuilt into a separate entry (and a wrong-schema
file at this name is rebuilt too). The root digest keeps sidecars of the same revision read
through different roots (hub, bucket mirror) apart: their fingerprints differ.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from loader.formats.atomic import TMP_MARKER, atomic_writer
from loader.io import StreamConfig

from .build import Progress, build_sidecar
from .paths import default_sidecar_root, safe_component
from .process_lock import DEFAULT_LOCK_TIMEOUT_S, process_lock
from .schema import SIDECAR_SCHEMA_VERSION, public_root
from .validate import validate_sidecar

if TYPE_CHECKING:
    from loader.lerobot.meta import LeRobotMeta

log = logging.getLogger(__name__)

SIDECAR_NAME = f"mp4-sidecar.v{SIDECAR_SCHEMA_VERSION}.npz"


def sidecar_cache_path(cache_root: str | os.PathLike[str] | None, *, repo_id: str,
                       revision: str | None, data_root: str) -> Path:
    """Where ``ensure_sidecar`` keeps the sidecar of ``repo_id`` at ``revision`` read via ``data_root``."""
    root = Path(cache_root) if cache_root is not None else default_sidecar_root()
    root_key = hashlib.sha256(public_root(data_root).encode("utf-8")).hexdigest()[:16]
    return (root / safe_component(repo_id) / safe_component(revision or "unpinned") / root_key
            / SIDECAR_NAME)


def lock_path(entry: Path) -> Path:
    return entry.with_name(entry.name + ".lock")


def ensure_sidecar(meta: LeRobotMeta, *, repo_id: str, revision: str | None,
                   cache_root: str | os.PathLike[str] | None = None,
                   lock_timeout_s: float | None = DEFAULT_LOCK_TIMEOUT_S,
                   published: Callable[[], str | os.PathLike[str] | None] | None = None,
                   workers: int = 1, stream_config: StreamConfig | None = None,
                   progress: Progress | None = None) -> Path:
    """A local path to a valid, complete schema-v3 sidecar for ``meta`` (see the module doc).

    ``lock_timeout_s`` is ``streaming_sidecar_lock_timeout_s``; on timeout SidecarLockTimeout
    says who holds the lock and what to do. Build errors (SidecarBuildError) leave any previous
    cache entry in place.
    """
    data_root = str(meta.root)
    entry = sidecar_cache_path(cache_root, repo_id=repo_id, revision=revision, data_root=data_root)

    def problems(path: Path, *, fresh: bool = False) -> list[str]:
        return validate_sidecar(path, meta, repo_id=repo_id, revision=revision,
                                require_complete=True, stream_config=stream_config,
                                allow_unstable=fresh)

    if entry.exists():
        found = problems(entry)
        if not found:
            log.info("using cached MP4 sidecar %s", entry)
            return entry
        log.info("cached MP4 sidecar %s is not usable: %s", entry, "; ".join(found))

    waiting_since_ns = time.time_ns()
    with process_lock(lock_path(entry), timeout_s=lock_timeout_s,
                      purpose=f"build the MP4 sidecar of {repo_id}@{revision}"):
        # Someone may have installed it while we waited. A sidecar written after we started
        # waiting counts as fresh for this open even where file identities are not stable.
        if entry.exists():
            fresh = entry.stat().st_mtime_ns >= waiting_since_ns
            if not problems(entry, fresh=fresh):
                log.info("using MP4 sidecar %s installed by another process", entry)
                return entry
        _remove_stale_temps(entry)
        if published is not None and _install_published(published, entry, problems):
            return entry
        log.info("building the MP4 sidecar of %s@%s into %s", repo_id, revision, entry)
        build_sidecar(meta, entry, repo_id=repo_id, revision=revision, data_root=data_root,
                      workers=workers, stream_config=stream_config, progress=progress)
    return entry


def _install_published(published: Callable[[], str | os.PathLike[str] | None], entry: Path,
                       problems: Callable[[Path], list[str]]) -> bool:
    found = published()
    if found is None:
        log.info("no published MP4 sidecar found")
        return False
    src = Path(found)
    bad = problems(src)
    if bad:
        log.warning("published MP4 sidecar %s is not usable, building locally: %s", src,
                    "; ".join(bad))
        return False
    with open(src, "rb") as fin, atomic_writer(entry) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    log.info("installed published MP4 sidecar %s as %s", src, entry)
    return True


def _remove_stale_temps(entry: Path) -> None:
    # Under the lock nobody else writes this entry: any temporary sibling is from a dead build.
    if not entry.parent.exists():
        return
    for p in entry.parent.glob(f"{entry.name}{TMP_MARKER}*"):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            log.info("removed the leftover of an interrupted build: %s", p)
