"""LeRobot v3 dataset metadata: ``meta/info.json``, ``meta/tasks.parquet``, ``meta/episodes/``.

Read through ``loader.io.roots`` so one reader serves local, ``s3://``, ``http(s)://`` and
``hf://`` roots. Only metadata is read here; video and data payloads are not touched.

Layout (LeRobot ``src/lerobot/datasets/utils.py``)::

    meta/info.json                                   codebase_version "v3.x", fps, features, templates
    meta/tasks.parquet                               task string (index "task" / "__index_level_0__") -> task_index
    meta/episodes/chunk-{c:03d}/file-{f:03d}.parquet one row per episode
    data/chunk-{c:03d}/file-{f:03d}.parquet          (info.json "data_path")
    videos/{video_key}/chunk-{c:03d}/file-{f:03d}.mp4 (info.json "video_path")
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loader.formats.errors import short_repr
from loader.formats.strict_doc import load_json_doc
from loader.io import StreamConfig
from loader.io import roots as fs

__all__ = [
    "DEFAULT_DATA_PATH",
    "DEFAULT_EPISODES_PATH",
    "DEFAULT_VIDEO_PATH",
    "EpisodeInfo",
    "LeRobotMeta",
    "LeRobotMetaError",
    "MetaFileMissingError",
    "VideoSpan",
]

INFO_PATH = "meta/info.json"
MAX_FPS = 100_000  # frames per second: past any camera; a larger one overflows timestamps later
MAX_INFO_BYTES = 16 * 1024 * 1024  # LeRobot writes a few KB: features, templates, counts
TASKS_PATH = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
CHUNK_FILE_PATTERN = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DEFAULT_EPISODES_PATH = EPISODES_DIR + "/" + CHUNK_FILE_PATTERN + ".parquet"
DEFAULT_DATA_PATH = "data/" + CHUNK_FILE_PATTERN + ".parquet"
DEFAULT_VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE_PATTERN + ".mp4"

_CHUNK_DIR = re.compile(r"chunk-(\d+)")
_EPISODES_FILE = re.compile(r"file-(\d+)\.parquet")
_EPISODE_COLUMNS = ("episode_index", "length", "dataset_from_index", "dataset_to_index",
                    "data/chunk_index", "data/file_index")
_VIDEO_FIELDS = ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
_CONVERT_HINT = ("convert it to v3.0 with LeRobot's converter "
                 "(python -m lerobot.datasets.v30.convert_dataset_v21_to_v30 --repo-id=...)")


class LeRobotMetaError(ValueError):
    """The dataset's metadata is missing, malformed or of another codebase version."""


class MetaFileMissingError(LeRobotMetaError, FileNotFoundError):
    """A metadata file the reader needs is not under the root."""


@dataclass(frozen=True)
class VideoSpan:
    """Where one episode lies in one camera's MP4: ``[from_timestamp, to_timestamp)`` seconds.

    A frame's presentation time in the MP4 is ``from_timestamp + timestamp``.
    """

    chunk: int
    file: int
    from_timestamp: float
    to_timestamp: float


@dataclass(frozen=True)
class EpisodeInfo:
    episode_index: int
    length: int
    dataset_from_index: int   # global frame index of the first frame
    dataset_to_index: int     # one past the last
    data_chunk: int
    data_file: int
    tasks: tuple[str, ...]
    videos: dict[str, VideoSpan] = field(default_factory=dict)


@dataclass(eq=False)  # identity: it holds tables and caches
class LeRobotMeta:
    """The metadata of one LeRobot v3 dataset root (see the module docstring for the layout)."""

    root: str
    info: dict[str, Any]
    tasks: dict[int, str]
    episodes: pa.Table          # all meta/episodes files, sorted by episode_index
    episode_files: list[str]    # the meta/episodes files read, in (chunk, file) order
    config: StreamConfig | None = field(default=None, repr=False)  # how the files were read
    _rows: dict[int, int] = field(repr=False, default_factory=dict)
    _numeric: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    _episode_infos: dict[int, EpisodeInfo] = field(repr=False, default_factory=dict)

    # -- loading --------------------------------------------------------------------------------

    @classmethod
    def load(cls, root: str | os.PathLike[str], *, config: StreamConfig | None = None,
             with_stats: bool = False, pin_revision: bool = False) -> LeRobotMeta:
        """Read ``info.json``, ``tasks.parquet`` and every ``meta/episodes`` file under ``root``.

        ``with_stats=False`` leaves out the per-episode ``stats/...`` columns (large, and not
        needed to locate frames), as LeRobot's own ``load_episodes`` does. ``pin_revision``:
        an ``hf://`` root at a branch or tag is first resolved to its current commit
        (``fs.pin_revision``) and ``.root`` names that commit, so metadata and videos come
        from one snapshot.
        """
        root = os.fspath(root)
        if pin_revision:
            root = fs.pin_revision(root, config=config)
        info = _load_info(root, config)
        video_keys = _video_keys(info, root)
        _check_templates(info, root, video_keys)
        tasks = _load_tasks(root, config)
        files = _episode_files(root, config)
        episodes = _load_episodes(root, files, video_keys, config, with_stats)
        meta = cls(root=root, info=info, tasks=tasks, episodes=episodes, episode_files=list(files),
                   config=config)
        meta._rows = _row_index(episodes, root, files)
        return meta

    # -- info.json ------------------------------------------------------------------------------

    @property
    def revision(self) -> str | None:
        """The revision an ``hf://`` root names; None for other roots."""
        return fs.hf_revision(self.root)

    @property
    def codebase_version(self) -> str:
        return str(self.info["codebase_version"])

    @property
    def fps(self) -> int:
        return int(self.info["fps"])

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        return self.info["features"]

    @cached_property
    def video_keys(self) -> list[str]:
        """Camera feature names (dtype "video"), sorted."""
        return _video_keys(self.info, self.root)

    @property
    def data_path(self) -> str:
        return self.info["data_path"]

    @property
    def video_path(self) -> str | None:
        return self.info.get("video_path")

    def video_shape(self, key: str) -> tuple[int, int, int]:
        """(height, width, channels) of camera ``key``."""
        return tuple(int(x) for x in self.features[key]["shape"])  # type: ignore[return-value]

    # -- episodes -------------------------------------------------------------------------------

    @property
    def episode_indices(self) -> np.ndarray:
        """Every episode index, ascending (int64)."""
        return self.episodes.column("episode_index").to_numpy()

    def __len__(self) -> int:
        return self.episodes.num_rows

    def episode(self, episode_index: int) -> EpisodeInfo:
        """One episode's row (built once per episode: readers ask per sample)."""
        info = self._episode_infos.get(int(episode_index))
        if info is None:
            info = self._episode_infos[int(episode_index)] = self._episode_info(int(episode_index))
        return info

    def _episode_info(self, episode_index: int) -> EpisodeInfo:
        row = self._rows.get(int(episode_index))
        if row is None:
            raise KeyError(f"{self.root}: no episode {episode_index} in {EPISODES_DIR}/ "
                           f"({len(self._rows)} episodes)")
        col = self._column
        videos = {
            key: VideoSpan(chunk=int(col(f"videos/{key}/chunk_index")[row]),
                           file=int(col(f"videos/{key}/file_index")[row]),
                           from_timestamp=float(col(f"videos/{key}/from_timestamp")[row]),
                           to_timestamp=float(col(f"videos/{key}/to_timestamp")[row]))
            for key in self.video_keys
        }
        tasks = self._tasks_per_episode[row]
        return EpisodeInfo(
            episode_index=int(col("episode_index")[row]), length=int(col("length")[row]),
            dataset_from_index=int(col("dataset_from_index")[row]),
            dataset_to_index=int(col("dataset_to_index")[row]),
            data_chunk=int(col("data/chunk_index")[row]), data_file=int(col("data/file_index")[row]),
            tasks=tasks, videos=videos,
        )

    @cached_property
    def _tasks_per_episode(self) -> list[tuple[str, ...]]:
        if "tasks" not in self.episodes.column_names:
            return [()] * self.episodes.num_rows
        return [tuple(t or ()) for t in self.episodes.column("tasks").to_pylist()]

    def _column(self, name: str) -> np.ndarray:
        """A numeric episodes column as numpy, converted once (episode() is called per sample)."""
        arr = self._numeric.get(name)
        if arr is None:
            arr = self._numeric[name] = self.episodes.column(name).to_numpy()
        return arr

    # -- paths ----------------------------------------------------------------------------------

    def data_rel(self, chunk: int, file: int) -> str:
        return self.data_path.format(chunk_index=int(chunk), file_index=int(file))

    def video_rel(self, key: str, chunk: int, file: int) -> str:
        if not self.video_path:
            raise LeRobotMetaError(f"{fs.url(self.root, INFO_PATH)}: no video_path (a dataset without videos)")
        return self.video_path.format(video_key=key, chunk_index=int(chunk), file_index=int(file))

    def video_files(self) -> list[str]:
        """Sorted unique relative MP4 paths over all episodes and cameras."""
        out = set()
        for key in self.video_keys:
            for chunk, file in self._pairs(f"videos/{key}/chunk_index", f"videos/{key}/file_index"):
                out.add(self.video_rel(key, chunk, file))
        return sorted(out)

    def data_files(self) -> list[str]:
        """Sorted unique relative data parquet paths over all episodes."""
        return sorted({self.data_rel(c, f) for c, f in self._pairs("data/chunk_index", "data/file_index")})

    def _pairs(self, chunk_col: str, file_col: str) -> set[tuple[int, int]]:
        chunks = self.episodes.column(chunk_col).to_numpy()
        files = self.episodes.column(file_col).to_numpy()
        return set(zip(chunks.tolist(), files.tolist(), strict=True))


# -- info.json --------------------------------------------------------------------------------

def _load_info(root: str, config: StreamConfig | None) -> dict[str, Any]:
    where = fs.url(root, INFO_PATH)
    try:
        raw = fs.read_bytes(root, INFO_PATH, config=config)
    except FileNotFoundError:
        raise MetaFileMissingError(
            f"{where}: not found. Is {root} the root of a LeRobot v3 dataset (the folder holding "
            "meta/, data/ and videos/)? For hf:// roots, check the repo id and revision."
        ) from None
    # Bounded and strict (no NaN, no duplicate key, no endless nesting or digits): the sidecar
    # build and its Dagster run read this file as someone else wrote it.
    info = load_json_doc(raw, where, max_bytes=MAX_INFO_BYTES, fix="re-download or rewrite the file",
                         error=LeRobotMetaError)
    if not isinstance(info, dict):
        raise LeRobotMetaError(f"{where}: expected a JSON object, got {type(info).__name__}")
    version = str(info.get("codebase_version", ""))
    if not re.fullmatch(r"v3\.\d+", version):
        found = f"codebase_version {short_repr(version)}" if version else "no codebase_version"
        raise LeRobotMetaError(f"{where}: {found}; this reader needs a LeRobot v3.x dataset: {_CONVERT_HINT}")
    fps = info.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= MAX_FPS or int(fps) != fps:
        raise LeRobotMetaError(f"{where}: fps must be a positive integer (at most {MAX_FPS}), got {short_repr(fps)}")
    if not isinstance(info.get("features"), dict):
        raise LeRobotMetaError(f"{where}: no 'features' object")
    return info


def _video_keys(info: dict[str, Any], root: str) -> list[str]:
    keys = []
    for key, ft in info["features"].items():
        if isinstance(ft, dict) and ft.get("dtype") == "video":
            shape = ft.get("shape")
            if not (isinstance(shape, list | tuple) and len(shape) == 3):
                raise LeRobotMetaError(
                    f"{fs.url(root, INFO_PATH)}: video feature {short_repr(key)} has shape {short_repr(shape)}; "
                    "expected (height, width, channels)")
            keys.append(key)
    return sorted(keys)


def _check_templates(info: dict[str, Any], root: str, video_keys: list[str]) -> None:
    where = fs.url(root, INFO_PATH)
    checks = [("data_path", {"chunk_index": 0, "file_index": 0}, True)]
    if video_keys:
        checks.append(("video_path", {"video_key": video_keys[0], "chunk_index": 0, "file_index": 0}, True))
    elif info.get("video_path"):
        checks.append(("video_path", {"video_key": "x", "chunk_index": 0, "file_index": 0}, False))
    for name, fields, required in checks:
        template = info.get(name)
        if not isinstance(template, str) or not template:
            if required:
                raise LeRobotMetaError(f"{where}: no {name!r} template (v3 writes e.g. "
                                       f"{DEFAULT_DATA_PATH if name == 'data_path' else DEFAULT_VIDEO_PATH!r})")
            continue
        try:
            rel = template.format(**fields)
            fs.check_rel(rel)
        except (KeyError, IndexError, ValueError) as e:
            raise LeRobotMetaError(
                f"{where}: {name} template {short_repr(template)} cannot be filled with {sorted(fields)} ({e}); "
                f"a v2-style template (episode_chunk / episode_index) means an older dataset: {_CONVERT_HINT}"
            ) from None


# -- tasks.parquet ----------------------------------------------------------------------------

def _read_parquet(root: str, rel: str, config: StreamConfig | None,
                  columns_filter=None, raw: bytes | None = None) -> pa.Table:
    where = fs.url(root, rel)
    try:
        if raw is None:
            raw = fs.read_bytes(root, rel, config=config)
    except FileNotFoundError:
        raise MetaFileMissingError(f"{where}: not found; the dataset's metadata is incomplete "
                                   "(re-download it, or re-run the writer that made it)") from None
    try:
        pf = pq.ParquetFile(pa.BufferReader(raw))
        names = pf.schema_arrow.names
        columns = [n for n in names if columns_filter(n)] if columns_filter else None
        return pf.read(columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise LeRobotMetaError(f"{where}: not a readable parquet file ({e})") from None


def _load_tasks(root: str, config: StreamConfig | None) -> dict[int, str]:
    where = fs.url(root, TASKS_PATH)
    table = _read_parquet(root, TASKS_PATH, config)
    names = table.column_names
    # pandas stores a named index as a column of that name ("task"); an unnamed one, as older
    # writers left it, as "__index_level_0__".
    task_col = next((c for c in ("task", "__index_level_0__") if c in names), None)
    if task_col is None or "task_index" not in names:
        raise LeRobotMetaError(
            f"{where}: expected columns 'task_index' and 'task' (or '__index_level_0__'), found {names}")
    tasks: dict[int, str] = {}
    for index, task in zip(table.column("task_index").to_pylist(), table.column(task_col).to_pylist(),
                           strict=True):
        if index is None or task is None:
            raise LeRobotMetaError(f"{where}: a null task or task_index")
        if int(index) in tasks:
            raise LeRobotMetaError(f"{where}: task_index {index} appears twice")
        tasks[int(index)] = str(task)
    return tasks


# -- meta/episodes ----------------------------------------------------------------------------

def _episode_files(root: str, config: StreamConfig | None) -> dict[str, bytes | None]:
    """Every meta/episodes/chunk-*/file-*.parquet, in (chunk, file) order.

    Listed where the backend can list; otherwise probed in LeRobot's writing order (files
    0, 1, .. of chunk 0 until one is missing, then chunk 1 from file 0, ..) until a chunk has
    no file 0. Probing reads each file whole (one request each, plus one 404 per chunk), so
    the probed bytes come back with the names; listed files come back as ``None``.
    """
    out: dict[str, bytes | None] = {}
    try:
        chunk_names = fs.list_dir(root, EPISODES_DIR, config=config)
    except NotImplementedError:
        chunk_names = None
    if chunk_names is not None:
        for _, chunk in sorted((int(m.group(1)), n) for n in chunk_names if (m := _CHUNK_DIR.fullmatch(n))):
            names = fs.list_dir(root, f"{EPISODES_DIR}/{chunk}", config=config)
            for _, name in sorted((int(m.group(1)), n) for n in names if (m := _EPISODES_FILE.fullmatch(n))):
                out[f"{EPISODES_DIR}/{chunk}/{name}"] = None
    else:
        chunk = 0
        while True:
            file = 0
            while True:
                rel = DEFAULT_EPISODES_PATH.format(chunk_index=chunk, file_index=file)
                try:
                    out[rel] = fs.read_bytes(root, rel, config=config)
                except FileNotFoundError:
                    break
                file += 1
            if file == 0:
                break
            chunk += 1
    if not out:
        raise MetaFileMissingError(
            f"{fs.url(root, EPISODES_DIR)}/: no chunk-XXX/file-YYY.parquet files; the dataset's "
            "episode metadata is missing (re-download meta/, or finalize the dataset writer)")
    return out


def _load_episodes(root: str, files: dict[str, bytes | None], video_keys: list[str], config: StreamConfig | None,
                   with_stats: bool) -> pa.Table:
    required = list(_EPISODE_COLUMNS) + [f"videos/{k}/{f}" for k in video_keys for f in _VIDEO_FIELDS]

    def keep(name: str) -> bool:
        return with_stats or not name.startswith("stats/")

    tables = []
    for rel, raw in files.items():
        table = _read_parquet(root, rel, config, keep, raw)
        missing = [c for c in required if c not in table.column_names]
        if missing:
            raise LeRobotMetaError(
                f"{fs.url(root, rel)}: missing episode columns {missing}; expected LeRobot v3 "
                "episode metadata (re-export the dataset with LeRobot >= 3.0)")
        tables.append(table)
    try:
        # Files from different writer versions may differ in width (float32 vs float64) or in
        # optional columns; permissive promotion unifies them, absent columns become nulls.
        table = pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as e:
        raise LeRobotMetaError(f"{fs.url(root, EPISODES_DIR)}/: episode files do not share a schema ({e})") from None
    for name in required:
        if table.column(name).null_count:
            raise LeRobotMetaError(f"{fs.url(root, EPISODES_DIR)}/: column {name!r} has nulls")
    return table.sort_by("episode_index")


def _row_index(episodes: pa.Table, root: str, files: dict[str, bytes | None]) -> dict[int, int]:
    indices = episodes.column("episode_index").to_numpy()
    dupes = np.unique(indices[1:][np.diff(indices) == 0])
    if dupes.size:
        raise LeRobotMetaError(
            f"{fs.url(root, EPISODES_DIR)}/: episode_index {dupes[:5].tolist()} appear in more than "
            f"one row across {len(files)} files; remove the stale file")
    return {int(e): row for row, e in enumerate(indices.tolist())}
