"""Batches built where the samples are decoded: camera frames go from the decoder's RGB arrays
straight into one batch tensor per camera, in shared memory when in a DataLoader worker.

``default_collate`` over LeRobot items would convert each frame to a float32 tensor, make it
contiguous, then stack the items into a fresh shared-memory tensor: three passes over float32
data per frame. Here a sample's camera value stays the decoder's uint8 frames (``RawFrames``)
until the batch is built; each frame is then written once, converted on the way
(``video.write_frames``), into the batch. Every other key goes through ``default_collate``, so
a batch has the keys, order, dtypes and shapes ``default_collate`` over the items gives.

In a DataLoader worker the batch buffers are recycled slots that the main process reads in place
(``loader.handoff``: ``BufferPool``, ``BufferLender``, the mechanism both readers' workers hand
their batches through): a fresh shared-memory buffer per batch costs more CPU than decoding its
frames (measured 1.05 CPU-ms per 320x240 float32 frame handed over from 2 workers, 0.30 with
reused buffers). Here a batch is tensors: the main process tells a worker a buffer is free again
once no tensor of its batch is left (``BufferLender.lend``/``reclaim``); a batch in a slot only
names it (``PackedBatch.__reduce__``). The training process building its own batches
(num_workers=0) recycles them the same way (``LocalBufferPool``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import default_collate

from loader.handoff import empty_buffer, received_memory, worker_pool

from .items import frames_to_tensor
from .video import Frames, frames_shape, write_frames

_DTYPES = {"float32": torch.float32, "uint8": torch.uint8}


@dataclass(frozen=True)
class RawFrames:
    """A camera value before conversion: the decoded frames (``items.Frames``: T frames of
    (R, G, B) planes, (C, H, W) per frame); ``squeeze``: one frame and no window (the item's
    value is (C, H, W), as LeRobot's ``squeeze(0)``)."""

    frames: Frames
    squeeze: bool

    @property
    def item_shape(self) -> tuple[int, ...]:
        shape = frames_shape(self.frames)
        return shape[1:] if self.squeeze else shape

    def to_tensor(self, dtype: str) -> torch.Tensor:
        t = frames_to_tensor(self.frames, dtype)
        return t.squeeze(0) if self.squeeze else t


def raw_frames(frames: Frames) -> RawFrames:
    """``build_item``'s ``video_value`` for a batched read: keep the decoded frames as they are."""
    return RawFrames(frames, squeeze=len(frames) == 1)


_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class LocalBufferPool:
    """The training process's batch buffers when it builds the batches itself (num_workers=0),
    reused once every tensor of the batch handed out from one is gone.

    A fresh buffer per batch costs more CPU than converting its frames: a 640x480 float32 batch
    (8 items x 2 cameras, 59 MB) is above malloc's mmap threshold, so every batch was mapped,
    faulted in and zeroed page by page by the kernel, then unmapped (measured: 6.5 -> 4.0
    CPU-ms per frame at 0 workers). A handed-out batch's tensors are views of a storage of
    their own over the pooled memory (``torch.from_numpy`` of it), so that storage dies, and its
    weak reference expires, exactly when the training loop has dropped every tensor of the
    batch (a ``.numpy()`` of one keeps it alive too); the pool keeps the memory. At most
    ``slots`` buffers are kept (the batch the loop holds, the one being built, one spare);
    with every slot lent, a batch gets a fresh buffer of its own."""

    def __init__(self, slots: int = 3):
        self.slots = slots
        self._memory: list[torch.Tensor] = []
        self._lent: list[StorageWeakRef | None] = []
        self.reused = 0

    def take(self, nbytes: int) -> torch.Tensor:
        free = [i for i, ref in enumerate(self._lent) if ref is None or ref.expired()]
        slot = next((i for i in free if self._memory[i].numel() >= nbytes), free[0] if free else None)
        if slot is None and len(self._memory) < self.slots:
            self._memory.append(torch.empty(0, dtype=torch.uint8))
            self._lent.append(None)
            slot = len(self._memory) - 1
        if slot is None:
            return empty_buffer(nbytes, shared=False)
        if self._memory[slot].numel() < nbytes:
            self._memory[slot] = torch.empty(0, dtype=torch.uint8)   # the smaller one goes first
            self._memory[slot] = empty_buffer(nbytes, shared=False)
        else:
            self.reused += 1
        out = torch.from_numpy(self._memory[slot].numpy()[:nbytes])
        self._lent[slot] = StorageWeakRef(out.untyped_storage())
        return out


@dataclass
class PackedBatch:
    """A batch whose tensors all live in one buffer: a DataLoader worker hands it over as ONE
    shared-memory file (each tensor of a plain dict is a file of its own: an allocation, a file
    descriptor passed over a socket and a mapping per key and batch). ``unpack()`` gives the
    batch dict (views of the buffer, no copy); ``pin_memory()`` pins the one buffer."""

    buffer: torch.Tensor
    layout: list[tuple[str, int, torch.dtype, tuple[int, ...]] | tuple[str, None, None, Any]]
    slot: tuple[int, int] | None = None     # (worker, slot) of a BufferPool buffer
    pinned: bool = False
    token: int | None = None                # the BufferLender whose main process reads the slot

    def __reduce__(self):
        if self.slot is None or self.token is None or self.pinned:
            return (PackedBatch, (self.buffer, self.layout, self.slot, self.pinned))
        row, slot = self.slot
        return (_received, (self.token, row, slot, self.buffer.numel(), self.layout))

    def unpack(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, offset, dtype, shape in self.layout:
            if offset is None:
                out[key] = shape            # not a tensor: the collated value itself
                continue
            n = math.prod(shape) * dtype.itemsize
            out[key] = self.buffer[offset:offset + n].view(dtype).view(shape)
        return out

    def pin_memory(self, device: Any = None) -> PackedBatch:
        pinned = self.buffer.pin_memory() if device is None else self.buffer.pin_memory(device)
        return PackedBatch(pinned, self.layout, self.slot, pinned=True)


def _received(token: int, row: int, slot: int, nbytes: int, layout: list) -> PackedBatch:
    """A worker's pooled batch arriving in the main process (PackedBatch's unpickling): its tensors
    are views of the slot's memory (``handoff.received_memory``), which they keep alive even
    after the lender has gone."""
    return PackedBatch(received_memory(token, row, slot, nbytes), layout, (row, slot))


def collate_items(items: Sequence[dict[str, Any]], video_keys: Sequence[str], *, frame_dtype: str,
                  shared: bool, local_pool: LocalBufferPool | None = None) -> dict[str, Any] | PackedBatch:
    """One batch of ``items`` (dicts whose camera values are RawFrames or tensors): the batch
    dict, or (``shared``) a PackedBatch of it. Not shared, its buffer comes from ``local_pool``
    when given."""
    first = items[0]
    n = len(items)
    plan: list[tuple[str, str, torch.dtype | None, tuple[int, ...] | None]] = []
    total = 0
    for key, value in first.items():
        if key in video_keys and isinstance(value, RawFrames):
            shape, dtype = value.item_shape, _DTYPES[frame_dtype]
            for item in items:
                if item[key].item_shape != shape:
                    raise RuntimeError(f"{key}: frames of shape {item[key].item_shape} and {shape} in one "
                                       "batch; every episode's video of a camera must have one size")
            plan.append((key, "frames", dtype, (n, *shape)))
        elif isinstance(value, torch.Tensor) and all(
                isinstance(item[key], torch.Tensor) and item[key].shape == value.shape
                and item[key].dtype == value.dtype for item in items):
            plan.append((key, "stack", value.dtype, (n, *value.shape)))
        else:
            plan.append((key, "other", None, None))
            continue
        total += _aligned(math.prod(plan[-1][3]) * plan[-1][2].itemsize)
    pool = worker_pool() if shared else None
    taken = None
    if pool is not None:
        taken = pool.take(total)
        buffer, slot = taken.buffer, taken.slot
    elif local_pool is not None and not shared:
        buffer, slot = local_pool.take(total), None
    else:
        buffer, slot = empty_buffer(total, shared=shared), None
    layout: list = []
    offset = 0
    for key, how, dtype, shape in plan:
        if how == "other":
            # Strings (``task``) and the like: default_collate's value, inside the pickle.
            layout.append((key, None, None, default_collate([item[key] for item in items])))
            continue
        nbytes = math.prod(shape) * dtype.itemsize
        view = buffer[offset:offset + nbytes].view(dtype).view(shape)
        if how == "frames":
            target = view.numpy()
            for i, item in enumerate(items):
                raw = item[key]
                write_frames(target[i][None] if raw.squeeze else target[i], raw.frames)
        else:
            torch.stack([item[key] for item in items], out=view)
        layout.append((key, offset, dtype, shape))
        offset += _aligned(nbytes)
    if slot is None:
        packed = PackedBatch(buffer, layout)
    else:
        packed = PackedBatch(buffer, layout, (pool.row, slot), token=pool.token)
    return packed if shared else packed.unpack()


def item_frames(item: dict[str, Any], video_keys: Sequence[str], frame_dtype: str) -> dict[str, Any]:
    """``item`` with its RawFrames converted (what a sample read on its own gives)."""
    for key in video_keys:
        value = item.get(key)
        if isinstance(value, RawFrames):
            item[key] = value.to_tensor(frame_dtype)
    return item


def batched(items: Iterable[dict[str, Any]], batching: tuple[int, bool] | None, video_keys: Sequence[str], *,
            frame_dtype: str, shared: bool) -> Iterator[Any]:
    """``items`` as they come (``batching`` None), or collated ``batching = (batch_size, drop_last)``
    at a time, the short last batch kept unless ``drop_last``. Batches built in the training
    process (not ``shared``) reuse their buffers through a LocalBufferPool of this pass."""
    if batching is None:
        yield from items
        return
    local_pool = None if shared else LocalBufferPool()
    pending: list[dict[str, Any]] = []
    for item in items:
        pending.append(item)
        if len(pending) == batching[0]:
            batch, pending = pending, []
            yield collate_items(batch, video_keys, frame_dtype=frame_dtype, shared=shared, local_pool=local_pool)
    if pending and not batching[1]:
        yield collate_items(pending, video_keys, frame_dtype=frame_dtype, shared=shared, local_pool=local_pool)
