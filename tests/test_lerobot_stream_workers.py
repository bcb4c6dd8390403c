"""StreamingLeRobotDataset through make_loader's DataLoader workers: batches built in the
workers equal the map-style oracle's items, the uint8 hand-over is the float32 frames x 255,
persistent workers keep their caches across epochs with exact coverage and resume, and
``loader.stats()`` reports batch-wait and refill percentiles."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from loader.lerobot.streaming import StreamingLeRobotDataset, make_loader
from loader.lerobot.streaming.collate import LocalBufferPool, PackedBatch, collate_items, raw_frames
from loader.lerobot.streaming.items import frames_to_tensor
from tests.support.lerobot_oracle import MapStyleOracle, assert_item_equal
from tests.support.shipping import count_calls
from tests.test_lerobot_stream import lerobot_home  # noqa: F401  (autouse: the session's shared sidecar cache)

REPO = "local/arm"
CAMERAS = ["observation.images.front", "observation.images.wrist"]
DELTAS = {"observation.images.front": [-0.2, 0.0], "action": [0.0, 0.1]}


def stream(root, **kw) -> StreamingLeRobotDataset:
    return StreamingLeRobotDataset(REPO, root=str(root), streaming_episode_pool_size=2, **kw)


def rows(batch: dict) -> list[dict]:
    """A batch split back into items."""
    n = len(batch["index"])
    return [{k: (v[i] if isinstance(v, torch.Tensor | list) else v) for k, v in batch.items()} for i in range(n)]


def batch_indices(batches) -> list[int]:
    return [int(x) for b in batches for x in b["index"]]


def test_frame_conversion_equals_lerobots_for_every_value() -> None:
    # float32(v) / 255 per value: numpy's single-threaded divide is LeRobot's torch expression.
    values = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1).repeat(3, axis=3)
    lerobot = torch.from_numpy(values).permute(0, 3, 1, 2).contiguous().type(torch.float32) / 255
    planes = np.ascontiguousarray(values.transpose(0, 3, 1, 2))     # as the decoder gives them
    ours = frames_to_tensor(planes)
    assert ours.dtype == torch.float32 and torch.equal(ours.view(torch.int32), lerobot.view(torch.int32))
    assert torch.equal(frames_to_tensor(planes, "uint8"), torch.from_numpy(values).permute(0, 3, 1, 2))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("deltas", [None, DELTAS], ids=["frames", "windows"])
def test_batches_built_in_the_workers_equal_the_oracle(lerobot_v3_root: Path, workers: int, deltas) -> None:
    oracle = MapStyleOracle(lerobot_v3_root, delta_timestamps=deltas)
    loader = make_loader(stream(lerobot_v3_root, delta_timestamps=deltas), batch_size=3, num_workers=workers)
    batches = list(loader)
    # The same keys and order as default_collate over the items (LeRobot's, then the reader's
    # __pad__ mask), every row the oracle's item.
    item = oracle.item(0)
    assert list(batches[0]) == [*item, "__pad__"]
    assert batches[0]["__pad__"].dtype == torch.bool and not any(bool(p) for b in batches for p in b["__pad__"])
    assert isinstance(batches[0]["task"], list)
    for batch in batches:
        for row in rows(batch):
            assert_item_equal(row, oracle.item(int(row["index"])), where=f"index {int(row['index'])}",
                              video_keys=CAMERAS)
    assert set(batch_indices(batches)) == set(oracle.indices())
    # The dataset read on its own afterwards yields items again, not batches.
    item = next(iter(loader.dataset))
    assert item["index"].dim() == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_uint8_frames_are_the_float_frames_times_255(lerobot_v3_root: Path, workers: int) -> None:
    def batches(**kw):
        return list(make_loader(stream(lerobot_v3_root, delta_timestamps=DELTAS, **kw), batch_size=4,
                                num_workers=workers))

    floats, bytes_ = batches(), batches(frame_dtype="uint8")
    assert batch_indices(floats) == batch_indices(bytes_)
    for f, u in zip(floats, bytes_, strict=True):
        for key in f:
            if key in CAMERAS:
                assert u[key].dtype == torch.uint8 and f[key].dtype == torch.float32
                assert torch.equal(u[key].to(torch.float32), f[key] * 255)
                # ...and converting on the GPU side gives LeRobot's float32 frames bit for bit.
                assert torch.equal(u[key].float().div_(255), f[key])
            elif isinstance(f[key], torch.Tensor):
                assert torch.equal(f[key], u[key])
            else:
                assert f[key] == u[key]
    # An item read on its own (no loader) follows the option too.
    item = next(iter(stream(lerobot_v3_root, frame_dtype="uint8")))
    oracle = MapStyleOracle(lerobot_v3_root).item(int(item["index"]))
    for key in CAMERAS:
        assert item[key].dtype == torch.uint8
        assert torch.equal(item[key].to(torch.float32), oracle[key] * 255)


def test_a_callers_collate_fn_gets_lerobots_items(lerobot_v3_root: Path) -> None:
    seen = []

    def collate(items):
        seen.extend(items)
        return {"index": torch.stack([i["index"] for i in items])}

    list(make_loader(stream(lerobot_v3_root), batch_size=2, num_workers=0, collate_fn=collate))
    oracle = MapStyleOracle(lerobot_v3_root)
    assert len(seen) >= len(oracle.indices())
    for item in seen[:5]:
        assert_item_equal(item, oracle.item(int(item["index"])), video_keys=CAMERAS)


def test_a_packed_batch_is_one_shared_buffer() -> None:
    frames = np.random.default_rng(0).integers(0, 256, (1, 3, 6, 8), dtype=np.uint8)
    items = [{"cam": raw_frames(frames), "index": torch.tensor(i), "flag": torch.tensor([True, False]),
              "task": "pick"} for i in range(3)]
    packed = collate_items(items, ["cam"], frame_dtype="float32", shared=True)
    assert isinstance(packed, PackedBatch) and packed.buffer.is_shared()
    batch = packed.unpack()
    assert list(batch) == ["cam", "index", "flag", "task"]
    assert all(v.untyped_storage().data_ptr() == packed.buffer.untyped_storage().data_ptr()
               for v in batch.values() if isinstance(v, torch.Tensor))
    want = frames_to_tensor(frames).squeeze(0)
    assert batch["cam"].shape == (3, 3, 6, 8) and all(torch.equal(batch["cam"][i], want) for i in range(3))
    assert batch["index"].tolist() == [0, 1, 2] and batch["flag"].dtype == torch.bool
    assert batch["task"] == ["pick"] * 3


def test_the_training_process_reuses_a_batch_buffer_only_once_the_batch_is_gone() -> None:
    pool = LocalBufferPool(slots=2)
    a = pool.take(1000)
    a_ptr = a.data_ptr()
    view = a[10:20].view(torch.uint8)
    del a
    b = pool.take(1000)                 # a's buffer is still read through `view`
    assert b.data_ptr() != a_ptr
    del view
    c = pool.take(800)                  # now free (and big enough): reused
    assert c.data_ptr() == a_ptr and pool.reused == 1
    as_numpy = c.numpy()
    del c
    d = pool.take(1000)                 # every slot lent (a .numpy() holds its batch): a fresh buffer
    assert d.data_ptr() not in (a_ptr, b.data_ptr())
    del as_numpy, b
    e = pool.take(4000)                 # bigger than both: a free slot grows
    assert e.numel() == 4000 and len(pool._memory) == 2


def test_batches_read_without_workers_stay_valid_while_held(lerobot_v3_root: Path) -> None:
    # Held batches are never overwritten by later ones (their buffers are not reused while held).
    loader = make_loader(stream(lerobot_v3_root), batch_size=2, num_workers=0)
    held = list(loader)
    again = list(make_loader(stream(lerobot_v3_root), batch_size=2, num_workers=0))
    assert len(held) == len(again) > 3
    for a, b in zip(held, again, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in CAMERAS)


# -- persistent workers -------------------------------------------------------------------------------

def _worker_pids(loader) -> list[int]:
    return [w.pid for w in loader._dataloader._iterator._workers]


def test_persistent_workers_cover_two_epochs_and_resume_between(lerobot_v3_root: Path) -> None:
    frames = MapStyleOracle(lerobot_v3_root).indices()

    def new(**kw):
        return make_loader(stream(lerobot_v3_root), batch_size=2, num_workers=2, **kw)

    plain = new()
    want = [batch_indices(plain), batch_indices(plain), batch_indices(plain)]   # fresh workers each epoch
    plain_requests = plain.stats()["requests"]

    loader = new(persistent_workers=True)
    first = batch_indices(loader)
    pids = _worker_pids(loader)
    requests_first = loader.stats()["requests"]
    assert first == want[0]
    padding = loader.stats()["padding_samples"]
    assert set(first) == set(frames) and len(first) == len(frames) + padding
    assert sum(c - 1 for c in Counter(first).values()) == padding

    # Epoch 1: stop after 3 batches, checkpoint, restore into the same loader, finish it.
    taken = []
    for step, batch in enumerate(loader):
        taken.append(batch)
        if step == 2:
            state = loader.state_dict()
            break
    loader.load_state_dict(state)
    rest = batch_indices(loader)
    assert batch_indices(taken) + rest == want[1]
    # And the epoch after is the uninterrupted epoch 2.
    assert batch_indices(loader) == want[2]
    assert _worker_pids(loader) == pids                      # the same worker processes throughout
    # They kept their parquet footers: a whole later epoch asks for none of them again.
    assert loader.stats()["requests"] < plain_requests == requests_first


def test_persistent_workers_after_an_elastic_resume(lerobot_v3_root: Path) -> None:
    frames = set(MapStyleOracle(lerobot_v3_root).indices())
    first = make_loader(stream(lerobot_v3_root), batch_size=2, num_workers=1)
    done = []
    for step, batch in enumerate(first):
        done += batch_indices([batch])
        if step == 1:
            state = first.state_dict()
            break
    loader = make_loader(stream(lerobot_v3_root), batch_size=3, num_workers=2, persistent_workers=True)
    loader.load_state_dict(state)
    rest = batch_indices(loader)
    assert frames - set(done) <= set(rest) and set(done) | set(rest) == frames
    assert len(rest) - len(set(rest)) <= loader.stats()["padding_samples"]
    again = batch_indices(loader)          # the next epoch is a whole one
    assert set(again) == frames


# -- statistics -------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_batch_wait_and_refill_percentiles(lerobot_v3_root: Path, workers: int) -> None:
    loader = make_loader(stream(lerobot_v3_root), batch_size=2, num_workers=workers)
    n = len(list(loader))
    s = loader.stats()
    assert s["batches_waited"] == n > 0
    waits = [s[f"batch_wait_s_p{q}"] for q in (50, 95, 99)]
    refill = [s[f"refill_p{q}"] for q in (50, 95, 99)]
    assert all(isinstance(v, float) for v in waits + refill)
    assert 0 <= waits[0] <= waits[1] <= waits[2] < 60
    assert 0 <= refill[0] <= refill[1] <= refill[2] <= 1


# -- recycled batch buffers ---------------------------------------------------------------------------

def test_worker_buffers_are_reused_only_once_released() -> None:
    from loader.handoff import BufferLender, BufferPool

    lender = BufferLender(workers=1, slots=2)
    pool = BufferPool(lender.flags, 0, arena=lender.arena)
    a, b = pool.take(100), pool.take(50)
    slot_a, slot_b = a.slot, b.slot
    assert (slot_a, slot_b) == (0, 1) and lender.flags.tolist() == [[1, 1]]
    c = pool.take(10)                               # every slot lent: a buffer of its own
    assert c.slot is None and c.buffer.untyped_storage().data_ptr() not in (
        a.buffer.untyped_storage().data_ptr(), b.buffer.untyped_storage().data_ptr())
    # What the main process holds is its own mapping of the buffer (here: another tensor).
    received = torch.empty(100, dtype=torch.uint8)
    lender.lend(PackedBatch(received, [], (0, slot_a)))
    view = received[10:20]
    del received
    lender.reclaim()
    assert lender.flags.tolist() == [[1, 1]]        # a view of it is still held
    del view
    lender.reclaim()
    assert lender.flags.tolist() == [[0, 1]]
    again = pool.take(80)                           # fits the released slot: the same memory
    assert again.slot == slot_a and lender.flags.tolist() == [[1, 1]]
    assert again.buffer.untyped_storage().data_ptr() == a.buffer.untyped_storage().data_ptr()
    lender.lend(PackedBatch(b.buffer, [], (0, slot_b), pinned=True))   # a pinned copy frees it at once
    assert lender.flags.tolist() == [[1, 0]]


def test_a_recycled_buffer_is_read_in_place_by_the_main_process() -> None:
    # A batch in a slot only names it: the main process reads the lender's arena, where the
    # worker wrote. Pickled as a worker's result queue pickles it.
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the tensor reductions workers use)

    from loader.handoff import BufferLender, BufferPool

    def cross(packed: PackedBatch) -> tuple[PackedBatch, int]:
        out = io.BytesIO()
        ForkingPickler(out).dump(packed)
        return ForkingPickler.loads(out.getvalue()), len(out.getvalue())

    lender = BufferLender(workers=1, slots=1, reserve=4096)
    pool = BufferPool(lender.flags, 0, lender.token, lender.arena)
    layout = [("x", 0, torch.uint8, (8,))]
    first = pool.take(8)
    first.buffer.copy_(torch.arange(8, dtype=torch.uint8))
    got, size = cross(PackedBatch(first.buffer, layout, (0, first.slot), token=lender.token))
    assert got.unpack()["x"].tolist() == list(range(8)) and size < 300  # a name, not memory
    lender.lend(got)
    del got
    lender.reclaim()
    second = pool.take(8)
    assert second.slot == first.slot
    second.buffer.fill_(7)
    named, _ = cross(PackedBatch(second.buffer, layout, (0, second.slot), token=lender.token))
    assert named.unpack()["x"].tolist() == [7] * 8
    # The main process's tensors keep the memory alive without the lender.
    kept = named.unpack()["x"]
    lender.lend(named)
    del named
    token = lender.token
    del lender
    import gc
    gc.collect()
    from loader import handoff
    assert token not in handoff._lenders and kept.tolist() == [7] * 8
    # A batch naming a lender this process does not hold is an error that says why, not other bytes.
    stranger = PackedBatch(second.buffer, layout, (0, 0), token=token)
    with pytest.raises(RuntimeError, match="lender is gone"):
        cross(stranger)
    # A batch over a slot's reserve gets a buffer of its own, carried across with it.
    pool.flags[0, 0] = 0
    big = pool.take(8192)
    assert big.slot is None
    big.buffer.fill_(3)
    whole, _ = cross(PackedBatch(big.buffer, [("x", 0, torch.uint8, (8192,))]))
    assert whole.unpack()["x"].sum().item() == 3 * 8192


def test_workers_name_their_slots_across_persistent_epochs(lerobot_v3_root: Path) -> None:
    from loader import handoff
    from loader.lerobot.streaming import collate

    with count_calls(collate, "_received") as named:
        loader = make_loader(stream(lerobot_v3_root), batch_size=2, num_workers=2, persistent_workers=True)
        batches = [[[int(i) for i in batch["index"]] for batch in loader] for _ in range(2)]
    firsts = [sorted(i for b in epoch for i in b) for epoch in batches]
    assert firsts[0] == firsts[1]
    # The loop drops each batch before the next: every one goes in a slot and only names it.
    assert named["calls"] == sum(len(epoch) for epoch in batches) > 0
    token = loader._lender.token
    assert token in handoff._lenders
    del loader
    import gc
    gc.collect()
    assert token not in handoff._lenders


@pytest.mark.parametrize("pin", [False, True])
def test_batches_kept_by_the_training_loop_are_never_overwritten(lerobot_v3_root: Path, pin: bool) -> None:
    # Keeping every batch lends out every slot: later batches must get buffers of their own.
    loader = make_loader(stream(lerobot_v3_root), batch_size=2, num_workers=2, pin_memory=pin)
    kept, copies = [], []
    for batch in loader:
        kept.append(batch)
        copies.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
    assert len(kept) > 2 * (2 + 3)                  # more batches than the two workers' slots
    for batch, copy in zip(kept, copies, strict=True):
        for k, v in copy.items():
            assert torch.equal(batch[k], v), k
    # Dropping each batch: the slots are reused and the batches are the same.
    again = []
    for batch in loader:
        again.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
    loader2 = make_loader(stream(lerobot_v3_root), batch_size=2, num_workers=0)
    want = [{k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)} for b in loader2]
    want2 = [{k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)} for b in loader2]
    assert sorted(batch_indices(again)) == sorted(batch_indices(want2))
    by_index = {int(b["index"][i]): (b, i) for b in want2 for i in range(len(b["index"]))}
    for b in again:
        for i, idx in enumerate(b["index"].tolist()):
            w, j = by_index[idx]
            for k in CAMERAS:
                assert torch.equal(b[k][i], w[k][j]), (idx, k)
    assert want


# -- how far ahead the workers build ------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "workers", "want"), [
    ({}, 2, 1),                                      # workers collate: one batch ahead each
    ({"prefetch_factor": 3}, 2, 3),                  # the caller's value wins
    ({"prefetch_factor": 2}, 2, 2),
    ({"collate_fn": "caller"}, 2, 2),                # the caller collates: PyTorch's default
    ({}, 0, None),                                   # no workers: nothing to prefetch
])
def test_prefetch_factor_default_and_callers_value(lerobot_v3_root: Path, monkeypatch, kwargs, workers,
                                                   want) -> None:
    import torch.utils.data

    import loader.lerobot.streaming.loader as loader_module

    built = []

    class Recording(torch.utils.data.DataLoader):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            built.append(self)

    monkeypatch.setattr(loader_module, "DataLoader", Recording)
    if kwargs.get("collate_fn") == "caller":
        kwargs = {"collate_fn": torch.utils.data.default_collate}
    loader = make_loader(stream(lerobot_v3_root), batch_size=2, num_workers=workers, **kwargs)
    batches = list(loader)
    assert len(built) == 1 and built[0].prefetch_factor == want
    if loader._lender is not None:                   # slots: the batches ahead + 3
        assert loader._lender.flags.shape == (workers, want + 3)
    assert sorted(batch_indices(batches)) == sorted(MapStyleOracle(lerobot_v3_root).indices())
