"""What DataLoader workers hand the training process: batches in recycled shared memory.

Both readers' workers (``loader.wds`` twin tars, ``loader.lerobot.streaming``) hand a batch over
in one buffer of shared memory taken from their ``BufferPool``, instead of pickled through the
DataLoader's pipe (the bytes copied into the pickle, through the kernel's 64 KiB pipe in
hundreds of hand-offs, and out of the pickle again) or as a fresh shared-memory file per batch
(which costs more CPU than the copy: the kernel zeroes, maps, charges and frees every page on
both sides). A worker keeps a few buffers (``slots``) and fills them again once the training
process is done with them: ``flags[worker, slot]``, shared, is 1 while a slot is lent out, and
the training process's ``BufferLender`` clears it. A buffer crosses to the training process
once: the first batch in it carries it (PyTorch passes its file descriptor: a socket connection
with an HMAC handshake on both sides), later ones only name it, and the training process keeps
it mapped while its lender lives (``received_buffers``). With every slot lent, a batch gets a
fresh buffer of its own, so a training loop that keeps batches is still right.

Measured with the twin-tar reader from the bench's bucket at 2 workers on 2 cores
(bench_remote_read's data, 3,000 photographs, decode none, runs of old and new code alternated,
8 pairs, twice): through the pipe an epoch took 1.10x and 1.12x as long, with 1.1x the CPU; an
epoch whose workers hand nothing over was still 0.14-0.25 s shorter (the copies out of the
slots into the training process's new ``bytes``, whose pages the kernel faults in afresh).

What is in a buffer is the reader's business:

* the LeRobot reader's batches are tensors (``PackedBatch`` in ``lerobot/streaming/collate.py``):
  the training loop gets views of the buffer, and a slot is free again once every tensor of its
  batch is gone (``BufferLender.lend`` / ``reclaim``);
* any other batch (the twin-tar reader's lists of samples of ``bytes``) is a ``SharedPayload``:
  it is pickled with its large buffers (``bytes``, ``bytearray``, C-ordered numpy arrays of
  plain numbers, 16 KiB and up) written once into the slot and the rest pickled as usual, and
  unpickling copies each one straight out of the slot into its new object, then frees the slot
  at once (``BufferLender.release``): the training process gets its ``bytes``, as before.
  A payload under 256 KiB, or packed outside a worker with a pool, is pickled inline, and so is
  one for which no shared memory could be had (``/dev/shm`` full, as in a container started
  without ``--shm-size``): said once per worker, the batch never lost.
"""

from __future__ import annotations

import io
import itertools
import logging
import pickle
import weakref
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import get_worker_info

# A buffer smaller than this is pickled inline: a copy of its own costs more than the pickle's.
MIN_BUFFER = 16 << 10
# A payload whose buffers add up to less than this is pickled inline (no slot).
MIN_TOTAL = 256 << 10
log = logging.getLogger(__name__)
_said = False  # this worker has said that /dev/shm had no room (once per process)


# -- recycled shared-memory buffers ----------------------------------------------------------------

def empty_buffer(nbytes: int, *, shared: bool) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes``, in shared memory when ``shared`` (a
    DataLoader worker), so handing it to the main process copies nothing."""
    if not shared:
        return torch.empty(nbytes, dtype=torch.uint8)
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


@dataclass(frozen=True)
class PooledBuffer:
    """A batch's buffer taken from a worker's BufferPool: ``buffer`` (the batch's first bytes of
    the slot's memory), the slot, the ``serial`` of the slot's memory (a grown slot gets a new
    one) and whether this batch must carry it to the main process (``ship``: its first use)."""

    buffer: torch.Tensor
    slot: int | None
    serial: int = 0
    ship: bool = True


class BufferPool:
    """One worker's shared-memory batch buffers, reused once the main process has let go of
    them. ``flags[row, slot]`` (shared with the main process) is 1 while slot's buffer is lent
    out; the main process clears it (``BufferLender``). With every slot lent, a batch gets a
    fresh buffer of its own (never recycled), so a training loop keeping batches is still right.
    ``token`` names the lender whose main process keeps the slots' memory once shipped."""

    def __init__(self, flags: torch.Tensor, row: int, token: int | None = None):
        self.flags, self.row, self.token = flags, row, token
        self.buffers: list[torch.Tensor | None] = [None] * int(flags.shape[1])
        self.serials = [0] * int(flags.shape[1])
        self.shipped = [False] * int(flags.shape[1])
        self._serial = itertools.count(1)

    def take(self, nbytes: int) -> PooledBuffer:
        lent = self.flags[self.row].tolist()
        free = [s for s, f in enumerate(lent) if not f]
        if not free:
            return PooledBuffer(empty_buffer(nbytes, shared=True), None)
        # A free slot already big enough, else the first free one, grown (its old buffer freed).
        slot = next((s for s in free if self.buffers[s] is not None and self.buffers[s].numel() >= nbytes), free[0])
        buf = self.buffers[slot]
        if buf is None or buf.numel() < nbytes:
            self.buffers[slot] = buf = None
            buf = self.buffers[slot] = empty_buffer(nbytes, shared=True)
            self.serials[slot], self.shipped[slot] = next(self._serial), False
        self.flags[self.row, slot] = 1
        ship = self.token is None or not self.shipped[slot]
        self.shipped[slot] = True
        return PooledBuffer(buf[:nbytes], slot, self.serials[slot], ship)


def worker_pool() -> BufferPool | None:
    """This DataLoader worker's BufferPool (kept on its dataset copy, so persistent workers keep
    it across epochs), or None outside a worker or without the loader's flags."""
    info = get_worker_info()
    flags = getattr(info.dataset, "_buffer_flags", None) if info is not None else None
    if flags is None or info.id >= flags.shape[0]:
        return None
    pool = getattr(info.dataset, "_buffer_pool", None)
    if pool is None or pool.flags is not flags:
        pool = BufferPool(flags, info.id, getattr(info.dataset, "_buffer_token", None))
        info.dataset._buffer_pool = pool
    return pool


# In the main process, per live BufferLender (by token): the workers' slot memory received so
# far, {(worker row, slot): (serial, the slot's whole memory)}.
received_buffers: dict[int, dict[tuple[int, int], tuple[int, torch.Tensor]]] = {}
_lenders: weakref.WeakValueDictionary[int, BufferLender] = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


class BufferLender:
    """The main process's side of the workers' BufferPools: ``lend(batch)`` when a batch arrives,
    ``reclaim()`` before waiting for the next one; a buffer is free again once its storage is
    gone here (every tensor of the batch dropped), or at once for a pinned copy. While it lives,
    the workers' slot memory shipped to this process stays mapped (``received_buffers[token]``)."""

    def __init__(self, workers: int, slots: int):
        self.flags = torch.zeros((max(1, workers), slots), dtype=torch.int32).share_memory_()
        self._out: list[tuple[StorageWeakRef, int, int]] = []
        self.token = next(_TOKENS)
        received_buffers[self.token] = {}
        _lenders[self.token] = self
        weakref.finalize(self, received_buffers.pop, self.token, None)

    def attach(self, dataset: Any) -> None:
        """Give ``dataset`` (what the DataLoader hands its workers) this lender's flags and token:
        ``worker_pool()`` in each worker makes its BufferPool from them."""
        dataset._buffer_flags, dataset._buffer_token = self.flags, self.token

    @staticmethod
    def detach(dataset: Any) -> None:
        """Take any lender's flags and token off ``dataset``: its batches are built without a pool."""
        dataset._buffer_flags = dataset._buffer_token = None

    def lend(self, batch: Any) -> None:
        """``batch`` (a PackedBatch: its ``buffer``, ``slot``, ``pinned``) is the training loop's."""
        if batch.slot is None:
            return
        row, slot = batch.slot
        if batch.pinned:
            self.flags[row, slot] = 0       # copied into pinned memory: the shared one is unread
        else:
            self._out.append((StorageWeakRef(batch.buffer.untyped_storage()), row, slot))

    def reclaim(self) -> None:
        keep = []
        for ref, row, slot in self._out:
            if ref.expired():
                self.flags[row, slot] = 0
            else:
                keep.append((ref, row, slot))
        self._out = keep

    def release(self, row: int, slot: int) -> None:
        """Slot ``slot`` of worker ``row`` is read (copied out): the worker may fill it again."""
        self.flags[row, slot] = 0


def received_memory(token: int, row: int, slot: int, serial: int, buffer: torch.Tensor | None,
                    nbytes: int) -> torch.Tensor:
    """A worker's pooled buffer arriving in the main process (its batch's unpickling): the first
    ``nbytes`` of the slot's memory, kept when shipped (``buffer``), found when only named. The
    view is a storage of its own over that memory (``torch.from_numpy``), so its weak reference
    (BufferLender) expires exactly when nothing of the batch is left; it keeps the memory alive
    even after the lender has gone."""
    held = received_buffers.get(token)
    if buffer is not None:
        storage = buffer.untyped_storage()
        memory = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        if held is not None:
            held[row, slot] = (serial, memory)
    else:
        entry = None if held is None else held.get((row, slot))
        if entry is None or entry[0] != serial:
            raise RuntimeError(f"DataLoader worker {row} named batch buffer {slot} (serial {serial}) that this "
                               "process does not hold: its lender is gone or the buffer never arrived; "
                               "a batch must be read by the loader whose workers built it")
        memory = entry[1]
    return torch.from_numpy(memory.numpy()[:nbytes])


# -- payloads of bytes: pickled around their large buffers, which go through a slot ----------------

class SharedPayload:
    """``obj`` packed for the training process: its large buffers already in a slot of this
    worker's BufferPool (see the module's doc); unpickled, it is ``obj`` again.

    Packing happens here, in the worker's own thread, not when the DataLoader's queue pickles
    it in its feeder thread: an object that cannot be pickled then fails in the worker with
    PyTorch's traceback naming it (a feeder thread prints the error, drops the batch, and the
    loader waits for it for ever)."""

    __slots__ = ("_rebuild",)

    def __init__(self, obj: Any):
        pickler = _Collecting()
        pickler.dump(obj)
        skeleton, buffers = pickler.file.getvalue(), pickler.buffers
        pool = worker_pool() if pickler.total >= MIN_TOTAL else None
        if pool is None:
            self._rebuild = _inline, (skeleton, buffers)
            return
        try:
            taken = pool.take(pickler.total)
        except (RuntimeError, OSError) as e:  # PyTorch's "unable to allocate shared memory": /dev/shm full
            _say_once(e)
            self._rebuild = _inline, (skeleton, buffers)
            return
        target = memoryview(taken.buffer.numpy())
        at = 0
        for b in buffers:
            view = memoryview(b).cast("B")
            target[at:at + len(view)] = view
            at += len(view)
        if taken.slot is None:  # every slot lent: a buffer of its own, carried with the batch
            self._rebuild = _restored, (taken.buffer, skeleton)
        else:
            self._rebuild = _pooled_payload, (pool.token, pool.row, taken.slot, taken.serial,
                                              taken.buffer if taken.ship else None, pickler.total, skeleton)

    def __reduce__(self):
        return self._rebuild


def _say_once(error: Exception) -> None:
    global _said
    if not _said:
        _said = True
        info = get_worker_info()
        log.warning("DataLoader worker %s hands its batches through the pipe, not shared memory: %s (PyTorch's "
                    "shared memory lives in /dev/shm: give it room for prefetch_factor + 2 batches per worker, "
                    "e.g. docker run --shm-size)", info.id if info else "-", error)


class _Collecting(ForkingPickler):
    """The DataLoader's pickler, taking large buffers aside as persistent ids
    ``(index, offset, size, kind)``; ``kind``: "bytes", "bytearray" or (dtype, shape)."""

    def __init__(self):
        self.file = io.BytesIO()
        super().__init__(self.file, pickle.HIGHEST_PROTOCOL)
        self.buffers: list[Any] = []
        self.total = 0

    def persistent_id(self, obj: Any):
        cls = type(obj)
        if cls is bytes or cls is bytearray:
            size, kind = len(obj), cls.__name__
        elif cls is np.ndarray and not obj.dtype.hasobject and obj.flags.c_contiguous:
            size, kind = obj.nbytes, (obj.dtype.str, obj.shape)
        else:
            return None
        if size < MIN_BUFFER:
            return None
        pid = (len(self.buffers), self.total, size, kind)
        self.buffers.append(obj)
        self.total += size
        return pid


class _Restoring(pickle.Unpickler):
    def __init__(self, skeleton: bytes, load):
        super().__init__(io.BytesIO(skeleton))
        self.persistent_load = load


def _inline(skeleton: bytes, buffers: list[Any]) -> Any:
    return _Restoring(skeleton, lambda pid: buffers[pid[0]]).load()


def _copied_out(memory: np.ndarray, pid: tuple) -> Any:
    """One large buffer of a payload, copied out of the slot into an object of its own."""
    _, offset, size, kind = pid
    part = memory[offset:offset + size]
    if kind == "bytes":
        return part.tobytes()
    if kind == "bytearray":
        return bytearray(part)
    return part.view(np.dtype(kind[0])).reshape(kind[1]).copy()


def _restored(memory: torch.Tensor, skeleton: bytes) -> Any:
    """The payload, its large buffers copied out of ``memory`` (a slot's, or a buffer of its own)."""
    view = memory.numpy()
    return _Restoring(skeleton, lambda pid: _copied_out(view, pid)).load()


def _pooled_payload(token: int, row: int, slot: int, serial: int, buffer: torch.Tensor | None, nbytes: int,
                    skeleton: bytes) -> Any:
    try:
        return _restored(received_memory(token, row, slot, serial, buffer, nbytes), skeleton)
    finally:
        lender = _lenders.get(token)
        if lender is not None:
            lender.release(row, slot)  # every buffer is copied out: the worker may fill it again
