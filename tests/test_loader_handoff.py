"""Payloads handed from DataLoader workers through recycled shared memory (loader.handoff): they
arrive as they left, their large buffers never ride the pipe, a batch only names its slot (the
training process made the slots before its workers started), and a slot is freed as soon as its
bytes are copied out."""

from __future__ import annotations

import gc
import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions workers use)
from torch.utils.data import DataLoader, IterableDataset

from loader import handoff
from loader.handoff import BufferLender, BufferPool, SharedPayload
from tests.support.shipping import count_calls


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


def _key_seed(batch: dict) -> int:
    return int(batch["samples"][0]["__key__"][1:].split("-")[0])


@pytest.fixture
def pool(monkeypatch):
    """A worker's pool of two slots and its lender, in this process: packing uses the pool as a
    DataLoader worker's would, unpickling finds the lender as the training process does."""
    lender = BufferLender(workers=1, slots=2)
    pool = BufferPool(lender.flags, 0, lender.token, lender.arena)
    monkeypatch.setattr(handoff, "worker_pool", lambda: pool)
    yield pool, lender


def test_a_payload_goes_in_a_slot_read_in_place_and_free_again_once_read(pool):
    pool, lender = pool
    payload = _payload(1)
    wire = ForkingPickler.dumps(SharedPayload(payload))
    assert lender.flags.tolist() == [[1, 0]]  # lent while the batch is on its way
    large = sum(len(s["jpg"]) + s["arr"].nbytes + len(s["ba"]) for s in payload["samples"])
    # What rides the pipe: the structure, the small buffers, and the slot's name.
    assert len(wire) < 120_000 < large
    assert all(s["jpg"] not in bytes(wire) for s in payload["samples"])
    back = pickle.loads(wire)
    _same(payload, back)
    assert lender.flags.tolist() == [[0, 0]]  # copied out: the worker may fill it again
    # The next batch goes into the same slot, at the same place of the lender's arena.
    again = ForkingPickler.dumps(SharedPayload(_payload(2)))
    assert abs(len(again) - len(wire)) < 1_000 and lender.flags.tolist() == [[1, 0]]
    _same(_payload(2), pickle.loads(again))


def test_a_batch_over_a_slots_reserve_gets_a_buffer_of_its_own(monkeypatch):
    lender = BufferLender(workers=1, slots=2, reserve=64 << 10)
    pool = BufferPool(lender.flags, 0, lender.token, lender.arena)
    monkeypatch.setattr(handoff, "worker_pool", lambda: pool)
    payload = _payload(7)
    _same(payload, pickle.loads(ForkingPickler.dumps(SharedPayload(payload))))
    assert lender.flags.tolist() == [[0, 0]]  # no slot was taken
    assert pool.take(64 << 10).slot == 0 and pool.take((64 << 10) + 1).slot is None


def test_with_every_slot_lent_a_payload_gets_a_buffer_of_its_own(pool):
    pool, lender = pool
    lender.flags.fill_(1)  # the training loop has not read the last two batches yet
    payload = _payload(3)
    _same(payload, pickle.loads(ForkingPickler.dumps(SharedPayload(payload))))
    assert lender.flags.tolist() == [[1, 1]]  # theirs untouched


def test_a_small_payload_or_one_outside_a_worker_is_pickled_inline(pool, monkeypatch):
    pool, lender = pool
    payload = {"jpg": b"x" * 50_000, "txt": b"caption"}
    wire = ForkingPickler.dumps(SharedPayload(payload))
    assert b"x" * 50_000 in bytes(wire) and lender.flags.tolist() == [[0, 0]]
    _same(payload, pickle.loads(wire))
    monkeypatch.setattr(handoff, "worker_pool", lambda: None)  # no DataLoader worker with a lender
    big = _payload(4)
    wire = ForkingPickler.dumps(SharedPayload(big))
    assert big["samples"][0]["jpg"] in bytes(wire)
    _same(big, pickle.loads(wire))


def test_a_kept_batch_keeps_its_slot_and_the_others_go_back_with_the_lender():
    # A LeRobot batch is views of its slot, which hold the lender's whole mapping; once the lender
    # is gone, every slot no batch holds is handed back (a hole in a memfd reads as zeros).
    lender = BufferLender(workers=2, slots=2, reserve=1 << 16)
    pool = BufferPool(lender.flags, 1, lender.token, lender.arena)
    kept = pool.take(1000)
    kept.buffer.fill_(7)                    # lent: the training loop holds it
    done = pool.take(1000)
    done.buffer.fill_(9)
    lender.release(1, done.slot)            # read and let go of
    memory = lender.arena._memory           # the whole mapping, as every view of it holds it

    def slot_of(row: int, slot: int) -> np.ndarray:
        return memory[(row * 2 + slot) << 16:][:1000]

    assert slot_of(1, done.slot).size == 1000 and (slot_of(1, done.slot) == 9).all()
    del lender, pool
    gc.collect()
    assert (slot_of(1, done.slot) == 0).all() and (slot_of(1, kept.slot) == 7).all() and (kept.buffer == 7).all()


def test_with_no_shared_memory_to_be_had_a_payload_goes_inline_said_once(pool, monkeypatch, caplog):
    pool, lender = pool
    lender.flags.fill_(1)  # every slot lent: a batch needs a buffer of its own

    # A stand-in for a full /dev/shm (a test cannot shrink the machine's): PyTorch's own error.
    def full(nbytes, *, shared):
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_3>: No space left on device (28)")

    monkeypatch.setattr(handoff, "empty_buffer", full)
    monkeypatch.setattr(handoff, "_said", False)
    for seed in (5, 6):
        payload = _payload(seed)
        wire = ForkingPickler.dumps(SharedPayload(payload))
        assert payload["samples"][0]["jpg"] in bytes(wire)
        _same(payload, pickle.loads(wire))
    assert lender.flags.tolist() == [[1, 1]]  # theirs untouched
    said = [r.getMessage() for r in caplog.records if r.name == "loader.handoff"]
    assert len(said) == 1 and "/dev/shm" in said[0] and "No space left" in said[0]


def test_without_a_memfd_every_batch_gets_a_buffer_of_its_own_said(monkeypatch, caplog):
    def no_memfd(*args):
        raise OSError(24, "Too many open files")  # what memfd_create says out of descriptors

    monkeypatch.setattr(handoff.os, "memfd_create", no_memfd)
    lender = BufferLender(workers=1, slots=2)
    assert lender.arena is None
    said = [r.getMessage() for r in caplog.records if r.name == "loader.handoff"]
    assert len(said) == 1 and "no memfd" in said[0] and "Too many open files" in said[0]
    pool = BufferPool(lender.flags, 0, lender.token, lender.arena)
    monkeypatch.setattr(handoff, "worker_pool", lambda: pool)
    payload = _payload(8)
    with count_calls(handoff, "_restored") as own:
        _same(payload, pickle.loads(ForkingPickler.dumps(SharedPayload(payload))))
    assert own["calls"] == 1 and lender.flags.tolist() == [[0, 0]]


def test_under_an_address_space_limit_the_slots_fall_back_to_buffers_of_their_own(caplog):
    """A real ``ulimit -v`` (RLIMIT_AS) below the arena's reserve: mapping the memfd fails, the
    lender says so once, naming the limit, and batches still arrive whole in buffers of their own."""
    import resource

    status = Path("/proc/self/status").read_text()
    vm = next(int(line.split()[1]) << 10 for line in status.splitlines() if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), hard))  # 2 GiB to spare; the slots want 8
    try:
        lender = BufferLender(workers=2, slots=4)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert lender.arena is None
    said = [r.getMessage() for r in caplog.records if r.name == "loader.handoff"]
    assert len(said) == 1 and "8 GiB" in said[0] and "ulimit -v" in said[0], said
    with count_calls(handoff, "_pooled_payload") as named, count_calls(handoff, "_restored") as own:
        got = list(DataLoader(_Batches(8, lender), batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert sorted(_key_seed(b) for b in got) == list(range(8))
    for batch in got:
        _same(_payload(_key_seed(batch)), batch)
    assert named["calls"] == 0 and own["calls"] == 8


class _Batches(IterableDataset):
    """What ResumableLoader hands its DataLoader: a dataset carrying the lender's flags."""

    def __init__(self, n: int, lender: BufferLender):
        self.n = n
        lender.attach(self)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, self.n, info.num_workers):
            yield SharedPayload(_payload(i))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_batches_from_two_workers_arrive_whole_and_only_name_their_slots(context):
    # Forked workers inherit the lender's slots; spawned ones get its memfd once, as they start.
    slots = 3
    lender = BufferLender(2, slots)
    with count_calls(handoff, "_pooled_payload") as named, count_calls(handoff, "_restored") as restored:
        got = list(DataLoader(_Batches(24, lender), batch_size=None, num_workers=2, multiprocessing_context=context))
    assert sorted(_key_seed(b) for b in got) == list(range(24))
    for batch in got:
        _same(_payload(_key_seed(batch)), batch)
    # A worker has at most prefetch_factor batches on their way and one being packed: a slot each.
    assert named["calls"] == 24 and restored["calls"] == 24  # _pooled_payload restores through it
    assert lender.flags.sum().item() == 0  # every slot read and freed
    token = lender.token
    del lender
    gc.collect()
    assert token not in handoff._lenders


class _Unpicklable(IterableDataset):
    def __init__(self, lender: BufferLender):
        lender.attach(self)

    def __iter__(self):
        yield SharedPayload({"jpg": b"x" * 300_000, "handle": lambda: None})


def test_a_batch_that_cannot_be_pickled_fails_in_the_worker_naming_it():
    batches = iter(DataLoader(_Unpicklable(BufferLender(1, 3)), batch_size=None, num_workers=1,
                              multiprocessing_context="fork", timeout=60))
    try:
        with pytest.raises(Exception, match="(?s)Caught .* in DataLoader worker process 0.*lambda"):
            next(batches)
    finally:
        batches._shutdown_workers()  # the exception's traceback keeps the iterator (and its worker)
