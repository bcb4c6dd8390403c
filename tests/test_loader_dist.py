"""Twin-tar loading in real torch.distributed (gloo) process groups of 2 and 4 ranks.

Each world is one multi-process run that goes through several loader configurations; the
checks run here in the test process on what every rank saw. The data: 29 real photographs
(odd, so 2 and 4 ranks both need padding) in twin tars of at most 3 samples, 8 buckets.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from loader.wds.distributed import run_on_rank0_and_broadcast
from tests.support.dist import DistributedRunError, DistributedTimeout, run_distributed
from tests.support.loader_data import DROP_FOR_29, all_sids, shared_build

BATCH = 2
SHUFFLE = 3
WORKER_COUNTS = (0, 1, 2)


@pytest.fixture(scope="module")
def built29(tmp_path_factory, photo_drop_template) -> Path:
    return shared_build(tmp_path_factory, photo_drop_template, shard_size=3, drop=DROP_FOR_29)


# ----------------------------------------------------------------------------- rank functions


def _epoch_stream(loader) -> list[list[tuple[int, bool, int, str | None]]]:
    """One full pass: per batch, (sid, pad, epoch, bucket) of each sample."""
    out = []
    for batch in loader:
        out.append(list(zip(batch["__sid__"].tolist(), batch["__pad__"].tolist(), batch["__epoch__"].tolist(),
                            batch["__bucket__"], strict=True)))
    return out


def _rank_epochs(rank: int, world_size: int, root: str) -> dict:
    """Everything one rank sees across the configurations the checks need."""
    from loader.wds.pipeline import build_dataset, make_loader

    def ds(**kw):
        base = {"shuffle_buffer": SHUFFLE, "batch_size": BATCH, "decode": None, "seed": 7}
        return build_dataset(root, **{**base, **kw})

    res: dict = {"rank": rank}
    for nw in WORKER_COUNTS:
        loader = make_loader(ds(), num_workers=nw)
        res[("epochs", nw)] = [_epoch_stream(loader) for _ in range(2)]  # epochs 0 and 1
        res[("len", nw)] = len(make_loader(ds(), num_workers=nw))
    # Same seed again, from scratch: identical streams.
    res["repeat"] = _epoch_stream(make_loader(ds(), num_workers=2))
    # Infinite: 2.5 epochs' worth of batches from one uninterrupted iteration (each finished
    # epoch is the finite one: the shuffle window is part of the order, not of the workers).
    per_epoch_batches = len(res[("epochs", 2)][0])
    inf = iter(make_loader(ds(infinite=True), num_workers=2))
    res["infinite"] = [
        [(s, p, e) for s, p, e in zip(b["__sid__"].tolist(), b["__pad__"].tolist(), b["__epoch__"].tolist(), strict=True)]
        for b in (next(inf) for _ in range(per_epoch_batches * 5 // 2))
    ]
    del inf
    # Same-aspect batches: one bucket per batch, nothing lost.
    res["same_aspect"] = _epoch_stream(make_loader(ds(same_aspect_batches=True, batch_size=3), num_workers=2))
    if world_size == 4:
        import torch.distributed as dist

        # Tensor/context parallel: ranks {0,1} form data-parallel group 0, ranks {2,3} group 1.
        loader = make_loader(ds(parallel_sync=True, group_id=rank // 2, num_groups=2), num_workers=2)
        res["parallel_sync"] = [_epoch_stream(loader) for _ in range(2)]
        # The same split from the data-parallel process groups {0,2} and {1,3} (dp_group=).
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        loader = make_loader(ds(parallel_sync=True, dp_group=dp_groups[rank % 2]), num_workers=2)
        res["parallel_sync_dp_group"] = _epoch_stream(loader)
    return res


# ----------------------------------------------------------------------------- checks


def _samples(batches) -> list[tuple]:
    return [s for b in batches for s in b]


def _check_epoch_cover(per_rank: list[list[tuple]], everything: set[int], world: int, what: str) -> None:
    """Non-padding samples of all ranks are the dataset exactly once; pads are < world repeats."""
    real = Counter(s[0] for r in per_rank for s in r if not s[1])
    pads = [s[0] for r in per_rank for s in r if s[1]]
    assert set(real) == everything, f"{what}: missing {sorted(everything - set(real))[:5]}"
    assert max(real.values()) == 1, f"{what}: repeated {[k for k, v in real.items() if v > 1][:5]}"
    assert len(pads) == -len(everything) % world, f"{what}: {len(pads)} pads"
    assert len(pads) < world and set(pads) <= everything


@pytest.fixture(scope="module")
def world_runs(built29: Path):
    """``world_runs(n)``: what each of n ranks saw; each world runs once per module."""
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = run_distributed(_rank_epochs, world, args=(str(built29),), timeout=100)
        return cache[world]

    return get


@pytest.fixture(scope="module")
def everything(built29: Path) -> set[int]:
    from loader.wds.discovery import load_wdinfo

    sids = all_sids(load_wdinfo(str(built29)).tar_files.counts)
    assert len(sids) == 29
    return sids


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_and_workers_cover_each_epoch_once(world_runs, everything: set[int], world: int) -> None:
    ranks = world_runs(world)
    per_rank_expected = -(-29 // world)
    for nw in WORKER_COUNTS:
        for epoch in (0, 1):
            what = f"world={world} workers={nw} epoch={epoch}"
            streams = [r[("epochs", nw)][epoch] for r in ranks]
            samples = [_samples(s) for s in streams]
            _check_epoch_cover(samples, everything, world, what)
            assert all({s[2] for s in r} == {epoch} for r in samples), what
            assert [len(r) for r in samples] == [per_rank_expected] * world, what
            batch_counts = [len(s) for s in streams]
            assert len(set(batch_counts)) == 1, f"{what}: batch counts {batch_counts}"
            assert batch_counts[0] == ranks[0][("len", nw)], f"{what}: len() {ranks[0][('len', nw)]}"
            # Padding sits at the end of the sequence: only the last rank(s) carry it.
            assert not any(s[1] for s in samples[0]), what
        # Which samples a rank reads does not depend on the worker count (only their order).
        for r in ranks:
            for epoch in (0, 1):
                assert Counter(s[:2] for s in _samples(r[("epochs", nw)][epoch])) == Counter(
                    s[:2] for s in _samples(r[("epochs", 0)][epoch])
                )


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_streams_are_deterministic_and_change_per_epoch(world_runs, world: int) -> None:
    ranks = world_runs(world)
    for r in ranks:
        assert r["repeat"] == r[("epochs", 2)][0]  # same seed -> same batches, same order
        e0, e1 = ([s[0] for s in _samples(r[("epochs", 2)][e])] for e in (0, 1))
        assert e0 != e1  # a new epoch is a new order
    assert len({tuple(s[0] for s in _samples(r[("epochs", 2)][0])) for r in ranks}) == world


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_infinite_mode_advances_epochs(world_runs, world: int) -> None:
    for r in world_runs(world):
        inf = _samples(r["infinite"])
        epochs = [e for _, _, e in inf]
        assert epochs[0] == 0 and set(epochs) == {0, 1, 2}, Counter(epochs)
        # The same batches in the same order as two finite passes (workers rotate across the
        # epoch boundary, so the order does not restart).
        finite = [s[:3] for epoch in (0, 1) for s in _samples(r[("epochs", 2)][epoch])]
        assert inf[: len(finite)] == finite, f"rank {r['rank']}: infinite differs from finite epochs"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_same_aspect_batches_distributed(world_runs, everything: set[int], world: int) -> None:
    same = [r["same_aspect"] for r in world_runs(world)]
    for batches in same:
        assert all(len({s[3] for s in b}) == 1 for b in batches)
    _check_epoch_cover([_samples(b) for b in same], everything, world, "same-aspect")


@pytest.mark.timeout(150)
def test_parallel_sync_groups_share_streams(world_runs, everything: set[int]) -> None:
    ranks = world_runs(4)
    for epoch in (0, 1):
        streams = [r["parallel_sync"][epoch] for r in ranks]
        # Ranks of one tensor/context-parallel group read the same batches in the same order...
        assert streams[0] == streams[1] and streams[2] == streams[3]
        # ...the two groups are disjoint and together are the dataset (+ < 2 pads).
        group0, group1 = _samples(streams[0]), _samples(streams[2])
        assert not {s[0] for s in group0 if not s[1]} & {s[0] for s in group1 if not s[1]}
        _check_epoch_cover([group0, group1], everything, 2, f"parallel sync epoch {epoch}")
        assert len(group0) == len(group1) == 15
    assert ranks[0]["parallel_sync"][0] != ranks[0]["parallel_sync"][1]
    # Deriving the group from dp_group (the data-parallel process groups) gives the same split.
    assert [r["parallel_sync_dp_group"] for r in ranks] == [r["parallel_sync"][0] for r in ranks]


# ----------------------------------------------------------------------------- rank-0 failure


class _Unpicklable(Exception):
    def __init__(self, msg: str):
        super().__init__(msg)
        self.lock = __import__("threading").Lock()  # cannot be pickled


def _raise_unpicklable():
    raise _Unpicklable("rank 0 could not read the catalog")


def _mark_and_read(marker_dir: str, path: str):
    import os

    from loader.wds.discovery import parse_manifests

    Path(marker_dir, f"ran-on-pid-{os.getpid()}").touch()
    return parse_manifests([path])


def _rank_failures(rank: int, world_size: int, bad_json: str, not_wdinfo: str, missing: str, good: str,
                   markers: str) -> dict:
    from loader.wds.discovery import load_wdinfo

    out: dict = {}
    for name, fn in (
        ("bad_json", lambda: load_wdinfo(bad_json)),
        ("not_wdinfo", lambda: load_wdinfo(not_wdinfo)),
        ("missing", lambda: load_wdinfo(missing)),
        ("unpicklable", lambda: run_on_rank0_and_broadcast(_raise_unpicklable)),
    ):
        try:
            fn()
            out[name] = None
        except Exception as exc:
            out[name] = (type(exc).__name__, str(exc), type(exc.__cause__).__name__ if exc.__cause__ else None)
    # After all that, the group still works: a good manifest is read once and reaches everyone.
    table = run_on_rank0_and_broadcast(lambda: _mark_and_read(markers, good)).tar_files
    out["good"] = (table.fingerprint(), len(table))
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 4])
def test_rank0_failure_reaches_every_rank(built29: Path, tmp_path: Path, world: int) -> None:
    bad_json = tmp_path / "bad" / "wdinfo.json"
    bad_json.parent.mkdir()
    bad_json.write_text('{"data_keys": ["image"], "data_list": [')
    not_wdinfo = tmp_path / "other" / "wdinfo.json"
    not_wdinfo.parent.mkdir()
    not_wdinfo.write_text('{"hello": 1}')
    markers = tmp_path / "markers"
    markers.mkdir()
    good = built29 / "photos" / "aspect_ratio_1_1" / "wdinfo.json"
    ranks = run_distributed(
        _rank_failures, world, timeout=60,
        args=(str(bad_json), str(not_wdinfo), str(tmp_path / "nowhere"), str(good), str(markers)),
    )
    for case in ("bad_json", "not_wdinfo", "missing"):
        seen = [r[case] for r in ranks]
        assert all(s is not None for s in seen), f"{case}: some rank did not raise"
        # Every rank raises rank 0's error: same type, same message...
        assert {(t, m) for t, m, _ in seen} == {("ManifestError", seen[0][1])}, f"{case}: {seen}"
        # ...which the others received from rank 0 (they did not read the manifest themselves).
        assert all(s[2] == "Rank0Error" for s in seen[1:]), seen
    assert str(bad_json) in ranks[0]["bad_json"][1] and "not valid JSON" in ranks[0]["bad_json"][1]
    assert str(not_wdinfo) in ranks[0]["not_wdinfo"][1]
    assert "nowhere" in ranks[-1]["missing"][1]
    # An error that cannot be pickled still reaches everyone, as Rank0Error with its text.
    assert ranks[0]["unpicklable"][:2] == ("_Unpicklable", "rank 0 could not read the catalog")
    for r in ranks[1:]:
        assert r["unpicklable"][:2] == ("Rank0Error", "_Unpicklable: rank 0 could not read the catalog")
    # The group survives all that: a good manifest, parsed once (on rank 0), reaches every rank.
    assert len({r["good"] for r in ranks}) == 1 and ranks[0]["good"][1] > 0
    assert len(list(markers.iterdir())) == 1


def test_rank0_helpers_without_process_group() -> None:
    # No process group: the function simply runs here and its error surfaces unchanged.
    assert run_on_rank0_and_broadcast(lambda: 41 + 1) == 42
    with pytest.raises(_Unpicklable):
        run_on_rank0_and_broadcast(_raise_unpicklable)


# ----------------------------------------------------------------------------- the helper itself


def _rank_hangs_or_fails(rank: int, world_size: int, how: str) -> int:
    import time

    if rank == 1 and how == "hang":
        time.sleep(120)
    if rank == 1 and how == "fail":
        raise ValueError("rank 1 broke")
    return rank


@pytest.mark.timeout(60)
def test_a_hung_or_failing_rank_fails_fast_with_its_stack() -> None:
    assert run_distributed(_rank_hangs_or_fails, 2, args=("ok",), timeout=30) == [0, 1]
    with pytest.raises(DistributedRunError, match=r"ranks \[1\] failed(.|\n)*ValueError: rank 1 broke"):
        run_distributed(_rank_hangs_or_fails, 2, args=("fail",), timeout=30)
    # The stack dump fires 3 s before the kill; on a loaded 2-core runner a rank can start late
    # enough to miss it, so only the kill itself and the dump section are required.
    with pytest.raises(DistributedTimeout, match=r"ranks \[1\] still running after 6s(.|\n)*stacks before the kill"):
        run_distributed(_rank_hangs_or_fails, 2, args=("hang",), timeout=6)
