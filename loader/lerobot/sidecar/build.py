"""Build a schema-v3 sidecar (LeRobot's NPZ layout, schema.py) from the MP4 boxes (no decoding).

Memory stays bounded with many sources: at most ``workers`` per-file indexes exist at once.
Files are indexed in sorted order through a sliding window of ``workers`` futures, and each
finished index is streamed into the temporary NPZ (a zip on disk, beside the output) before the
next file is submitted. Writing in submission order keeps the bytes deterministic (the same
dataset gives the same sidecar whatever ``workers`` is); a slow file only delays the window.
The manifest goes in last and the temporary file is renamed into place: a failed or killed
build leaves the previous sidecar untouched.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from loader.formats.atomic import atomic_writer
from loader.io import StreamConfig
from loader.io import roots as fs
from loader.lerobot.mp4 import index_mp4

from .errors import SidecarBuildError
from .schema import (
    SidecarFile,
    SidecarManifest,
    SidecarWriter,
    episodes_tuple,
    file_id,
    public_root,
)

if TYPE_CHECKING:
    from loader.lerobot.meta import LeRobotMeta

log = logging.getLogger(__name__)

CREATED_BY = "pid-platform loader.lerobot.sidecar"
# progress(done, total, rel, bytes_read): called in the calling thread after each file is
# written; bytes_read is what indexing that MP4 read (box headers and moov, never media data).
Progress = Callable[[int, int, str, int], None]


def needed_video_files(meta: LeRobotMeta, episodes: Sequence[int] | None = None) -> list[str]:
    """Sorted relative MP4 paths: all of the dataset's, or those holding ``episodes``."""
    if episodes is None:
        return list(meta.video_files())
    rels: set[str] = set()
    for ep in episodes_tuple(episodes) or ():
        info = meta.episode(ep)
        for key in meta.video_keys:
            span = info.videos[key]
            rels.add(meta.video_rel(key, span.chunk, span.file))
    return sorted(rels)


def _index_one(data_root: str, rel: str, config: StreamConfig | None) -> tuple[Any, fs.FileIdentity]:
    # Identity first: if the file changes while it is read, the stored fingerprint is the old
    # one and the next validation sees the sidecar as stale (never the other way round).
    ident = fs.file_identity(data_root, rel, config=config)
    idx = index_mp4(fs.url(data_root, rel), stream_config=config)
    if idx.file_size != ident.size:
        raise SidecarBuildError(
            f"{rel}: the file changed while it was indexed (size {ident.size} -> {idx.file_size}); "
            "keep videos unchanged while a sidecar is built, then build again")
    return idx, ident


def _entry(fid: str, rel: str, idx: Any, ident: fs.FileIdentity) -> tuple[SidecarFile, dict[str, np.ndarray]]:
    arrays = {
        "sample_pts": np.asarray(idx.sample_pts, dtype=np.float64),
        "sample_durations": np.asarray(idx.sample_durations, dtype=np.int64),
        "sample_composition_offsets": np.asarray(idx.sample_composition_offsets, dtype=np.int64),
        "sample_sizes": np.asarray(idx.sample_sizes, dtype=np.int64),
        "sample_offsets": np.asarray(idx.sample_offsets, dtype=np.int64),
        "sync_samples": np.asarray(idx.sync_samples, dtype=np.int64),
    }
    edit = None if idx.edit is None else {str(k): int(v) for k, v in dict(idx.edit).items()}
    entry = SidecarFile(
        id=fid, path=rel, size=int(ident.size), fingerprint=ident.fingerprint,
        stable=bool(ident.stable and ident.fingerprint), ftyp=bytes(idx.ftyp),
        stsd=bytes(idx.stsd), timescale=int(idx.timescale), track_id=int(idx.track_id),
        codec=str(idx.codec), width=int(idx.width), height=int(idx.height),
        mdat=tuple((int(o), int(s)) for o, s in idx.mdat), edit=edit,
        sample_count=len(arrays["sample_pts"]), moov_offset=int(idx.moov[0]),
        duration=int(arrays["sample_durations"].sum()),
    )
    return entry, arrays


def build_sidecar(meta: LeRobotMeta, output: str | os.PathLike[str], *, repo_id: str,
                  revision: str | None, data_root: str, workers: int = 1,
                  episodes: Sequence[int] | None = None, progress: Progress | None = None,
                  stream_config: StreamConfig | None = None,
                  created_by: str = CREATED_BY) -> SidecarManifest:
    """Index the dataset's MP4 files and write a schema-v3 sidecar to ``output`` atomically.

    ``episodes`` restricts it to the files holding those episodes (a ``subset`` sidecar, which
    must not be published). ``data_root`` is read from (credentials belong in the environment
    or ``stream_config``) and stored without userinfo or query. Raises SidecarBuildError
    naming the file that failed; ``output`` is then left as it was.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    stored_root = public_root(data_root)
    if stored_root != data_root:
        # Refused before anything is written: a credential in the root would reach logs.
        raise ValueError(f"data root {stored_root!r} carries user info, a query or a fragment; "
                         "put credentials in the environment (AWS_*, HF_TOKEN) or in "
                         "stream_config, never in the URL")
    rels = needed_video_files(meta, episodes)
    total = len(rels)
    entries: list[SidecarFile] = []
    log.info("indexing %d MP4 files of %s@%s with %d workers", total, repo_id, revision, workers)
    with atomic_writer(output) as fh, ThreadPoolExecutor(max_workers=workers,
                                                         thread_name_prefix="sidecar-index") as pool:
        writer = SidecarWriter(fh)
        window: deque[tuple[int, str, Future]] = deque()
        todo = iter(enumerate(rels))
        try:
            for _ in range(workers):
                _submit(pool, window, todo, data_root, stream_config)
            while window:
                i, rel, fut = window.popleft()
                try:
                    idx, ident = fut.result()
                except SidecarBuildError:
                    raise
                except Exception as e:
                    raise SidecarBuildError(f"cannot index {rel} under {stored_root}: "
                                            f"{type(e).__name__}: {e}") from e
                entry, arrays = _entry(file_id(i), rel, idx, ident)
                bytes_read = idx.bytes_read
                del idx
                writer.add(entry.id, arrays)
                del arrays
                entries.append(entry)
                _submit(pool, window, todo, data_root, stream_config)
                if progress is not None:
                    progress(len(entries), total, rel, bytes_read)
            manifest = SidecarManifest(
                repo_id=repo_id, revision=revision, data_root=stored_root, files=tuple(entries),
                subset=episodes is not None, episodes=episodes_tuple(episodes),
                created_by=created_by)
            writer.finish(manifest)
        except BaseException:
            for _, _, fut in window:
                fut.cancel()
            writer.abort()
            raise
    log.info("sidecar for %s@%s written: %d files, %d samples", repo_id, revision, total,
             sum(e.sample_count for e in entries))
    return manifest


def _submit(pool: ThreadPoolExecutor, window: deque, todo, data_root: str,
            config: StreamConfig | None) -> None:
    nxt = next(todo, None)
    if nxt is not None:
        i, rel = nxt
        window.append((i, rel, pool.submit(_index_one, data_root, rel, config)))
