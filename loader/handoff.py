"""What DataLoader workers hand the training process: batches in recycled shared memory.

Both readers' workers (``loader.wds`` twin tars, ``loader.lerobot.streaming``) hand a batch over
in one buffer of shared memory taken from their ``BufferPool``, instead of pickled through the
DataLoader's pipe (the bytes copied into the pickle, through the kernel's 64 KiB pipe in
hundreds of hand-offs, and out of the pickle again) or as a fresh shared-memory file per batch
(which costs more CPU than the copy: the kernel zeroes, maps, charges and frees every page on
both sides). A worker keeps a few buffers (``slots``) and fills them again once the training
process is done with them: ``flags[worker, slot]``, shared, is 1 while a slot is lent out, and
the training process's ``BufferLender`` clears it. The slots are fixed places in one shared
mapping (``SlotArena``: a memfd, sparse) that the training process makes before its workers
start, so a batch only names its slot: no memory, no file descriptor crosses per batch. With
every slot lent (or a batch over a slot's reserve), a batch gets a fresh buffer of its own,
carried across as PyTorch carries a shared tensor, so a training loop that keeps batches is
still right.

Measured with the twin-tar reader from the bench's bucket at 2 workers on 2 cores
(bench_remote_read's data, 3,000 photographs, decode none, runs of old and new code alternated,
8 pairs, twice): through the pipe an epoch took 1.10x and 1.12x as long, with 1.1x the CPU; an
epoch whose workers hand nothing over was still 0.14-0.25 s shorter (the copies out of the
slots into the training process's new ``bytes``, whose pages the kernel faults in afresh).
Slots that each crossed once (a PyTorch shared-memory file carried by its first batch) against
the arena, 12 pairs alternated: 1.58 s against 1.45 s an epoch (see ``SlotArena``).

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
  one that needed a buffer of its own where no shared memory could be had (``/dev/shm`` full,
  as in a container started without ``--shm-size``): said once per worker, the batch never lost.
"""

from __future__ import annotations

import io
import itertools
import logging
import mmap
import os
import pickle
import weakref
from dataclasses import dataclass
from multiprocessing.reduction import DupFd, ForkingPickler
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


# -- the slots: fixed places in one shared mapping the workers inherit -----------------------------

# Address space per slot. Only the pages a batch writes take memory (a memfd is sparse, and its
# pages are charged when first written), so this is a ceiling on a batch, not a cost: a batch
# larger than this gets a buffer of its own. Workers x slots x this is mapped in each process.
SLOT_RESERVE = 1 << 30


class SlotArena:
    """Every worker's batch slots: ``rows`` x ``slots`` places of ``reserve`` bytes in one shared
    mapping of a memfd, made by the training process before its workers start. A forked worker
    inherits the mapping; a spawned one receives the descriptor once, when it unpickles its
    dataset. So no batch carries memory or a file descriptor, and the main process maps
    nothing while batches arrive.

    Instrumented (bench_remote_read's data, 2 workers from the bucket, 2 cores): with each slot a
    PyTorch shared-memory file that its first batch carried across, that batch's hand-over took
    35-100 ms instead of 1-5 (a socket connection to the worker and an HMAC handshake on both
    sides, while the worker's fetch threads held its GIL), and the workers stalled behind it
    (PyTorch sends each worker ``prefetch_factor`` indices until the first batch is taken). A
    memfd is also not ``/dev/shm``, whose size a container caps (64 MB unless ``--shm-size``)."""

    def __init__(self, rows: int, slots: int, reserve: int = SLOT_RESERVE, *, fd: int | None = None):
        self.rows, self.slots, self.reserve = rows, slots, reserve
        size = rows * slots * reserve
        if fd is None:
            fd = os.memfd_create("pid-platform-batch-slots", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                raise
        self._fd = fd
        try:
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        # numpy's view holds the mapping: views handed out keep it mapped after the arena is gone.
        self._map = mapping
        self._memory = np.frombuffer(mapping, dtype=np.uint8)
        weakref.finalize(self, os.close, fd)

    def view(self, row: int, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of worker ``row``'s slot ``slot``: a uint8 tensor whose storage
        is its own (``torch.from_numpy``), so a weak reference to it expires exactly when
        nothing viewing it is left."""
        if not (0 <= row < self.rows and 0 <= slot < self.slots and 0 <= nbytes <= self.reserve):
            raise ValueError(f"batch slot ({row}, {slot}) of {nbytes} bytes is outside this loader's "
                             f"{self.rows} x {self.slots} slots of {self.reserve} bytes")
        at = self._at(row, slot)
        return torch.from_numpy(self._memory[at:at + nbytes])

    def forget(self, row: int, slot: int) -> None:
        """Hand slot ``slot`` of worker ``row``'s pages back to the system (it reads as zeros
        after): a batch the training loop keeps (a LeRobot batch's tensors) holds the whole
        mapping, which would otherwise keep every slot's pages with it."""
        self._map.madvise(mmap.MADV_REMOVE, self._at(row, slot), self.reserve)

    def _at(self, row: int, slot: int) -> int:
        return (row * self.slots + slot) * self.reserve

    def __reduce__(self):
        # Only a spawned (or forkserver) worker's start pickles it: the descriptor goes along.
        return _arena_from, (DupFd(self._fd), self.rows, self.slots, self.reserve)


def _arena_from(fd: Any, rows: int, slots: int, reserve: int) -> SlotArena:
    return SlotArena(rows, slots, reserve, fd=fd.detach())


def _new_arena(rows: int, slots: int, reserve: int) -> SlotArena | None:
    """A SlotArena, or None where no memfd can be had (not Linux, or out of descriptors) or it
    cannot be mapped (an address-space limit, ``ulimit -v``, below rows x slots x reserve): then
    every batch gets a buffer of its own, as with every slot lent (said once)."""
    try:
        return SlotArena(rows, slots, reserve)
    except (AttributeError, OSError) as e:  # AttributeError: no os.memfd_create here
        log.warning("DataLoader workers hand each batch in a shared-memory buffer of its own, not in recycled "
                    "slots: no memfd of %d GiB mapped for them (%s; an address-space limit, ulimit -v, must "
                    "leave room for %d workers x %d slots x %d MiB of reserve, which takes memory only as "
                    "batches fill it)", rows * slots * reserve >> 30, e, rows, slots, reserve >> 20)
        return None


def empty_buffer(nbytes: int, *, shared: bool) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes``, in shared memory when ``shared`` (a
    DataLoader worker), so handing it to the main process copies nothing."""
    if not shared:
        return torch.empty(nbytes, dtype=torch.uint8)
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


@dataclass(frozen=True)
class PooledBuffer:
    """A batch's buffer taken from a worker's BufferPool: ``buffer`` (a view of a slot of the
    arena, ``slot`` its index) or, with every slot lent or a batch over the slot's reserve, a
    shared-memory buffer of its own (``slot`` None) that the batch carries across."""

    buffer: torch.Tensor
    slot: int | None


class BufferPool:
    """One worker's batch slots, reused once the main process has let go of them.
    ``flags[row, slot]`` (shared with the main process) is 1 while slot's buffer is lent out; the
    main process clears it (``BufferLender``). With every slot lent, a batch gets a fresh buffer
    of its own (never recycled), so a training loop keeping batches is still right. ``token``
    names the lender whose main process reads the slots."""

    def __init__(self, flags: torch.Tensor, row: int, token: int | None = None, arena: SlotArena | None = None):
        self.flags, self.row, self.token, self.arena = flags, row, token, arena

    def take(self, nbytes: int) -> PooledBuffer:
        arena = self.arena
        if arena is not None and nbytes <= arena.reserve:
            free = [s for s, f in enumerate(self.flags[self.row].tolist()) if not f]
            if free:
                self.flags[self.row, free[0]] = 1
                return PooledBuffer(arena.view(self.row, free[0], nbytes), free[0])
        return PooledBuffer(empty_buffer(nbytes, shared=True), None)


def worker_pool() -> BufferPool | None:
    """This DataLoader worker's BufferPool (kept on its dataset copy, so persistent workers keep
    it across epochs), or None outside a worker or without the loader's flags."""
    info = get_worker_info()
    flags = getattr(info.dataset, "_buffer_flags", None) if info is not None else None
    if flags is None or info.id >= flags.shape[0]:
        return None
    pool = getattr(info.dataset, "_buffer_pool", None)
    if pool is None or pool.flags is not flags:
        pool = BufferPool(flags, info.id, getattr(info.dataset, "_buffer_token", None),
                          getattr(info.dataset, "_buffer_arena", None))
        info.dataset._buffer_pool = pool
    return pool


# In the main process, the live BufferLenders by token: where an arriving batch's slot is read.
_lenders: weakref.WeakValueDictionary[int, BufferLender] = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


class BufferLender:
    """The main process's side of the workers' BufferPools: their slots (``arena``, made here,
    before the workers start) and flags; ``lend(batch)`` when a batch arrives, ``reclaim()``
    before waiting for the next one; a slot is free again once its storage is gone here (every
    tensor of the batch dropped), or at once for a pinned copy."""

    def __init__(self, workers: int, slots: int, reserve: int = SLOT_RESERVE):
        rows = max(1, workers)
        self.flags = torch.zeros((rows, slots), dtype=torch.int32).share_memory_()
        self.arena = _new_arena(rows, slots, reserve)
        self._out: list[tuple[StorageWeakRef, int, int]] = []
        self.token = next(_TOKENS)
        _lenders[self.token] = self
        if self.arena is not None:
            weakref.finalize(self, _forget_unlent, self.arena, self.flags)

    def attach(self, dataset: Any) -> None:
        """Give ``dataset`` (what the DataLoader hands its workers) this lender's flags, slots and
        token: ``worker_pool()`` in each worker makes its BufferPool from them."""
        dataset._buffer_flags, dataset._buffer_token, dataset._buffer_arena = self.flags, self.token, self.arena

    @staticmethod
    def detach(dataset: Any) -> None:
        """Take any lender's flags, slots and token off ``dataset``: its batches are built without a pool."""
        dataset._buffer_flags = dataset._buffer_token = dataset._buffer_arena = None

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


def _forget_unlent(arena: SlotArena, flags: torch.Tensor) -> None:
    """The lender is gone (its epoch is over): the pages of every slot no batch holds go back
    now, not when the last batch the training loop kept lets go of the mapping."""
    for row, lent in enumerate(flags.tolist()):
        for slot, held in enumerate(lent):
            if not held:
                arena.forget(row, slot)


def received_memory(token: int, row: int, slot: int, nbytes: int) -> torch.Tensor:
    """A worker's pooled batch arriving in the main process (its unpickling): the first ``nbytes``
    of its slot, read in place (``SlotArena.view``: the tensor keeps the mapping alive even after
    the lender has gone)."""
    lender = _lenders.get(token)
    if lender is None or lender.arena is None:
        raise RuntimeError(f"DataLoader worker {row} named batch slot {slot} of a loader this process does "
                           "not hold: its lender is gone; a batch must be read by the loader whose workers "
                           "built it")
    return lender.arena.view(row, slot, nbytes)


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
            self._rebuild = _pooled_payload, (pool.token, pool.row, taken.slot, pickler.total, skeleton)

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


def _pooled_payload(token: int, row: int, slot: int, nbytes: int, skeleton: bytes) -> Any:
    try:
        return _restored(received_memory(token, row, slot, nbytes), skeleton)
    finally:
        lender = _lenders.get(token)
        if lender is not None:
            lender.release(row, slot)  # every buffer is copied out: the worker may fill it again
