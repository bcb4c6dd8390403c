"""Exact, elastic resume: stop after k batches, save ``state_dict()``, restore into a fresh
loader (same or another world size / worker count), finish the epoch: every sample of the epoch
is handed to the training loop exactly once (padding repeats aside), in the epoch's one order.

Also PiD compatibility: ``WDS_START_INDEX`` / ``WDS_EPOCH_NUM`` and PiD-written manifests.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from loader.wds.consumed import split_sid
from loader.wds.discovery import load_wdinfo
from loader.wds.errors import MissingKeyError, ResumeStateError
from loader.wds.pipeline import build_dataset, make_loader
from loader.wds.shardlists import EPOCH_ENV, START_INDEX_ENV
from tests.support.dist import run_distributed
from tests.support.loader_data import DROP_FOR_29, all_sids, pid_style_manifest, shared_build

DIST_BATCH = 2
DIST_SHUFFLE = 4


@pytest.fixture(scope="module")
def built29(tmp_path_factory, photo_drop_template) -> Path:
    return shared_build(tmp_path_factory, photo_drop_template, shard_size=3, drop=DROP_FOR_29)


@pytest.fixture(scope="module")
def built32_uniform(tmp_path_factory, photo_drop_template) -> Path:
    """32 samples in 8 twin tars of exactly 4 (one per bucket): PiD's uniform chunk_size."""
    return shared_build(tmp_path_factory, photo_drop_template, shard_size=4)


def _sids(batches, *, pads: bool = False) -> list[int]:
    return [s for b in batches for s, p in zip(b["__sid__"].tolist(), b["__pad__"].tolist(), strict=True) if p == pads]


def _take(loader, k: int | None) -> list[dict]:
    """The first k batches (all if None), leaving the loader mid-epoch when k is given."""
    out: list[dict] = []
    if k == 0:
        return out
    it = iter(loader)
    for batch in it:
        out.append(batch)
        if k is not None and len(out) == k:
            break
    return out


def _assert_exactly_once(parts: list[list[int]], everything: set[int], what: str) -> None:
    seen = Counter(s for p in parts for s in p)
    assert set(seen) == everything, f"{what}: missing {sorted(everything - set(seen))[:5]}"
    assert max(seen.values()) == 1, f"{what}: repeated {[split_sid(s) for s, c in seen.items() if c > 1][:5]}"


# ----------------------------------------------------------------------------- in-process


def _dataset(root: Path, **kw):
    base = {"batch_size": 3, "shuffle_buffer": 5, "decode": None, "seed": 11}
    return build_dataset(str(root), **{**base, **kw})


@pytest.mark.timeout(120)
def test_resume_every_k_in_process(built29: Path) -> None:
    everything = all_sids(load_wdinfo(str(built29)).tar_files.counts)
    n_batches = len(make_loader(_dataset(built29)))
    assert n_batches == 10
    uninterrupted = _sids(_take(make_loader(_dataset(built29)), None))
    for k in range(n_batches):
        loader = make_loader(_dataset(built29))
        before = _take(loader, k)
        state = json.loads(json.dumps(loader.state_dict()))  # a plain JSON value
        assert (state["epoch"], state["position"], state["ahead"]) == (0, 3 * k, {})
        assert len(_sids(before)) == 3 * k
        restored = make_loader(_dataset(built29))
        restored.load_state_dict(state)
        after = _take(restored, None)
        _assert_exactly_once([_sids(before), _sids(after)], everything, f"k={k}")
        assert _sids(before) + _sids(after) == uninterrupted, f"k={k}: the order changed"
        assert len(after) == -(-(29 - 3 * k) // 3)
        # The resumed loader goes on with a complete, fresh epoch 1.
        nxt = _take(restored, None)
        assert {e for b in nxt for e in b["__epoch__"].tolist()} == {1}
        _assert_exactly_once([_sids(nxt)], everything, f"k={k} next epoch")
    # A state saved right after the epoch's last batch starts the next epoch.
    loader = make_loader(_dataset(built29))
    _take(loader, n_batches)
    state = loader.state_dict()
    assert (state["epoch"], state["position"], state["ahead"]) == (1, 0, {})
    restored = make_loader(_dataset(built29))
    restored.load_state_dict(state)
    nxt = _take(restored, None)
    assert {e for b in nxt for e in b["__epoch__"].tolist()} == {1}
    _assert_exactly_once([_sids(nxt)], everything, "after the last batch")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workers_before", "workers_after", "k"), [(2, 0, 2), (2, 1, 5), (2, 2, 8), (1, 2, 4)])
def test_resume_with_workers_in_process(built29: Path, workers_before: int, workers_after: int, k: int) -> None:
    """Batches prefetched by workers and samples waiting in shuffle buffers are not consumed."""
    everything = all_sids(load_wdinfo(str(built29)).tar_files.counts)
    uninterrupted = _sids(_take(make_loader(_dataset(built29)), None))
    loader = make_loader(_dataset(built29), num_workers=workers_before, prefetch_factor=4)
    before = _take(loader, k)
    state = loader.state_dict()
    assert state["position"] == len(_sids(before)) == 3 * k
    # Another batch size and worker count: the same order goes on (batches of 4 now).
    restored = make_loader(_dataset(built29, batch_size=4), num_workers=workers_after)
    restored.load_state_dict(state)
    after = _take(restored, None)
    _assert_exactly_once([_sids(before), _sids(after)], everything, f"{workers_before}->{workers_after} k={k}")
    assert _sids(before) + _sids(after) == uninterrupted
    assert [len(b["__sid__"]) for b in after][:-1] == [4] * (len(after) - 1)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_len_is_the_same_for_any_worker_count_and_counts_what_is_left(built29: Path) -> None:
    # 29 samples in batches of 4: 7 full batches and one of 1, whatever the worker count.
    for workers in (0, 3):
        loader = make_loader(_dataset(built29, batch_size=4), num_workers=workers)
        batches = _take(loader, None)
        assert len(loader) == 8 == len(batches)  # (read before the pass ended: len is per epoch)
        assert [len(b["__sid__"]) for b in batches] == [4] * 7 + [1]
    loader = make_loader(_dataset(built29, batch_size=4))
    _take(loader, 3)
    restored = make_loader(_dataset(built29, batch_size=4), num_workers=2)
    restored.load_state_dict(loader.state_dict())
    assert len(restored) == len(_take(restored, None)) == 5  # 17 samples left


def test_padding_repeats_are_not_marked_consumed(built29: Path) -> None:
    # Data-parallel group 1 of 2 reads 15 samples, one of them a repeat of a sample that belongs
    # to group 0. That repeat must not count as consumed: group 0 may not have read it yet.
    loader = make_loader(_dataset(built29, parallel_sync=True, group_id=1, num_groups=2, batch_size=5))
    batches = _take(loader, 3)
    assert len(_sids(batches)) == 14 and len(_sids(batches, pads=True)) == 1
    state = loader.state_dict()
    assert state["position"] == 0 and sum(b - a for a, b in state["ahead"]["0"]) == 14
    group0 = make_loader(_dataset(built29, parallel_sync=True, group_id=0, num_groups=2, batch_size=5))
    group0.load_state_dict(state)
    # What is left is exactly the 15 samples of group 0, split over the 2 groups again.
    left = _sids(_take(group0, None))
    assert len(left) == 8 and not set(left) & set(_sids(batches))


@pytest.mark.timeout(60)
def test_resume_in_infinite_mode(built29: Path) -> None:
    everything = all_sids(load_wdinfo(str(built29)).tar_files.counts)
    loader = make_loader(_dataset(built29, infinite=True))
    before = _take(loader, 15)  # 45 samples: epoch 0 done (up to the shuffle buffer), epoch 1 begun
    state = loader.state_dict()
    restored = make_loader(_dataset(built29, infinite=True))
    restored.load_state_dict(state)
    after = _take(restored, 25)  # 75 more samples: the rest of epochs 0 and 1, all of 2, some of 3
    for epoch in (0, 1, 2):
        parts = [[s for b in part for s, e in zip(b["__sid__"].tolist(), b["__epoch__"].tolist(), strict=True)
                  if e == epoch] for part in (before, after)]
        _assert_exactly_once(parts, everything, f"infinite epoch {epoch}")


def test_resume_state_must_match(built29: Path) -> None:
    state = make_loader(_dataset(built29)).state_dict()
    with pytest.raises(ResumeStateError, match="another shard list"):
        make_loader(_dataset(built29, modalities=["image"])).load_state_dict(state)
    with pytest.raises(ResumeStateError, match="seed=11"):
        make_loader(_dataset(built29, seed=12)).load_state_dict(state)
    with pytest.raises(ResumeStateError, match="version"):
        make_loader(_dataset(built29)).load_state_dict({**state, "version": 99})
    with pytest.raises(ResumeStateError, match="'position'"):
        make_loader(_dataset(built29)).load_state_dict({**state, "position": 30})
    with pytest.raises(ResumeStateError, match="'ahead'"):
        make_loader(_dataset(built29)).load_state_dict({**state, "ahead": {"0": [[5, 2]]}})
    with pytest.raises(ResumeStateError, match="order.shuffle_buffer"):
        make_loader(_dataset(built29, shuffle_buffer=2)).load_state_dict(state)
    aspect = make_loader(_dataset(built29, same_aspect_batches=True)).state_dict()
    with pytest.raises(ResumeStateError, match="order.batch_size"):
        make_loader(_dataset(built29, same_aspect_batches=True, batch_size=4)).load_state_dict(aspect)


def test_resume_state_is_a_few_numbers(built29: Path) -> None:
    """In lockstep (every rank at the same step, as DDP keeps them) the state is the epoch and
    one position in its order, whatever the number of shards."""
    loader = make_loader(_dataset(built29))
    _take(loader, 4)
    state = loader.state_dict()
    assert (state["epoch"], state["position"], state["ahead"]) == (0, 12, {})
    assert len(json.dumps(state)) < 400


# ----------------------------------------------------------------------------- distributed


def _rank_resume(rank: int, world_size: int, root: str, steps: list[dict]) -> list[dict]:
    """Run each step in a fresh loader: optionally restore a state, read k batches (or to the
    end of the epoch), then save the state (collective) or read the next epoch."""
    results = []
    for step in steps:
        ds = build_dataset(root, batch_size=DIST_BATCH, shuffle_buffer=DIST_SHUFFLE, decode=None, seed=3)
        loader = make_loader(ds, num_workers=step["workers"])
        if step.get("state"):
            loader.load_state_dict(step["state"])
        batches = _take(loader, step.get("stop"))
        out = {"sids": _sids(batches), "pads": _sids(batches, pads=True), "batches": len(batches)}
        if step.get("stop"):
            out["state"] = loader.state_dict()
        if step.get("next_epoch"):
            nxt = _take(loader, None)
            out["next"] = (_sids(nxt), {e for b in nxt for e in b["__epoch__"].tolist()})
        results.append(out)
    return results


def _check_pair(saved: list[dict], resumed: list[dict], everything: set[int], what: str) -> None:
    """``saved``/``resumed``: one step's result per rank."""
    states = [r["state"] for r in saved]
    assert all(s == states[0] for s in states), f"{what}: ranks got different merged states"
    before = [s for r in saved for s in r["sids"]]
    ahead = sum(b - a for ivs in states[0]["ahead"].values() for a, b in ivs)
    assert states[0]["position"] + ahead == len(before), f"{what}: prefetched samples counted"
    _assert_exactly_once([before, [s for r in resumed for s in r["sids"]]], everything, what)
    assert len({r["batches"] for r in resumed}) == 1, f"{what}: ranks have different batch counts"
    assert sum(len(r["pads"]) for r in resumed) < len(resumed)
    for r in resumed:
        if "next" in r:
            assert r["next"][1] == {1}
    if "next" in resumed[0]:
        _assert_exactly_once([r["next"][0] for r in resumed], everything, f"{what}, next epoch")


@pytest.mark.timeout(150)
def test_resume_across_world_sizes_and_workers(built29: Path) -> None:
    everything = all_sids(load_wdinfo(str(built29)).tar_files.counts)
    root = str(built29)
    # World of 2 ranks (8 batches each): save after 3 and after 7 batches; restore into 2 ranks
    # with the same and with other worker counts.
    a = run_distributed(_rank_resume, 2, timeout=100, args=(root, [
        {"workers": 2, "stop": 3},
        {"workers": 2, "stop": 7},
    ]))
    s_early, s_late = (json.loads(json.dumps(a[0][i]["state"])) for i in (0, 1))
    a2 = run_distributed(_rank_resume, 2, timeout=100, args=(root, [
        {"workers": 2, "state": s_early, "next_epoch": True},
        {"workers": 0, "state": s_early},
        {"workers": 1, "state": s_late},
    ]))
    _check_pair([r[0] for r in a], [r[0] for r in a2], everything, "2x2 workers -> 2x2 workers")
    _check_pair([r[0] for r in a], [r[1] for r in a2], everything, "2x2 workers -> 2x0 workers")
    _check_pair([r[1] for r in a], [r[2] for r in a2], everything, "2x2 workers (late) -> 2x1 workers")
    # 2 -> 4 ranks, and a 4-rank state (after 2 of 4 batches) for 4 -> 2.
    b = run_distributed(_rank_resume, 4, timeout=100, args=(root, [
        {"workers": 2, "state": s_early, "next_epoch": True},
        {"workers": 0, "state": s_late},
        {"workers": 2, "stop": 2},
    ]))
    _check_pair([r[0] for r in a], [r[0] for r in b], everything, "2 ranks -> 4 ranks")
    _check_pair([r[1] for r in a], [r[1] for r in b], everything, "2 ranks (late) -> 4 ranks")
    s_four = json.loads(json.dumps(b[0][2]["state"]))
    c = run_distributed(_rank_resume, 2, timeout=100, args=(root, [
        {"workers": 0, "state": s_four},
        {"workers": 2, "state": s_four, "next_epoch": True},
    ]))
    _check_pair([r[2] for r in b], [r[0] for r in c], everything, "4 ranks -> 2 ranks x0 workers")
    _check_pair([r[2] for r in b], [r[1] for r in c], everything, "4 ranks -> 2 ranks x2 workers")


# ----------------------------------------------------------------------------- PiD compatibility


def test_pid_start_index_continues_exactly(built32_uniform: Path, monkeypatch) -> None:
    """PiD's restart variables: WDS_START_INDEX samples read by this rank in epoch WDS_EPOCH_NUM.
    PiD turns them into whole shards to skip per worker (approximate); here they are a place in
    this rank's plan, so a restart with the same world size and batch size goes on exactly."""
    root = str(built32_uniform)
    everything = all_sids(load_wdinfo(root).tar_files.counts)
    assert load_wdinfo(root).chunk_size == 4
    ds = lambda: build_dataset(root, batch_size=4, decode=None)  # noqa: E731
    uninterrupted = _sids(_take(make_loader(ds(), num_workers=2), None))
    loader = make_loader(ds(), num_workers=2)
    before = _take(loader, 4)  # 16 samples
    state = loader.state_dict()
    assert (state[START_INDEX_ENV], state[EPOCH_ENV]) == (16, 0)

    monkeypatch.setenv(START_INDEX_ENV, str(state[START_INDEX_ENV]))
    monkeypatch.setenv(EPOCH_ENV, str(state[EPOCH_ENV]))
    loader = make_loader(ds(), num_workers=2)
    assert len(loader) == 4
    after = _take(loader, None)
    _assert_exactly_once([_sids(before), _sids(after)], everything, "PiD restart")
    assert _sids(before) + _sids(after) == uninterrupted
    # The epoch after the restart is complete again.
    nxt = _take(loader, None)
    _assert_exactly_once([_sids(nxt)], everything, "epoch after the PiD restart")
    assert {e for b in nxt for e in b["__epoch__"].tolist()} == {1}
    # PiD's per-rank counter goes on from the start index: a second restart skips both parts.
    again = make_loader(ds(), num_workers=2)
    _take(again, 1)
    assert again.state_dict()[START_INDEX_ENV] == 16 + 4

    # WDS_EPOCH_NUM alone picks the epoch (its order) and skips nothing.
    monkeypatch.setenv(START_INDEX_ENV, "0")
    monkeypatch.setenv(EPOCH_ENV, "3")
    epoch3 = _take(make_loader(ds(), num_workers=0), None)
    assert {e for b in epoch3 for e in b["__epoch__"].tolist()} == {3}
    _assert_exactly_once([_sids(epoch3)], everything, "epoch 3")


def test_state_dict_writes_pid_variables_mid_epoch(built32_uniform: Path) -> None:
    loader = make_loader(build_dataset(str(built32_uniform), batch_size=4, decode=None))
    _take(loader, None)
    _take(loader, 3)
    state = loader.state_dict()
    assert (state[START_INDEX_ENV], state[EPOCH_ENV]) == (12, 1)


def test_reads_pid_written_manifests(built29: Path, tmp_path: Path) -> None:
    built = sorted((built29 / "photos").glob("aspect_ratio_*/wdinfo.json"))
    pid = [pid_style_manifest(m, tmp_path / "pid" / m.parent.name) for m in built]
    assert "chunk_size" not in json.loads(pid[0].read_text())
    ours = load_wdinfo([str(m) for m in built])
    theirs = load_wdinfo(str(tmp_path / "pid"))
    # The same shard list; ours also lists each tar's checksum, which its fingerprint covers
    # (a rebuild that changed a tar's content is another list), PiD's lists none.
    assert [t.path for t in theirs.tar_files] == [t.path for t in ours.tar_files]
    assert theirs.tar_files.counts.tolist() == ours.tar_files.counts.tolist()
    assert theirs.tar_files.checksums_digest == "" != ours.tar_files.checksums_digest
    assert theirs.chunk_size == ours.chunk_size == 3  # derived: the largest tar
    assert theirs.tar_files[0].bucket == ours.tar_files[0].bucket == "aspect_ratio_16_9"

    def read(spec, **kw):
        batches = _take(make_loader(build_dataset(spec, batch_size=4, decode="bytes", shuffle_buffer=3, **kw)), None)
        return {k: (img, cap) for b in batches for k, img, cap in zip(b["__key__"], b["image"], b["caption"], strict=True)}

    assert read(str(tmp_path / "pid")) == read([str(m) for m in built])
    # Resume that cuts inside a shard: without a key index the reader skips members by reading.
    loader = make_loader(build_dataset(str(tmp_path / "pid"), batch_size=1, decode=None))
    before = _take(loader, 4)
    restored = make_loader(build_dataset(str(tmp_path / "pid"), batch_size=5, decode=None))
    restored.load_state_dict(loader.state_dict())
    after = _take(restored, None)
    everything = all_sids(theirs.tar_files.counts)
    _assert_exactly_once([_sids(before), _sids(after)], everything, "PiD manifest resume")
    with pytest.raises(MissingKeyError, match="needs a key index"):
        _take(make_loader(build_dataset(str(tmp_path / "pid"), mode="index", decode=None)), None)


def test_set_epoch_on_the_loader_or_on_its_shard_list(built29: Path) -> None:
    everything = all_sids(load_wdinfo(str(built29)).tar_files.counts)
    loader = make_loader(_dataset(built29))
    loader.set_epoch(2)
    epoch2 = _take(loader, None)
    assert {e for b in epoch2 for e in b["__epoch__"].tolist()} == {2} and loader.epoch == 3
    _assert_exactly_once([_sids(epoch2)], everything, "epoch 2")
    # dataset.shardlist.set_epoch(n) after make_loader is not ignored: the next pass is epoch n.
    ds = _dataset(built29)
    other = make_loader(ds, num_workers=2)
    ds.shardlist.set_epoch(2)
    assert _sids(_take(other, None)) == _sids(epoch2) and other.epoch == 3
    # Mid-epoch, set_epoch starts that epoch afresh.
    _take(loader, 2)
    loader.set_epoch(2)
    assert _sids(_take(loader, None)) == _sids(epoch2)
