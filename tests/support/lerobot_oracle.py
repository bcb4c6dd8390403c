"""The map-style oracle that streamed LeRobot items are compared with: what LeRobot's own
``LeRobotDataset.__getitem__`` returns for a frame, computed the slow and obvious way, from the
WHOLE data parquet files (pyarrow) and a FULL PyAV decode of each MP4.

It shares no code with ``loader/`` (meta is read with plain json/pyarrow) so a bug there cannot
hide in both. Each rule is LeRobot's (huggingface/lerobot, src/lerobot/datasets/...):

* rows: every ``data/*/*.parquet`` in sorted path order, one table, columns in ``info.json``
  feature order without the video keys, cast to the feature types; ``episodes=`` filters rows by
  ``episode_index`` and keeps file order (``io_utils.load_nested_dataset``,
  ``feature_utils.get_hf_features_from_features``). Out-of-range episodes are dropped with a
  warning (``utils.resolve_episode_indices``). Without ``episodes=`` a query index IS the row
  position; with it, ``index`` values map to rows (``DatasetReader._build_index_mapping``).
* values: ``torch.tensor`` of each Python value, strings left as they are
  (``io_utils.hf_transform_to_torch``): floats float32, ints int64, bools bool; a feature of
  shape ``(1,)`` is a scalar and becomes a 0-d tensor.
* windows: ``round(d * fps)`` frame offsets after checking each delta is a multiple of
  ``1/fps`` within ``tolerance_s`` (``feature_utils.get_delta_indices``,
  ``check_delta_timestamps``); query indices clamped to ``[dataset_from_index,
  dataset_to_index - 1]`` of the episode (the row at position ``episode_index`` of the
  concatenated ``meta/episodes`` files) and ``<key>_is_pad`` true where clamped
  (``DatasetReader._get_query_indices``); non-video keys stacked along a new first dim, never
  squeezed (``_query_hf_dataset``).
* video: timestamps from the ``timestamp`` column at the query rows (or the frame's own), shifted
  by the episode's ``videos/<key>/from_timestamp`` (``_get_query_timestamps``,
  ``_query_videos``); the nearest decoded frame by float32 distance to ``pts * time_base``,
  an error when it is farther than ``tolerance_s``; uint8 RGB ``(T, C, H, W)`` to float32 ``/ 255``
  (``video_utils.decode_video_frames_pyav``), then ``.squeeze(0)`` (``_query_videos``).
* item: video keys first, then the row's columns, then the ``_is_pad`` keys; ``image_transforms``
  on every camera key; ``task`` the tasks table's index value at row ``task_index``
  (``DatasetReader.get_item``, ``io_utils.load_tasks``).

LeRobot's seek-then-decode (pyav) picks the same frame as a full decode: it decodes from the
keyframe at or before the first query through the first frame at or after the last, and the
nearest frame to any query lies in that range. Image (non-video) cameras and depth maps are not
modelled: the oracle refuses such datasets.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import av
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

__all__ = ["FrameTimestampError", "MapStyleOracle", "assert_item_equal"]


class FrameTimestampError(ValueError):
    """No decoded frame lies within ``tolerance_s`` of a queried timestamp (LeRobot's name)."""


class MapStyleOracle:
    """``LeRobotDataset(repo_id, root=root, episodes=..., delta_timestamps=..., tolerance_s=...,
    image_transforms=...)[i]`` for a local v3 dataset, addressed by the frame's global ``index``."""

    def __init__(self, root: Path, *, episodes: Sequence[int] | None = None,
                 delta_timestamps: dict[str, list[float]] | None = None,
                 tolerance_s: float = 1e-4, image_transforms: Callable | None = None) -> None:
        self.root = Path(root)
        info = json.loads((self.root / "meta" / "info.json").read_text())
        self.fps: int = info["fps"]
        self.features: dict[str, dict] = info["features"]
        self._video_path: str = info["video_path"]
        self._total_frames: int = info["total_frames"]
        self.video_keys = [k for k, ft in self.features.items() if ft["dtype"] == "video"]
        _refuse_unmodelled(self.features)
        self.tolerance_s = tolerance_s
        if image_transforms is not None and not callable(image_transforms):
            raise TypeError("image_transforms must be callable or None.")
        self.image_transforms = image_transforms

        self.delta_indices: dict[str, list[int]] | None = None
        if delta_timestamps is not None:
            check_delta_timestamps(delta_timestamps, self.fps, tolerance_s)
            self.delta_indices = {k: [round(d * self.fps) for d in ds]
                                  for k, ds in delta_timestamps.items()}

        self.episodes = _resolve_episodes(episodes, info["total_episodes"])
        self._episode_rows = _read_episodes(self.root)
        self._tasks = _read_tasks(self.root / "meta" / "tasks.parquet")
        self._columns = _read_frames(self.root, self.features, self.video_keys, self.episodes)
        index = self._columns["index"]
        self._row_of_index = dict(zip(index, range(len(index)), strict=True))
        self._decoded: dict[Path, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    # -- the dataset's face ---------------------------------------------------------------------

    def __len__(self) -> int:
        # LeRobot: len(hf_dataset) for an episode subset, else info.json's total_frames.
        if self.episodes is not None:
            return len(self._columns["index"])
        return self._total_frames

    def indices(self) -> list[int]:
        """Global ``index`` values of the selected frames, ascending."""
        return sorted(self._row_of_index)

    def item(self, global_index: int) -> dict:
        """What ``LeRobotDataset.__getitem__`` returns for the frame whose ``index`` is this."""
        try:
            row = self._row_of_index[global_index]
        except KeyError:
            raise KeyError(f"frame index {global_index} is not among the selected frames of "
                           f"{self.root} (episodes={self.episodes})") from None
        item: dict[str, Any] = {k: _to_torch(col[row]) for k, col in self._columns.items()}
        ep_idx = item["episode_index"].item()
        abs_idx = item["index"].item()

        query_indices = None
        if self.delta_indices is not None:
            query_indices, padding = self._query_indices(abs_idx, ep_idx)
            item = {**item, **padding}
            for key, q_idx in query_indices.items():
                if key in self.video_keys:
                    continue
                if key not in self._columns:
                    raise KeyError(f"delta_timestamps names {key!r}, which is no column of "
                                   f"{self.root}/data (columns: {sorted(self._columns)})")
                item[key] = torch.stack([_to_torch(self._columns[key][self._row(i)]) for i in q_idx])

        if self.video_keys:
            current_ts = item["timestamp"].item()
            frames = {}
            for key in self.video_keys:
                if query_indices is not None and key in query_indices:
                    # The timestamp tensors of the query rows, back to Python floats.
                    ts = [_to_torch(self._columns["timestamp"][self._row(i)]).item()
                          for i in query_indices[key]]
                else:
                    ts = [current_ts]
                frames[key] = self._video_frames(key, ep_idx, ts).squeeze(0)
            item = {**frames, **item}

        if self.image_transforms is not None:
            for cam in self.video_keys:  # LeRobot's camera_keys; image cameras are refused above
                item[cam] = self.image_transforms(item[cam])

        item["task"] = self._task(item["task_index"].item())
        return item

    # -- LeRobot's rules ------------------------------------------------------------------------

    def _row(self, abs_idx: int) -> int:
        # LeRobot indexes the unfiltered table by the absolute index itself.
        return abs_idx if self.episodes is None else self._row_of_index[abs_idx]

    def _episode(self, ep_idx: int) -> dict:
        # Position in the concatenated meta/episodes files, as LeRobot's meta.episodes[ep_idx].
        if not 0 <= ep_idx < len(self._episode_rows):
            raise IndexError(f"episode {ep_idx} is out of range: {self.root}/meta/episodes holds "
                             f"{len(self._episode_rows)} episodes")
        return self._episode_rows[ep_idx]

    def _query_indices(self, abs_idx: int, ep_idx: int
                       ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        ep = self._episode(ep_idx)
        start, end = ep["dataset_from_index"], ep["dataset_to_index"]
        assert self.delta_indices is not None
        query = {k: [max(start, min(end - 1, abs_idx + d)) for d in ds]
                 for k, ds in self.delta_indices.items()}
        padding = {f"{k}_is_pad": torch.tensor([not start <= abs_idx + d < end for d in ds],
                                               dtype=torch.bool)
                   for k, ds in self.delta_indices.items()}
        return query, padding

    def _video_frames(self, key: str, ep_idx: int, timestamps: list[float]) -> torch.Tensor:
        """``(T, C, H, W)`` float32 in [0, 1]: the nearest frame to each episode timestamp."""
        ep = self._episode(ep_idx)
        path = self.root / self._video_path.format(
            video_key=key, chunk_index=ep[f"videos/{key}/chunk_index"],
            file_index=ep[f"videos/{key}/file_index"])
        shifted = [ep[f"videos/{key}/from_timestamp"] + ts for ts in timestamps]
        times, frames = self._decode(path)
        # float32 on both sides, as LeRobot's torch.tensor(timestamps) makes them.
        query = torch.tensor(shifted)
        dist = (query[:, None] - times[None, :]).abs()
        nearest, which = dist.min(1)
        within = nearest <= self.tolerance_s
        if not within.all():
            raise FrameTimestampError(
                f"{path}: no frame within tolerance_s={self.tolerance_s} of queried "
                f"timestamp(s) {query[~within].tolist()} (episode {ep_idx}, key {key!r}; nearest "
                f"frames {times[which[~within]].tolist()}, off by {nearest[~within].tolist()}). "
                "LeRobot rejects this item too: the episode's timestamps and its video disagree.")
        return torch.stack([frames[i] for i in which.tolist()]).type(torch.float32) / 255

    def _decode(self, path: Path) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every frame of ``path``: float32 times (``pts * time_base``) and uint8 (C, H, W)."""
        if path not in self._decoded:
            if not path.is_file():
                raise FileNotFoundError(f"video file {path} is missing: the dataset's "
                                        "meta/episodes point at it")
            times: list[float] = []
            frames: list[torch.Tensor] = []
            with av.open(str(path)) as container:
                stream = container.streams.video[0]
                for frame in container.decode(stream):
                    if frame.pts is None:
                        continue
                    times.append(float(frame.pts * stream.time_base))
                    rgb = frame.to_ndarray(format="rgb24")
                    frames.append(torch.from_numpy(rgb).permute(2, 0, 1).contiguous())
            if not frames:
                raise FrameTimestampError(f"{path}: no frame could be decoded")
            self._decoded[path] = (torch.tensor(times), frames)
        return self._decoded[path]

    def _task(self, task_index: int) -> str:
        # LeRobot: tasks.iloc[task_index].name, a row POSITION in tasks.parquet.
        if not 0 <= task_index < len(self._tasks):
            raise IndexError(f"task_index {task_index} is out of range: "
                             f"{self.root}/meta/tasks.parquet holds {len(self._tasks)} tasks")
        return self._tasks[task_index]


def check_delta_timestamps(delta_timestamps: dict[str, list[float]], fps: int,
                           tolerance_s: float) -> None:
    """LeRobot's check: each delta times ``fps`` is within ``tolerance_s * fps`` of an integer."""
    outside = {key: [d for d in ds if abs(d * fps - round(d * fps)) / fps > tolerance_s]
               for key, ds in delta_timestamps.items()}
    outside = {key: ds for key, ds in outside.items() if ds}
    if outside:
        raise ValueError(f"delta_timestamps outside the tolerance range: {outside}. Make them "
                         f"multiples of 1/{fps} +/- tolerance_s={tolerance_s}.")


# -- reading the dataset (plain json and pyarrow) -------------------------------------------------

def _refuse_unmodelled(features: dict[str, dict]) -> None:
    for key, ft in features.items():
        info = ft.get("info") or {}
        if ft["dtype"] == "image" or info.get("is_depth_map") or info.get("video.is_depth_map"):
            raise NotImplementedError(f"feature {key!r} ({ft['dtype']}, depth map or image) is "
                                      "not modelled by the oracle")


def _resolve_episodes(episodes: Sequence[int] | None, total: int) -> list[int] | None:
    if episodes is None:
        return None
    invalid = [e for e in episodes if not 0 <= e < total]
    if invalid:
        warnings.warn(f"Ignoring episode indices outside the dataset range [0, {total}): {invalid}",
                      stacklevel=3)
    return [e for e in episodes if 0 <= e < total]


def _parquet_files(folder: Path) -> list[Path]:
    paths = sorted(folder.glob("*/*.parquet"))
    if not paths:
        raise FileNotFoundError(f"{folder} holds no */*.parquet file")
    return paths


def _read_episodes(root: Path) -> list[dict]:
    tables = [pq.read_table(p) for p in _parquet_files(root / "meta" / "episodes")]
    table = pa.concat_tables(tables, promote_options="default")
    keep = [c for c in table.column_names if not c.startswith("stats/")]
    return table.select(keep).to_pylist()


def _read_tasks(path: Path) -> list[str]:
    """The task strings by row: the pandas index column that ``pd.read_parquet`` restores."""
    table = pq.read_table(path)
    pandas_meta = json.loads((table.schema.metadata or {}).get(b"pandas", b"{}"))
    index_columns = pandas_meta.get("index_columns") or []
    if len(index_columns) != 1 or not isinstance(index_columns[0], str):
        raise ValueError(f"{path}: expected the task strings as the pandas index column, found "
                         f"index_columns={index_columns}; LeRobot would not return them as task")
    return table.column(index_columns[0]).to_pylist()


def _arrow_type(key: str, ft: dict) -> pa.DataType | None:
    """The type LeRobot's ``datasets.Features`` casts a column to; None: leave it as stored."""
    shape = tuple(ft["shape"])
    if shape == (1,):
        return pa.type_for_alias(ft["dtype"])
    if len(shape) == 1:
        return pa.list_(pa.type_for_alias(ft["dtype"]), shape[0])
    return None


def _read_frames(root: Path, features: dict[str, dict], video_keys: list[str],
                 episodes: list[int] | None) -> dict[str, list]:
    """Every data row as Python values per column, in feature order (LeRobot's hf_dataset)."""
    expected = [k for k in features if k not in video_keys]
    tables = []
    for path in _parquet_files(root / "data"):
        table = pq.read_table(path)
        if sorted(table.column_names) != sorted(expected):
            raise ValueError(f"{path}: columns {sorted(table.column_names)} differ from the "
                             f"non-video features of meta/info.json {sorted(expected)}; LeRobot "
                             "cannot load this file either")
        columns = []
        for key in expected:
            column = table.column(key)
            target = _arrow_type(key, features[key])
            columns.append(column if target is None else column.cast(target))
        tables.append(pa.table(columns, names=expected))
    table = pa.concat_tables(tables)
    if episodes is not None:
        table = table.filter(pc.is_in(table.column("episode_index"),
                                      value_set=pa.array(episodes, pa.int64())))
    return {key: table.column(key).to_pylist() for key in expected}


def _to_torch(value: Any) -> Any:
    """``hf_transform_to_torch`` on one value: strings, dicts and None stay, the rest become
    ``torch.tensor`` (float32 for floats, int64 for ints, bool for bools)."""
    if value is None or isinstance(value, str | dict):
        return value
    return torch.tensor(value)


# -- comparing items ------------------------------------------------------------------------------

def _looks_like_frames(value: torch.Tensor) -> bool:
    return value.dtype == torch.float32 and value.ndim in (3, 4) and value.shape[-3] in (1, 3)


def assert_item_equal(got: dict, want: dict, *, where: str = "",
                      video_keys: Sequence[str] | None = None) -> None:
    """``got`` is the oracle's ``want``: the same keys; per tensor the same dtype and shape;
    tabular values exactly equal; video frames equal as uint8 after ``round(x * 255)``; other
    values (``task``) equal. ``video_keys`` default: float32 tensors shaped (C, H, W) or
    (T, C, H, W) with C of 1 or 3."""
    prefix = f"{where}: " if where else ""
    if "__pad__" in got and "__pad__" not in want:
        # The streaming reader's repeat flag (not LeRobot's): a 0-d bool, the rest is the frame's item.
        pad = got["__pad__"]
        if not isinstance(pad, torch.Tensor) or pad.dtype != torch.bool or pad.shape != ():
            raise AssertionError(f"{prefix}'__pad__' must be a 0-d bool tensor, got {pad!r}")
        got = {k: v for k, v in got.items() if k != "__pad__"}
    if set(got) != set(want):
        raise AssertionError(f"{prefix}keys differ: missing {sorted(set(want) - set(got))}, "
                             f"unexpected {sorted(set(got) - set(want))}")
    for key, expected in want.items():
        actual = got[key]
        if not isinstance(expected, torch.Tensor):
            if type(actual) is not type(expected) or actual != expected:
                raise AssertionError(f"{prefix}{key!r}: got {actual!r}, want {expected!r}")
            continue
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{prefix}{key!r}: got {type(actual).__name__}, want a tensor")
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise AssertionError(f"{prefix}{key!r}: got {actual.dtype} {tuple(actual.shape)}, "
                                 f"want {expected.dtype} {tuple(expected.shape)}")
        is_video = key in video_keys if video_keys is not None else _looks_like_frames(expected)
        if is_video:
            a, b = _as_uint8(actual), _as_uint8(expected)
            if not torch.equal(a, b):
                bad = (a != b).nonzero()
                raise AssertionError(
                    f"{prefix}{key!r}: {len(bad)} of {a.numel()} pixel values differ as uint8, "
                    f"first at {tuple(bad[0].tolist())}: got {a[tuple(bad[0])].item():g}, "
                    f"want {b[tuple(bad[0])].item():g}")
        elif not _exactly_equal(actual, expected):
            raise AssertionError(f"{prefix}{key!r}: got {actual.tolist()}, want {expected.tolist()}")


def _as_uint8(frames: torch.Tensor) -> torch.Tensor:
    # Rounded but not cast: a value outside [0, 1] must not wrap or clamp into agreement.
    return torch.round(frames * 255)


def _exactly_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.equal(a, b):
        return True
    if a.is_floating_point():  # NaN where the oracle has NaN is equal here
        return bool(np.array_equal(a.numpy(), b.numpy(), equal_nan=True))
    return False
