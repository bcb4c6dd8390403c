"""Write small LeRobot v3 datasets in the exact on-disk layout, with real encoded video: the
sample dataset of ``pid-demo`` and the datasets of the LeRobot tests.

The layout and column names follow LeRobot's writer (``src/lerobot/datasets/utils.py``,
``dataset_metadata.py``, ``lerobot_dataset.py``)::

    meta/info.json
    meta/stats.json
    meta/tasks.parquet                                  index "task" (or "__index_level_0__") + task_index
    meta/episodes/chunk-{c:03d}/file-{f:03d}.parquet    episode_index, tasks, length, data/..., dataset_from/to_index,
                                                        videos/<key>/..., stats/<feature>/<stat>, meta/episodes/...
    data/chunk-{c:03d}/file-{f:03d}.parquet             one row group per episode
    videos/{video_key}/chunk-{c:03d}/file-{f:03d}.mp4   several episodes appended, each from a keyframe

Every frame carries its global ``index`` drawn in as a block code (``pid_platform.demo.sample_video.
read_frame_number``), each camera pans across a different scikit-image photograph, and
``observation.state[0]`` equals the frame's global index, so a reader can tell which frame
(and which row) it got. A chunk holds at most ``files_per_chunk`` files, then the next
chunk starts at file 0 (LeRobot's ``update_chunk_file_indices``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pid_platform.demo.sample_video import encode_mp4, photo_frames

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
CAMERAS = ("observation.images.front", "observation.images.wrist")
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")
STATE_NAMES = ("x", "y", "z", "roll", "pitch", "gripper")
DEFAULT_TASKS = ("pick up the cube", "open the drawer")
_CODEC_NAMES = {"libsvtav1": "av1", "libx264": "h264"}


@dataclass(frozen=True)
class _Slot:
    """A chunk/file position and the rollover rule shared by data, video and episode files."""

    chunk: int = 0
    file: int = 0

    def next(self, files_per_chunk: int) -> _Slot:
        if self.file == files_per_chunk - 1:
            return _Slot(self.chunk + 1, 0)
        return _Slot(self.chunk, self.file + 1)


def _slots(n_episodes: int, per_file: int, files_per_chunk: int) -> list[_Slot]:
    """The chunk/file slot of each episode when files roll over after ``per_file`` episodes."""
    out, slot = [], _Slot()
    for e in range(n_episodes):
        if e and e % per_file == 0:
            slot = slot.next(files_per_chunk)
        out.append(slot)
    return out


def write_v3_dataset(root: Path, *, cameras: Sequence[str] = CAMERAS, episodes_per_file: int,
                     episode_lengths: Sequence[int], fps: int = 10, codec: str = "libsvtav1",
                     gop: int = 2, bframes: int = 0, faststart: bool = True,
                     size: tuple[int, int] = (64, 48), files_per_chunk: int = 1000,
                     data_episodes_per_file: int | None = None,
                     meta_episodes_per_file: int | None = None,
                     tasks: Sequence[str] = DEFAULT_TASKS, legacy_task_index: bool = False,
                     crf: int | None = None, robot_type: str = "pid-test-arm") -> Path:
    """Write a LeRobot v3 dataset under ``root`` and return ``root``.

    ``episodes_per_file`` episodes are appended into each camera's MP4 before it rolls over to
    the next file; ``data_episodes_per_file`` and ``meta_episodes_per_file`` do the same for
    the data parquet files and the ``meta/episodes`` files (default: ``episodes_per_file``, and
    all episodes in one file). ``size`` is (width, height). Episode ``e`` gets task
    ``tasks[e % len(tasks)]``. ``legacy_task_index`` stores the task strings under pandas'
    unnamed-index column ``__index_level_0__``, as older writers did. ``robot_type`` goes
    to ``meta/info.json``.
    """
    root = Path(root)
    lengths = [int(n) for n in episode_lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"episode_lengths must be positive, got {lengths}")
    if codec not in _CODEC_NAMES:
        raise ValueError(f"codec must be one of {sorted(_CODEC_NAMES)}, got {codec!r}")
    n = len(lengths)
    width, height = size
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    video_slots = _slots(n, episodes_per_file, files_per_chunk)
    data_slots = _slots(n, data_episodes_per_file or episodes_per_file, files_per_chunk)
    meta_slots = _slots(n, meta_episodes_per_file or n, files_per_chunk)
    task_of = [e % len(tasks) for e in range(n)]

    # -- videos: one MP4 per (camera, slot), episodes appended back to back --------------------
    video_cols: dict[str, dict[str, list]] = {}
    image_stats: dict[str, list[dict]] = {}
    for cam_i, cam in enumerate(cameras):
        cols = {f: [] for f in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")}
        image_stats[cam] = []
        for slot in sorted(set(video_slots), key=lambda s: (s.chunk, s.file)):
            members = [e for e in range(n) if video_slots[e] == slot]
            frames = [photo_frames(lengths[e], size, photo=PHOTOS[cam_i % len(PHOTOS)],
                                   start=int(starts[e]), step=2 + cam_i) for e in members]
            rel = VIDEO_PATH.format(video_key=cam, chunk_index=slot.chunk, file_index=slot.file)
            encoded = encode_mp4(root / rel, frames, fps=fps, codec=codec, gop=gop, bframes=bframes,
                                 faststart=faststart, crf=crf)
            for e, ep_frames, (t0, t1) in zip(members, frames, encoded.episodes, strict=True):
                assert e == len(cols["chunk_index"])
                cols["chunk_index"].append(slot.chunk)
                cols["file_index"].append(slot.file)
                cols["from_timestamp"].append(float(t0))
                cols["to_timestamp"].append(float(t1))
                image_stats[cam].append(_image_stats(ep_frames))
        video_cols[cam] = cols

    # -- data parquet: one row group per episode -----------------------------------------------
    frame_tables = [_frames_table(e, int(starts[e]), lengths[e], task_of[e], fps) for e in range(n)]
    for slot in sorted(set(data_slots), key=lambda s: (s.chunk, s.file)):
        path = root / DATA_PATH.format(chunk_index=slot.chunk, file_index=slot.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        members = [e for e in range(n) if data_slots[e] == slot]
        with pq.ParquetWriter(path, frame_tables[members[0]].schema, compression="snappy") as w:
            for e in members:
                w.write_table(frame_tables[e], row_group_size=lengths[e])

    # -- meta/episodes ---------------------------------------------------------------------------
    rows = []
    for e in range(n):
        row: dict[str, object] = {
            "episode_index": e,
            "tasks": [tasks[task_of[e]]],
            "length": lengths[e],
            "data/chunk_index": data_slots[e].chunk,
            "data/file_index": data_slots[e].file,
            "dataset_from_index": int(starts[e]),
            "dataset_to_index": int(starts[e + 1]),
        }
        for cam in cameras:
            for field, values in video_cols[cam].items():
                row[f"videos/{cam}/{field}"] = values[e]
        stats = {**_vector_stats(frame_tables[e]), **{cam: image_stats[cam][e] for cam in cameras}}
        for feature, per in stats.items():
            for stat, value in per.items():
                row[f"stats/{feature}/{stat}"] = value
        row["meta/episodes/chunk_index"] = meta_slots[e].chunk
        row["meta/episodes/file_index"] = meta_slots[e].file
        rows.append(row)
    for slot in sorted(set(meta_slots), key=lambda s: (s.chunk, s.file)):
        members = [rows[e] for e in range(n) if meta_slots[e] == slot]
        path = root / EPISODES_PATH.format(chunk_index=slot.chunk, file_index=slot.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        # pa.Table.from_pylist types these as LeRobot's from_pydict does: int64, double,
        # list<string>, and nested lists of double for the stats.
        pq.write_table(pa.Table.from_pylist(members), path, compression="snappy")

    # -- meta/tasks.parquet, info.json, stats.json ----------------------------------------------
    _write_tasks(root / "meta" / "tasks.parquet", list(tasks), legacy_task_index)
    features = _features(cameras, width, height, fps, codec)
    info = {
        "codebase_version": CODEBASE_VERSION,
        "robot_type": robot_type,
        "total_episodes": n,
        "total_frames": int(starts[-1]),
        "total_tasks": len(tasks),
        "chunks_size": files_per_chunk,
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 500,
        "fps": fps,
        "splits": {"train": f"0:{n}"},
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH,
        "features": features,
    }
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    all_frames = pa.concat_tables(frame_tables)
    totals = {**_vector_stats(all_frames),
              **{cam: _merge_image_stats(image_stats[cam]) for cam in cameras}}
    (root / "meta" / "stats.json").write_text(json.dumps(totals, indent=4))
    return root


# -- tables -------------------------------------------------------------------------------------

def _frames_table(episode: int, start: int, length: int, task_index: int, fps: int) -> pa.Table:
    index = np.arange(start, start + length, dtype=np.int64)
    frame_index = np.arange(length, dtype=np.int64)
    dim = len(STATE_NAMES)
    # observation.state[0] is the global index: a test can check it read the right row.
    state = np.empty((length, dim), dtype=np.float32)
    state[:, 0] = index
    state[:, 1:] = np.sin(index[:, None] * 0.1 + np.arange(1, dim)[None, :]).astype(np.float32)
    action = (state + 0.5).astype(np.float32)

    def vectors(a: np.ndarray) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1), pa.float32()), dim)

    # Column order as LeRobot writes it: the dataset's own features, then the default ones.
    return pa.table({
        "observation.state": vectors(state),
        "action": vectors(action),
        "timestamp": pa.array(frame_index / fps, pa.float32()),
        "frame_index": pa.array(frame_index),
        "episode_index": pa.array(np.full(length, episode, dtype=np.int64)),
        "index": pa.array(index),
        "task_index": pa.array(np.full(length, task_index, dtype=np.int64)),
    })


def _write_tasks(path: Path, tasks: list[str], legacy: bool) -> None:
    """What ``pandas.DataFrame({"task_index": ..}, index=pd.Index(tasks, name="task")).to_parquet``
    writes (pandas is not a dependency here): the index as a column plus pandas' schema metadata;
    an unnamed index (``legacy``) is stored as ``__index_level_0__``."""
    index_col = "__index_level_0__" if legacy else "task"
    pandas_meta = {
        "index_columns": [index_col],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode",
                            "numpy_type": "object", "metadata": {"encoding": "UTF-8"}}],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
             "numpy_type": "int64", "metadata": None},
            {"name": None if legacy else "task", "field_name": index_col, "pandas_type": "unicode",
             "numpy_type": "object", "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.3",
    }
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()),
                      index_col: pa.array(tasks, pa.string())})
    table = table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def _features(cameras: Sequence[str], width: int, height: int, fps: int, codec: str) -> dict:
    features: dict[str, dict] = {}
    for cam in cameras:
        features[cam] = {
            "dtype": "video",
            "shape": [height, width, 3],
            "names": ["height", "width", "channels"],
            "info": {
                "video.height": height, "video.width": width, "video.codec": _CODEC_NAMES[codec],
                "video.pix_fmt": "yuv420p", "video.is_depth_map": False, "video.fps": fps,
                "video.channels": 3, "has_audio": False,
            },
        }
    for name in ("observation.state", "action"):
        features[name] = {"dtype": "float32", "shape": [len(STATE_NAMES)], "names": list(STATE_NAMES)}
    features["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
    for name in ("frame_index", "episode_index", "index", "task_index"):
        features[name] = {"dtype": "int64", "shape": [1], "names": None}
    return features


# -- stats (LeRobot keeps min/max/mean/std/count per feature; images per channel as (3, 1, 1)) ---

def _stats(a: np.ndarray, axis: int | tuple[int, ...] = 0) -> dict[str, list]:
    a = a.astype(np.float64)
    return {"min": np.min(a, axis=axis).tolist(), "max": np.max(a, axis=axis).tolist(),
            "mean": np.mean(a, axis=axis).tolist(), "std": np.std(a, axis=axis).tolist(),
            "count": [int(a.shape[0])]}


def _vector_stats(table: pa.Table) -> dict[str, dict[str, list]]:
    out = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(col.type):
            values = col.flatten().to_numpy().reshape(len(col), col.type.list_size)
        else:
            values = col.to_numpy().reshape(-1, 1)
        out[name] = _stats(values)
    return out


def _image_stats(frames: list[np.ndarray]) -> dict[str, list]:
    a = np.stack(frames).astype(np.float64) / 255.0  # (T, H, W, C)
    s = {k: np.asarray(v) for k, v in _stats(a.reshape(-1, 3)).items() if k != "count"}
    out = {k: v.reshape(3, 1, 1).tolist() for k, v in s.items()}
    out["count"] = [len(frames)]
    return out


def _merge_image_stats(per_episode: list[dict]) -> dict[str, list]:
    counts = np.array([s["count"][0] for s in per_episode], dtype=np.float64)
    means = np.array([s["mean"] for s in per_episode])
    stds = np.array([s["std"] for s in per_episode])
    w = counts[:, None, None, None] / counts.sum()
    mean = (means * w).sum(0)
    var = ((stds ** 2 + (means - mean) ** 2) * w).sum(0)
    return {"min": np.min([s["min"] for s in per_episode], 0).tolist(),
            "max": np.max([s["max"] for s in per_episode], 0).tolist(),
            "mean": mean.tolist(), "std": np.sqrt(var).tolist(), "count": [int(counts.sum())]}
