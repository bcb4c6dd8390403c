"""Batches handed from DataLoader workers through shared memory (loader.handoff): they arrive as
they left, the bytes never ride the pipe, and no descriptor or memory stays behind."""

from __future__ import annotations

import os
import pickle
import socket
import sys
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from loader import handoff
from loader.handoff import SharedPayload

pytestmark = pytest.mark.skipif(not handoff.available(), reason="memfd_create is Linux's")


def _payload(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "samples": [
            {"__key__": f"k{seed}-{i}", "jpg": rng.bytes(100_000 + i), "txt": b"small caption",
             "arr": rng.random((64, 96)).astype(np.float32), "ba": bytearray(rng.bytes(20_000))}
            for i in range(8)
        ],
        "strided": rng.random((100, 100))[:, ::2],  # not contiguous: pickled as numpy pickles it
        "objects": np.array([{"a": 1}, None] * 5000, dtype=object),
        "tensor": torch.arange(50_000, dtype=torch.int32),
        "empty": b"",
        "tuple": (rng.bytes(30_000), 7),
    }


def _same(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and b.flags.writeable
        assert (a == b).all() if a.dtype.hasobject else np.array_equal(a, b)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def _memfds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "pid-platform-batch" in target:
            out.append(target)
    return out


def test_a_payload_round_trips_and_its_buffers_stay_out_of_the_pickle():
    payload = _payload(1)
    wire = ForkingPickler.dumps(SharedPayload(payload))
    large = sum(len(s["jpg"]) + s["arr"].nbytes + len(s["ba"]) for s in payload["samples"])
    # What rides the pipe: the structure, the small buffers and the descriptor's address.
    assert len(wire) < 120_000 < large
    for s in payload["samples"]:
        assert s["jpg"] not in bytes(wire)
    back = pickle.loads(wire)
    _same(payload, back)
    assert _memfds() == []  # the worker's copy and the reader's both closed: the memory is freed


def test_a_small_payload_is_pickled_inline_without_a_file(monkeypatch):
    made = []
    real = os.memfd_create
    monkeypatch.setattr(os, "memfd_create", lambda *a: made.append(a) or real(*a))
    payload = {"jpg": b"x" * 50_000, "txt": b"caption"}
    wire = ForkingPickler.dumps(SharedPayload(payload))
    assert b"x" * 50_000 in bytes(wire) and made == []
    _same(payload, pickle.loads(wire))


def test_when_no_shared_memory_can_be_made_the_batch_goes_inline_not_lost(monkeypatch):
    def refuse(*_):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "memfd_create", refuse)
    payload = _payload(2)
    wire = ForkingPickler.dumps(SharedPayload(payload))
    assert payload["samples"][0]["jpg"] in bytes(wire)
    _same(payload, pickle.loads(wire))


class _Batches(IterableDataset):
    def __init__(self, n: int = 12):
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, self.n, info.num_workers):
            yield SharedPayload(_payload(i))


def _through_forked_workers(batches: int = 12) -> tuple[list, list[int]]:
    """Batches from two forked workers with the training process's channels, as ResumableLoader
    makes them; (the batches, the slot of each shared-memory file descriptor received)."""
    received: list[int] = []
    real = socket.recv_fds

    def counting(sock, bufsize, maxfds, flags=0):
        msg, fds, fl, addr = real(sock, bufsize, maxfds, flags)
        received.append(handoff._SLOT.unpack(msg)[0])
        return msg, fds, fl, addr

    channels = handoff.Channels(2)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(socket, "recv_fds", counting)
            blocks = iter(DataLoader(_Batches(batches), batch_size=None, num_workers=2, multiprocessing_context="fork"))
            channels.forked()
            got = list(blocks)
    finally:
        channels.close()
    return got, received


def test_batches_from_forked_workers_arrive_whole_through_files_they_refill(monkeypatch):
    read_here = []
    real = handoff._read_exactly

    def counting(fd, pid):
        read_here.append(os.getpid())
        return real(fd, pid)

    # Only the training process reads the shared memory: patched here, it counts those reads.
    monkeypatch.setattr(handoff, "_read_exactly", counting)
    got, files = _through_forked_workers(24)
    # 8 jpg + 8 arr + 8 ba, the tuple's bytes and the strided array's (numpy pickles a copy of it
    # as bytes) per batch came out of shared memory, here.
    assert len(got) == 24 and read_here == [os.getpid()] * 24 * 26
    for batch in got:
        _same(_payload(_key_seed(batch)), batch)
    assert sorted(_key_seed(b) for b in got) == list(range(24))
    # Each worker sent the descriptors of its kept files once (3 at most), not one per batch.
    assert sorted(f for f in files if f >= 0) <= sorted([0, 1, 2] * 2) and len(files) <= 2 * handoff.SLOTS
    assert _memfds() == [] and handoff._receivers == {}


def test_a_worker_whose_files_are_all_unread_hands_one_off_files_the_reader_closes(monkeypatch):
    monkeypatch.setattr(handoff, "SLOTS", 0)  # inherited by the forked workers: no file is kept
    got, files = _through_forked_workers(10)
    assert sorted(_key_seed(b) for b in got) == list(range(10))
    for batch in got:
        _same(_payload(_key_seed(batch)), batch)
    assert len(files) == 10 and all(f < 0 for f in files)
    assert _memfds() == []


def test_batches_from_two_forked_workers_without_channels_arrive_whole(monkeypatch):
    """Workers forked by a DataLoader nobody made channels for (a plain DataLoader over a dataset
    that packs) send a one-off file per batch the way PyTorch sends a storage."""
    read_here = []
    real = handoff._read_exactly

    def counting(fd, pid):
        read_here.append(os.getpid())
        return real(fd, pid)

    monkeypatch.setattr(handoff, "_read_exactly", counting)
    loader = DataLoader(_Batches(), batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = list(loader)
    assert len(got) == 12 and read_here == [os.getpid()] * 12 * 26
    for batch in got:
        _same(_payload(_key_seed(batch)), batch)
    assert _memfds() == []


class _Unpicklable(IterableDataset):
    def __iter__(self):
        yield SharedPayload({"jpg": b"x" * 300_000, "handle": lambda: None})


def test_a_batch_that_cannot_be_pickled_fails_in_the_worker_naming_it():
    loader = DataLoader(_Unpicklable(), batch_size=None, num_workers=1, multiprocessing_context="fork", timeout=60)
    with pytest.raises(Exception, match="(?s)Caught .* in DataLoader worker process 0.*lambda"):
        list(loader)


def _key_seed(batch: dict) -> int:
    return int(batch["samples"][0]["__key__"][1:].split("-")[0])


@pytest.mark.skipif(sys.platform != "linux", reason="spawn start is checked on Linux only")
def test_batches_from_spawned_workers_arrive_whole():
    loader = DataLoader(_Batches(), batch_size=None, num_workers=2, multiprocessing_context="spawn")
    got = list(loader)
    assert sorted(_key_seed(b) for b in got) == list(range(12))
    for batch in got:
        _same(_payload(_key_seed(batch)), batch)
