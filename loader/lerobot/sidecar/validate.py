"""Is a sidecar still right for a dataset? A list of problems; empty means usable."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from loader.io import StreamConfig, urls
from loader.io import roots as fs

from .build import needed_video_files
from .errors import SidecarError
from .manifest import IDENTITY_SIZE, fingerprints_match
from .schema import Sidecar

if TYPE_CHECKING:
    from loader.lerobot.meta import LeRobotMeta

_PINNED_HUB = re.compile(r"^hf://datasets/[^@]+@[0-9a-f]{40}(/|$)")


def validate_sidecar(path: str | os.PathLike[str], meta: LeRobotMeta, *,
                     repo_id: str | None = None, revision: str | None = None,
                     require_complete: bool = False, allow_unstable: bool = False,
                     stream_config: StreamConfig | None = None, workers: int = 8) -> list[str]:
    """Problems that make the sidecar at ``path`` unusable for ``meta`` (empty list: valid).

    Checks the schema version and arrays' presence, each file's current identity against the
    stored fingerprint (a video replaced at the same path with the same size is caught; files
    without a stable identity always count as stale; entries LeRobot wrote without a source
    fingerprint are checked by size where that identifies a file, see ``size_identifies``), and
    missing or extra video files against
    ``meta.video_files()`` (or, for a subset sidecar, the files of its episodes).
    ``repo_id``/``revision``, when given, must match the manifest; ``require_complete`` rejects
    subset sidecars. ``allow_unstable`` accepts files without a stable identity (for a sidecar
    built during the current open). One HEAD (or stat) per file; no video bytes are read.
    """
    try:
        sc = Sidecar(path)
    except FileNotFoundError:
        return [f"{path}: no sidecar file"]
    except SidecarError as e:
        return [str(e)]
    with sc:
        info = sc.info
    problems: list[str] = []
    if repo_id is not None and info.repo_id != repo_id:
        problems.append(f"{path}: built for repo {info.repo_id!r}, not {repo_id!r}")
    if revision is not None and info.revision != revision:
        problems.append(f"{path}: built for revision {info.revision!r}, not {revision!r}")
    if info.subset and require_complete:
        problems.append(f"{path}: a subset sidecar (episodes {_short(info.episodes or ())}); "
                        "a complete one is needed")
    try:
        expected = needed_video_files(meta, info.episodes if info.subset else None)
    except (KeyError, IndexError, ValueError) as e:
        return [*problems, f"{path}: its episodes do not exist in the dataset ({e})"]
    stored = set(info.paths)
    expected_set = set(expected)
    missing = [r for r in expected if r not in stored]
    extra = sorted(stored - expected_set)
    if missing:
        problems.append(f"{path}: {len(missing)} video files are not indexed: {_short(missing)}")
    if extra:
        problems.append(f"{path}: indexes {len(extra)} files the dataset does not list: {_short(extra)}")

    by_size = [f for f in info.files if f.identity == IDENTITY_SIZE and f.path in expected_set]
    if by_size and not size_identifies(meta.root):
        problems.append(f"{path}: {len(by_size)} files have no source fingerprint (a LeRobot sidecar "
                        f"for a root whose files can change at the same path); rebuilt locally: "
                        f"{_short(f.path for f in by_size)}")
        by_size = []
    unstable = [f.path for f in info.files
                if f.identity != IDENTITY_SIZE and (not f.stable or not f.fingerprint)]
    if unstable and not allow_unstable:
        problems.append(f"{path}: {len(unstable)} files have no stable identity and are always "
                        f"re-indexed: {_short(unstable)}")
    to_check = [f for f in info.files if f.stable and f.fingerprint and f.path in expected_set]
    current = _identities(meta.root, [f.path for f in (*to_check, *by_size)], stream_config, workers)
    for f in by_size:
        cur = current[f.path]
        if isinstance(cur, BaseException):
            problems.append(f"{path}: cannot check {f.path}: {type(cur).__name__}: {cur}")
        elif cur.size != f.size:
            problems.append(f"{path}: {f.path} changed size ({f.size} -> {cur.size})")
    for f in to_check:
        cur = current[f.path]
        if isinstance(cur, BaseException):
            problems.append(f"{path}: cannot check {f.path}: {type(cur).__name__}: {cur}")
        elif not cur.stable or not cur.fingerprint:
            problems.append(f"{path}: {f.path} has no stable identity now; re-index it")
        elif cur.size != f.size:
            problems.append(f"{path}: {f.path} changed size ({f.size} -> {cur.size})")
        elif not fingerprints_match(f.fingerprint, cur.fingerprint):
            problems.append(f"{path}: {f.path} was replaced (fingerprint {f.fingerprint} -> "
                            f"{cur.fingerprint})")
    return problems


def _identities(root: str, rels: list[str], config: StreamConfig | None,
                workers: int) -> dict[str, fs.FileIdentity | BaseException]:
    try:
        return dict(fs.file_identities(root, rels, config=config, workers=workers))
    except Exception:
        # One file failed (missing, forbidden): ask one at a time to say which.
        out: dict[str, fs.FileIdentity | BaseException] = {}
        for rel in rels:
            try:
                out[rel] = fs.file_identity(root, rel, config=config)
            except Exception as e:
                out[rel] = e
        return out


def _short(items, limit: int = 5) -> str:
    items = list(items)
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f" ... (+{len(items) - limit} more)" if len(items) > limit else "")


def size_identifies(root: str) -> bool:
    """Does a file's size alone identify it under ``root``, as LeRobot assumes for the entries it
    writes without a source fingerprint? Yes for an ``hf://`` root pinned to a commit (its files
    cannot change) and for a local folder (LeRobot checks local sizes only: a same-size
    replacement goes unnoticed there, unlike with our own fingerprints). Elsewhere (``s3://``,
    ``http(s)://``, an unpinned hub root) a file can be replaced at the same path and size."""
    root = str(root)
    if urls.is_hf(root):
        return _PINNED_HUB.match(root) is not None
    return urls.is_local(root)
