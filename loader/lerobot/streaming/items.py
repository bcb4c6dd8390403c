"""Items exactly as LeRobot's map-style ``LeRobotDataset.__getitem__`` builds them.

Rules (LeRobot ``lerobot_dataset.py`` / ``utils.py``):

* tabular values go through ``torch.tensor`` of the Python value (``hf_transform_to_torch``):
  floats become float32, integers int64, booleans bool; a scalar feature is a 0-d tensor;
* ``delta_timestamps`` become frame offsets ``round(d * fps)`` after a check that every delta is
  a whole number of frames within ``tolerance_s``; a query index is clamped into the episode,
  ``<key>_is_pad`` marks the clamped ones, so a padded value repeats the boundary frame;
  tabular keys with deltas are stacked to ``(T, ...)``;
* a camera is decoded at ``from_timestamp + timestamp`` of each queried row (its own row when
  it has no deltas), frames float32 in [0, 1], ``(T, C, H, W)`` then ``squeeze(0)``;
* video keys come first in the dict, then the tabular keys and ``task`` (the task string of
  ``task_index``), then ``__pad__`` (ours, not LeRobot's: see ``mark_padding``).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from .video import Frames, frames_array

_TABULAR_EXCLUDED = ("video",)
PAD_KEY = "__pad__"


def mark_padding(item: dict[str, Any], repeated: bool) -> dict[str, Any]:
    """Flag whether ``item`` repeats a frame already handed out this epoch (padding that evens out
    the ranks' batches): ``item["__pad__"]``, a 0-d bool tensor, on every item so that batches
    collate to a (B,) mask. The same key as twin-tar samples carry; LeRobot's ``<key>_is_pad``
    keys mean something else (a window position clamped into the episode)."""
    item[PAD_KEY] = torch.tensor(repeated)
    return item


def check_delta_timestamps(delta_timestamps: Mapping[str, Sequence[float]], fps: int,
                           tolerance_s: float) -> None:
    """Every delta must be a whole number of frames (within ``tolerance_s``), as LeRobot checks."""
    outside = {}
    for key, deltas in delta_timestamps.items():
        bad = [d for d in deltas if abs(d * fps - round(d * fps)) / fps > tolerance_s]
        if bad:
            outside[key] = bad
    if outside:
        raise ValueError(
            f"delta_timestamps {outside} are not multiples of 1/fps = {1 / fps:.6f} s within "
            f"tolerance_s={tolerance_s}: use deltas that land on frames, e.g. k / {fps}")


def delta_indices(delta_timestamps: Mapping[str, Sequence[float]] | None, fps: int) -> dict[str, list[int]] | None:
    if delta_timestamps is None:
        return None
    return {key: [round(d * fps) for d in deltas] for key, deltas in delta_timestamps.items()}


def _column_array(col: pa.ChunkedArray | pa.Array) -> np.ndarray | list:
    """A column as a numpy array of shape (rows, *feature shape), or a list for strings/images."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    if pa.types.is_fixed_size_list(t):
        dims = []
        inner = arr
        while pa.types.is_fixed_size_list(inner.type):
            dims.append(inner.type.list_size)
            inner = inner.flatten()
        return inner.to_numpy(zero_copy_only=False).reshape(len(arr), *dims)
    if pa.types.is_struct(t) or pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_list(t) \
            or pa.types.is_large_list(t):
        return arr.to_pylist()
    return arr.to_numpy(zero_copy_only=False)


def _torch_dtype(np_dtype: np.dtype) -> torch.dtype:
    # torch.tensor of a Python float/int/bool (what LeRobot's transform sees).
    if np_dtype.kind == "f":
        return torch.float32
    if np_dtype.kind in "iu":
        return torch.int64
    if np_dtype.kind == "b":
        return torch.bool
    raise TypeError(f"unsupported column dtype {np_dtype}")


def _image_tensor(value: Any) -> torch.Tensor:
    """An ``image`` feature cell ({"bytes", "path"}) as torchvision's ToTensor makes it."""
    from PIL import Image

    data = value.get("bytes") if isinstance(value, dict) else value
    with Image.open(io.BytesIO(data)) as im:
        a = np.asarray(im.convert("RGB"))
    return torch.from_numpy(a.copy()).permute(2, 0, 1).to(torch.float32) / 255


class EpisodeRows:
    """One episode's parquet rows, converted once per column for per-frame access."""

    def __init__(self, table: pa.Table, features: Mapping[str, Mapping[str, Any]]):
        self.num_rows = table.num_rows
        self.columns: dict[str, np.ndarray | list] = {}
        self.kinds: dict[str, str] = {}
        self._targets: dict[str, np.dtype] = {}   # numeric columns: the dtype of their item values
        for name in table.column_names:
            ft = features.get(name)
            if ft is None or ft.get("dtype") in _TABULAR_EXCLUDED:
                continue
            self.columns[name] = col = _column_array(table.column(name))
            self.kinds[name] = "image" if ft.get("dtype") == "image" else "value"
            if isinstance(col, np.ndarray):
                self._targets[name] = _np_target(col.dtype)
        if "timestamp" not in self.columns or "task_index" not in self.columns:
            raise ValueError("episode rows need 'timestamp' and 'task_index' columns")
        self.timestamps = np.asarray(self.columns["timestamp"], dtype=np.float32)

    def value(self, name: str, row: int) -> Any:
        col = self.columns[name]
        if self.kinds[name] == "image":
            return _image_tensor(col[row])
        if isinstance(col, list):
            v = col[row]
            return v if isinstance(v, str) else torch.tensor(v)
        return torch.from_numpy(np.array(col[row], dtype=self._targets[name]))

    def stacked(self, name: str, rows: Sequence[int]) -> Any:
        col = self.columns[name]
        if isinstance(col, np.ndarray) and self.kinds[name] == "value":
            return torch.from_numpy(np.ascontiguousarray(col[list(rows)], dtype=self._targets[name]))
        return torch.stack([self.value(name, r) for r in rows])


def _np_target(dt: np.dtype) -> np.dtype:
    return {torch.float32: np.dtype(np.float32), torch.int64: np.dtype(np.int64),
            torch.bool: np.dtype(np.bool_)}[_torch_dtype(dt)]


def frames_to_tensor(frames: Frames, dtype: str = "float32") -> torch.Tensor:
    """Decoded frames -> a new (T, C, H, W) float32 tensor in [0, 1], as LeRobot's decoders return
    it (``dtype="uint8"``: the decoded values, the float32 ones x 255 exactly)."""
    return torch.from_numpy(frames_array(frames, np.float32 if dtype == "float32" else np.uint8))


def build_item(rows: EpisodeRows, frame: int, *, length: int, deltas: Mapping[str, Sequence[int]] | None,
               video_keys: Sequence[str], decode: Callable[[str, list[float]], Frames],
               tasks: Mapping[int, str], image_keys: Sequence[str] = (),
               image_transforms: Callable[[Any], Any] | None = None,
               video_value: Callable[[Frames], Any] | None = None) -> dict[str, Any]:
    """The item of frame ``frame`` (0-based inside the episode) of a ``length``-frame episode.

    ``decode(camera, times)`` returns the decoded ``Frames`` at episode-relative ``times``;
    ``video_value`` makes a camera's value of them (default: LeRobot's float32 tensor).
    """
    item: dict[str, Any] = {name: rows.value(name, frame) for name in rows.columns}
    query: dict[str, list[int]] = {}
    if deltas:
        padding = {}
        for key, offsets in deltas.items():
            query[key] = [max(0, min(length - 1, frame + d)) for d in offsets]
            padding[f"{key}_is_pad"] = torch.BoolTensor([(frame + d < 0) | (frame + d >= length) for d in offsets])
        item = {**item, **padding}
        for key, q in query.items():
            if key not in video_keys:
                item[key] = rows.stacked(key, q)
    if video_keys:
        current = float(rows.timestamps[frame])
        videos = {}
        for key in video_keys:
            times = [float(rows.timestamps[r]) for r in query[key]] if key in query else [current]
            frames = decode(key, times)
            videos[key] = video_value(frames) if video_value is not None else frames_to_tensor(frames).squeeze(0)
        item = {**videos, **item}
    if image_transforms is not None:
        for key in (*video_keys, *image_keys):
            item[key] = image_transforms(item[key])
    item["task"] = tasks[int(item["task_index"].item()) if "task_index" not in query else int(rows.columns["task_index"][frame])]
    return item
