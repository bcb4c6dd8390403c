"""Stream one batch through a published sidecar: the proof that a publish is usable for training.

The sidecar is read back from where it was published (``fetch_back``), handed to
``StreamingLeRobotDataset`` as its only sidecar (fresh caches, so no sidecar found elsewhere can
stand in for a broken one), and one batch is taken through ``make_loader``. The batch is then
held against the dataset's features: every feature present, cameras ``(B, C, H, W)`` float32 in
[0, 1], numbers float32 / int64 / bool with the feature's shape, ``task`` one string per item.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loader.lerobot.streaming import StreamingLeRobotDataset, make_loader
from pid_platform.lerobot.fetch_back import fetch_published_sidecar
from pid_platform.lerobot.publish import PublishTarget

DEFAULT_BATCH_SIZE = 4
_CAMERA_AXES = ("channels", "height", "width")


@dataclass(frozen=True)
class StreamedBatch:
    """What one batch streamed through a published sidecar looked like."""

    batch_size: int
    shapes: dict[str, str]          # key -> "(4, 3, 48, 64) float32", or "4 str" for ``task``
    sidecar_bytes: int              # the NPZ read back from the target
    payload_bytes: int              # parquet and MP4 bytes fetched for the batch
    seconds: float                  # fetch back + open + first batch
    problems: list[str] = field(default_factory=list)


def stream_published_batch(target: PublishTarget, *, repo_id: str, data_root: str, revision: str | None,
                           batch_size: int = DEFAULT_BATCH_SIZE) -> StreamedBatch:
    """Fetch the sidecar published at ``target`` for ``revision``, stream one batch of ``repo_id``
    at ``data_root`` through it, and list what in the batch disagrees with the features.

    Errors on the way (nothing published, a mismatching pointer, a sidecar that does not
    validate, a fetch or decode failure) are raised as they are."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pid-stream-check-") as tmp:
        work = Path(tmp)
        sidecar = fetch_published_sidecar(target, revision, work / "published.npz")
        dataset = StreamingLeRobotDataset(repo_id, root=data_root, revision=revision, sidecar=sidecar,
                                          sidecar_cache_root=work / "sidecars", index_cache_root=work / "indexes")
        loader = make_loader(dataset, batch_size=batch_size, num_workers=0)
        batches = iter(loader)
        try:
            batch = next(batches)
        finally:
            batches.close()  # stops the fetch and decode threads behind the rest of the epoch
        expected = min(batch_size, dataset.samples_per_rank(0))
        problems = batch_problems(batch, dataset.meta.features, expected)
        return StreamedBatch(batch_size=_batch_len(batch), shapes=describe(batch),
                             sidecar_bytes=sidecar.stat().st_size, payload_bytes=loader.stats()["bytes_fetched"],
                             seconds=round(time.monotonic() - started, 3), problems=problems)


def batch_problems(batch: Mapping[str, Any], features: Mapping[str, Mapping[str, Any]], batch_size: int) -> list[str]:
    """What in a collated batch disagrees with the dataset's ``features`` (``info.json``); [] if nothing."""
    problems = []
    missing = sorted(set(features) - set(batch))
    if missing:
        problems.append(f"features {missing} are missing from the batch (keys: {sorted(batch)})")
    for key, feature in features.items():
        if key in batch:
            problems += _feature_problems(key, batch[key], feature, batch_size)
    tasks = batch.get("task")
    if not (isinstance(tasks, list) and len(tasks) == batch_size and all(isinstance(t, str) for t in tasks)):
        problems.append(f"task: expected {batch_size} strings, got {_describe(tasks)}")
    return problems


def _feature_problems(key: str, value: Any, feature: Mapping[str, Any], batch_size: int) -> list[str]:
    dtype = feature.get("dtype")
    if dtype == "string":
        ok = isinstance(value, list) and len(value) == batch_size
        return [] if ok else [f"{key}: expected {batch_size} strings, got {_describe(value)}"]
    if not isinstance(value, torch.Tensor):
        return [f"{key}: expected a tensor, got {_describe(value)}"]
    shape = tuple(int(s) for s in feature.get("shape") or ())
    if dtype in ("video", "image"):
        want_shapes = [(batch_size, *_camera_chw(shape, feature.get("names")))]
        want_dtype = torch.float32
    else:
        want_dtype = _tensor_dtype(str(dtype))
        if want_dtype is None:
            return []  # a dtype LeRobot adds no rule for: nothing to hold it against
        # A one-element feature is a scalar column: LeRobot gives a 0-d tensor per item.
        want_shapes = [(batch_size, *shape)] + ([(batch_size,)] if shape == (1,) else [])
    problems = []
    if tuple(value.shape) not in want_shapes or value.dtype != want_dtype:
        problems.append(f"{key}: expected {' or '.join(map(str, want_shapes))} {want_dtype}, got "
                        f"{_describe(value)} (feature {dtype} {list(shape)})")
    elif dtype in ("video", "image") and value.numel() and (value.min() < 0 or value.max() > 1):
        problems.append(f"{key}: pixel values {float(value.min()):.3f}..{float(value.max()):.3f} outside [0, 1]")
    return problems


def _camera_chw(shape: tuple[int, ...], names: Any) -> tuple[int, ...]:
    """(C, H, W) of a camera feature: its ``names`` say the axis order; LeRobot writes (H, W, C)."""
    if isinstance(names, list) and sorted(names) == sorted(_CAMERA_AXES) and len(shape) == 3:
        sizes = dict(zip(names, shape, strict=True))
        return tuple(sizes[a] for a in _CAMERA_AXES)
    if len(shape) == 3:
        return (shape[2], shape[0], shape[1])
    return shape


def _tensor_dtype(dtype: str) -> torch.dtype | None:
    # What torch.tensor makes of the Python value (LeRobot's hf_transform_to_torch).
    if dtype.startswith("float"):
        return torch.float32
    if dtype.startswith(("int", "uint")):
        return torch.int64
    if dtype == "bool":
        return torch.bool
    return None


def describe(batch: Mapping[str, Any]) -> dict[str, str]:
    return {key: _describe(value) for key, value in batch.items()}


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"{len(value)} {'/'.join(kinds) or 'items'}"
    return type(value).__name__


def _batch_len(batch: Mapping[str, Any]) -> int:
    index = batch.get("index")
    return len(index) if index is not None else len(next(iter(batch.values())))
