"""What a DataLoader worker hands the training process: large buffers through shared memory.

A DataLoader worker's batch reaches the training process pickled through a pipe: the sample
bytes are copied into the pickle, through the kernel's 64 KiB pipe in hundreds of hand-offs
between the worker's feeder thread and the reader, and out of the pickle again. Measured with a
bucket's read-ahead at 2 workers on 2 cores (bench_remote_read, 3,000 photographs), handing the
batches over cost a quarter of the wall time: 1.43 s for the epoch with nothing handed over, 1.86
through the pipe.

``SharedPayload(obj)`` pickles ``obj`` with its large buffers (``bytes``, ``bytearray``, C-ordered
numpy arrays of plain numbers, 16 KiB and up) written once into an anonymous shared-memory file
(``memfd_create``) and the rest pickled as usual; the training process reads each buffer straight
out of that file into its new object: one copy each side, no pipe. Unpickling gives back the
original object, not a ``SharedPayload``. Torch tensors inside keep PyTorch's own sharing (the
pickler is the DataLoader's, ``ForkingPickler``, with its reducers).

Forked workers (``Channels``, made by the training process before the fork) each keep up to
``SLOTS`` such files and write batch after batch into them: a fresh file per batch cost as much
again, the kernel zeroing and charging every new page. A file's descriptor goes to the training
process once, over a socket pair of that worker's, and the training process says on it when it
has read a file, which the worker may then fill again; a worker with every file still unread
makes a one-off file, which the training process closes after reading it. Workers started
another way (spawn, forkserver) send a one-off file's descriptor per batch the way PyTorch sends
a tensor's storage (``multiprocessing.reduction.DupFd``). Nothing has a name: nothing is left in
``/dev/shm`` by a killed process, and the memory goes with the last descriptor. Elsewhere than
Linux, or for a payload under 256 KiB, the batch is pickled inline, as is one whose file could
not be made (said once per worker; the batch is never lost).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import pickle
import socket
import struct
import threading
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any

import numpy as np

# A buffer smaller than this is pickled inline: a pread of its own costs more than the copy.
MIN_BUFFER = 16 << 10
# A payload whose buffers add up to less than this is pickled inline (no file, no descriptor).
MIN_TOTAL = 256 << 10
_IOV_MAX = 1024  # buffers per writev (POSIX's minimum IOV_MAX is 16; Linux's is 1024)
# Files a forked worker keeps and refills: the batches the DataLoader prefetches from it (its
# prefetch_factor, 2 by default) and the one it is packing.
SLOTS = 3
_SLOT = struct.Struct("<q")  # a message on a worker's socket pair: a slot number (< 0: one-off)
_RECV_TIMEOUT_S = 60.0  # a descriptor the worker sent before queueing the batch is there at once
log = logging.getLogger(__name__)
_warned = False


def available() -> bool:
    """Whether payloads can be handed through shared memory on this platform."""
    return hasattr(os, "memfd_create")


class SharedPayload:
    """``obj`` packed for the training process: its large buffers already in shared memory.

    Packing happens here, in the worker's own thread, not when the DataLoader's queue pickles
    it in its feeder thread: an object that cannot be pickled then fails in the worker with
    PyTorch's traceback naming it (a feeder thread prints the error, drops the batch, and the
    loader waits for it for ever), and a failure to make the shared memory falls back to the
    pipe, said once, the batch never lost."""

    __slots__ = ("_rebuild",)

    def __init__(self, obj: Any):
        pickler = _Collecting()
        pickler.dump(obj)
        skeleton, buffers = pickler.file.getvalue(), pickler.buffers
        if pickler.total < MIN_TOTAL or not available():
            self._rebuild = _inline, (skeleton, buffers)
            return
        sender = _sender_here()
        if sender is not None:
            try:
                self._rebuild = sender.pack(skeleton, buffers, pickler.total)
            except OSError as e:  # out of descriptors, or of memory
                self._rebuild = _fall_back(e, skeleton, buffers)
            return
        try:
            fd = _new_file()
        except OSError as e:
            self._rebuild = _fall_back(e, skeleton, buffers)
            return
        try:
            _write_all(fd, buffers, pickler.total)
            # The descriptor the way PyTorch sends a tensor's storage: a duplicate held by this
            # process's resource sharer until the training process connects for it.
            self._rebuild = _from_shared_memory, (DupFd(fd), skeleton)
        except OSError as e:  # the file's pages, or the duplicate's descriptor
            self._rebuild = _fall_back(e, skeleton, buffers)
        finally:
            os.close(fd)

    def __reduce__(self):
        return self._rebuild


def _fall_back(error: OSError, skeleton: bytes, buffers: list[Any]):
    """The batch pickled inline, through the pipe, said once per process."""
    global _warned
    if not _warned:
        _warned = True
        log.warning("DataLoader worker %d hands its batches through the pipe, not shared memory: %s "
                    "(memfd_create or a descriptor for it failed; raise the open-files limit, ulimit -n, "
                    "or free memory)", os.getpid(), error)
    return _inline, (skeleton, buffers)


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


def _new_file() -> int:
    return os.memfd_create("pid-platform-batch", os.MFD_CLOEXEC)


def _write_all(fd: int, buffers: list[Any], total: int) -> None:
    """Every buffer into ``fd`` from its start, one after another (a write may take less than
    asked: go on)."""
    views = [memoryview(b).cast("B") for b in buffers]
    written = 0
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], written)
        if n <= 0:
            break
        written += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
    if written != total:
        raise OSError(f"shared-memory hand-off wrote {written} of {total} bytes")


class _Restoring(pickle.Unpickler):
    def __init__(self, skeleton: bytes, load):
        super().__init__(io.BytesIO(skeleton))
        self.persistent_load = load


def _inline(skeleton: bytes, buffers: list[Any]) -> Any:
    return _Restoring(skeleton, lambda pid: buffers[pid[0]]).load()


def _read_exactly(fd: int, pid: tuple) -> Any:
    _, offset, size, kind = pid
    if kind == "bytes":
        data = os.pread(fd, size, offset)  # a new bytes object, filled by the kernel
        got = len(data)
    else:
        data = bytearray(size) if kind == "bytearray" else np.empty(kind[1], dtype=kind[0])
        got = os.preadv(fd, [memoryview(data).cast("B")], offset)
    if got != size:
        raise OSError(f"shared-memory hand-off: {got} of the {size} bytes at {offset} arrived")
    return data


def _from_shared_memory(handle: Any, skeleton: bytes) -> Any:
    fd = handle.detach()
    try:
        return _Restoring(skeleton, lambda pid: _read_exactly(fd, pid)).load()
    finally:
        os.close(fd)


# -- forked workers: files kept and refilled, descriptors over a socket pair per worker -------------

_tokens = itertools.count()
_receivers: dict[int, dict[int, _Receiver]] = {}  # in the training process: token -> worker -> its end
_forking: tuple[int, list[socket.socket]] | None = None  # what a worker forked now finds: token, ends
_sender: _Sender | None = None  # in a worker: its end


class Channels:
    """One socket pair per DataLoader worker, made in the training process just before the
    DataLoader forks them (``forked()`` once it has, ``close()`` when its iteration ends)."""

    def __init__(self, workers: int):
        global _forking
        self.token = next(_tokens)
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(workers)]
        for mine, _ in pairs:
            mine.settimeout(_RECV_TIMEOUT_S)
        self._worker_ends: list[socket.socket] = [theirs for _, theirs in pairs]
        _receivers[self.token] = {i: _Receiver(mine, i) for i, (mine, _) in enumerate(pairs)}
        _forking = self.token, self._worker_ends

    def forked(self) -> None:
        """The workers have their ends: this process's copies of them go (a worker's end closing
        is then how its death shows)."""
        global _forking
        if _forking is not None and _forking[0] == self.token:
            _forking = None
        for end in self._worker_ends:
            end.close()

    def close(self) -> None:
        self.forked()
        for receiver in _receivers.pop(self.token, {}).values():
            receiver.close()


def _sender_here() -> _Sender | None:
    """This worker's end, if the training process made it one before forking it."""
    global _sender
    if _sender is not None and _sender.pid == os.getpid():
        return _sender
    if _forking is None:
        return None
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None or info.id >= len(_forking[1]):
        return None
    _sender = _Sender(_forking[0], info.id, _forking[1][info.id])
    return _sender


class _Sender:
    """A worker's end: the files it keeps (slot -> descriptor), those the training process has
    read (free), and how to fill one."""

    def __init__(self, token: int, worker: int, sock: socket.socket):
        self.pid = os.getpid()
        self.token, self.worker, self.sock = token, worker, sock
        self.files: dict[int, int] = {}
        self.free: list[int] = []
        self.one_offs = itertools.count(1)

    def pack(self, skeleton: bytes, buffers: list[Any], total: int) -> tuple:
        self._take_releases()
        if self.free:
            slot = self.free.pop()
            fd = self.files[slot]
        else:
            slot = len(self.files) if len(self.files) < SLOTS else -next(self.one_offs)
            fd = _new_file()
            try:
                socket.send_fds(self.sock, [_SLOT.pack(slot)], [fd])
            except OSError:
                os.close(fd)
                raise
            if slot >= 0:
                self.files[slot] = fd
        try:
            _write_all(fd, buffers, total)
        except OSError:
            if slot >= 0:
                self.free.append(slot)  # unread by anyone: free for the next batch
            raise
        finally:
            if slot < 0:
                os.close(fd)  # the training process has its own descriptor
        if slot >= 0 and os.fstat(fd).st_size > total + (total >> 1):
            os.ftruncate(fd, total)  # a batch much smaller than the file's last: give back the rest
        return _from_slot, (self.token, self.worker, slot, skeleton)

    def _take_releases(self) -> None:
        while True:
            try:
                msg = self.sock.recv(_SLOT.size, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            if len(msg) != _SLOT.size:
                return  # the training process closed its end
            self.free.append(_SLOT.unpack(msg)[0])


class _Receiver:
    """The training process's end of one worker's pair: the descriptors of that worker's files."""

    def __init__(self, sock: socket.socket, worker: int):
        self.sock, self.worker = sock, worker
        self.files: dict[int, int] = {}
        self.lock = threading.Lock()  # the DataLoader unpickles in one thread, or its pin-memory thread

    def read(self, slot: int, skeleton: bytes) -> Any:
        with self.lock:
            fd = self._file(slot)
            try:
                return _Restoring(skeleton, lambda pid: _read_exactly(fd, pid)).load()
            finally:
                if slot < 0:
                    os.close(self.files.pop(slot))
                else:
                    # Read: the worker may fill it again (a worker gone has nothing to refill).
                    with contextlib.suppress(OSError):
                        self.sock.send(_SLOT.pack(slot), socket.MSG_DONTWAIT)

    def _file(self, slot: int) -> int:
        while slot not in self.files:
            try:
                msg, fds, _, _ = socket.recv_fds(self.sock, _SLOT.size, 1)
            except TimeoutError:
                raise RuntimeError(f"DataLoader worker {self.worker} queued a batch in shared-memory file {slot} "
                                   f"but its descriptor did not come in {_RECV_TIMEOUT_S:g} s") from None
            if not msg or not fds:
                raise RuntimeError(f"DataLoader worker {self.worker} closed its shared-memory channel before "
                                   f"handing over file {slot} (the worker died?)")
            self.files[_SLOT.unpack(msg)[0]] = fds[0]
        return self.files[slot]

    def close(self) -> None:
        with self.lock:
            for fd in self.files.values():
                os.close(fd)
            self.files.clear()
            self.sock.close()


def _from_slot(token: int, worker: int, slot: int, skeleton: bytes) -> Any:
    receivers = _receivers.get(token)
    if receivers is None or worker not in receivers:
        raise RuntimeError("a batch packed in shared memory for another process's DataLoader was unpickled here "
                           "(the process that started the worker reads it, once)")
    return receivers[worker].read(slot, skeleton)
