"""One order per epoch, whatever the world size and worker count, and resumes that continue it.

Real gloo process groups of 1, 2 and 3 ranks read 29 photographs in twin tars of at most 3
(8 aspect buckets) with 0, 1 and 2 DataLoader workers. Each rank's batches, taken in *slice
order* (step by step, rank by rank), concatenate to the same sequence in every configuration;
a state saved after k batches (odd and even k) and restored with the same or other settings
goes on with exactly the rest of that sequence; every batch but a rank's last has B samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.dist import run_distributed, slice_order
from tests.support.loader_data import DROP_FOR_29, shared_build

B = 3
WINDOW = 5  # shuffle_buffer: a shuffle window over the order, part of the order itself
SEED = 17


@pytest.fixture(scope="module")
def built29(tmp_path_factory, photo_drop_template) -> Path:
    return shared_build(tmp_path_factory, photo_drop_template, shard_size=3, drop=DROP_FOR_29)


def _rank_steps(rank: int, world_size: int, root: str, steps: list[dict]) -> list[dict]:
    """Each step in a fresh loader: restore a state if given, read ``stop`` batches (or the whole
    epoch), save the state after a stop. Per batch: [(sid, pad, bucket), ...]."""
    from loader.wds.pipeline import build_dataset, make_loader

    out = []
    for step in steps:
        ds = build_dataset(root, batch_size=step.get("batch", B), shuffle_buffer=WINDOW, decode=None, seed=SEED,
                           same_aspect_batches=step.get("aspect", False))
        loader = make_loader(ds, num_workers=step["workers"])
        if step.get("state"):
            loader.load_state_dict(step["state"])
        batches = []
        for batch in loader:
            batches.append(list(zip(batch["__sid__"].tolist(), batch["__pad__"].tolist(), batch["__bucket__"],
                                    strict=True)))
            if len(batches) == step.get("stop"):
                break
        res = {"batches": batches, "len": None}
        if step.get("stop"):
            res["state"] = json.loads(json.dumps(loader.state_dict()))
        out.append(res)
    return out


def _real(samples: list[tuple]) -> list[int]:
    return [s[0] for s in samples if not s[1]]


def _check_batches(per_rank: list[list[list[tuple]]], world: int, what: str, aspect: bool = False) -> None:
    for r, batches in enumerate(per_rank):
        sizes = [len(b) for b in batches]
        if not aspect:
            assert sizes[:-1] == [B] * (len(sizes) - 1) and 0 < sizes[-1] <= B, f"{what} rank {r}: sizes {sizes}"
        for b in batches:
            assert len({s[2] for s in b}) == 1 or not aspect, f"{what}: a batch mixes buckets"
    pads = [s for batches in per_rank for b in batches for s in b if s[1]]
    assert len(pads) < world, f"{what}: {len(pads)} pads"


STEPS = [
    {"workers": 0}, {"workers": 1}, {"workers": 2},
    {"workers": 0, "aspect": True}, {"workers": 2, "aspect": True},
]


@pytest.mark.timeout(300)
def test_one_global_order_for_any_ranks_and_workers_and_resumes_continue_it(built29: Path) -> None:
    root = str(built29)
    stops2 = [{"workers": 2, "stop": 3}, {"workers": 2, "stop": 4}, {"workers": 0, "stop": 1, "aspect": True}]
    two = run_distributed(_rank_steps, 2, timeout=120, args=(root, STEPS + stops2))
    s_odd, s_even, s_aspect = (two[0][len(STEPS) + i]["state"] for i in range(3))
    assert all(r[len(STEPS)]["state"] == s_odd for r in two)  # every rank got the same merged state
    three = run_distributed(_rank_steps, 3, timeout=120, args=(root, STEPS + [
        {"workers": 0, "stop": 2},
        {"workers": 0, "state": s_odd}, {"workers": 2, "state": s_even}, {"workers": 1, "state": s_aspect, "aspect": True},
    ]))
    s_three = three[0][len(STEPS)]["state"]
    one = run_distributed(_rank_steps, 1, timeout=120, args=(root, STEPS + [
        {"workers": 2, "state": s_odd}, {"workers": 0, "state": s_three},
        # Without same-aspect batches the order does not depend on the batch size either.
        {"workers": 2, "state": s_even, "batch": 4},
    ]))
    again = run_distributed(_rank_steps, 2, timeout=120, args=(root, [
        {"workers": 2, "state": s_odd}, {"workers": 2, "state": s_even}, {"workers": 0, "state": s_three},
        {"workers": 2, "state": s_aspect, "aspect": True},
    ]))
    worlds = {1: one, 2: two, 3: three}

    def step(world: int, i: int, runs=None) -> list[list[list[tuple]]]:
        return [r[i]["batches"] for r in (runs or worlds[world])]

    # One order: the same sequence for every world size and worker count.
    reference = _real(slice_order(step(1, 0)))
    aspect_ref = _real(slice_order(step(1, 3)))
    assert sorted(reference) == sorted(aspect_ref) and len(set(reference)) == 29
    assert reference != sorted(reference)  # shuffled
    for world in (1, 2, 3):
        for i, cfg in enumerate(STEPS):
            what = f"{world} ranks, {cfg}"
            per_rank = step(world, i)
            assert _real(slice_order(per_rank)) == (aspect_ref if cfg.get("aspect") else reference), what
            _check_batches(per_rank, world, what, cfg.get("aspect", False))

    # Resumes: what was read before the stop is the start of the order, the rest follows it.
    def resumed(saved_world: int, saved_step: int, runs, i: int, world: int, ref: list[int], what: str) -> None:
        before = _real(slice_order(step(saved_world, saved_step)))
        after_batches = step(world, i, runs)
        after = _real(slice_order(after_batches))
        assert before + after == ref, f"{what}: the order does not go on"
        _check_batches(after_batches, world, what, ref is aspect_ref)

    n = len(STEPS)
    resumed(2, n, three, n + 1, 3, reference, "2 ranks after 3 batches -> 3 ranks x 0 workers")
    resumed(2, n + 1, three, n + 2, 3, reference, "2 ranks after 4 batches -> 3 ranks x 2 workers")
    resumed(2, n + 2, three, n + 3, 3, aspect_ref, "same-aspect, 2 ranks after 1 batch -> 3 ranks")
    resumed(2, n, one, n, 1, reference, "2 ranks after 3 batches -> 1 rank x 2 workers")
    resumed(3, n, one, n + 1, 1, reference, "3 ranks after 2 batches -> 1 rank x 0 workers")
    resumed(2, n, again, 0, 2, reference, "2 ranks after 3 batches -> the same settings")
    resumed(2, n + 1, again, 1, 2, reference, "2 ranks after 4 batches -> the same settings")
    resumed(3, n, again, 2, 2, reference, "3 ranks after 2 batches -> 2 ranks x 0 workers")
    resumed(2, n + 2, again, 3, 2, aspect_ref, "same-aspect, 2 ranks -> the same settings")
    # Batch size 4 after a stop at batch size 3: the order goes on, in batches of 4.
    before = _real(slice_order(step(2, n + 1)))
    after = one[0][n + 2]["batches"]
    assert before + _real([s for b in after for s in b]) == reference
    assert [len(b) for b in after][:-1] == [4] * (len(after) - 1)
    # With the same settings the batches themselves are those of the uninterrupted run.
    for r in range(2):
        assert two[r][n]["batches"] + again[r][0]["batches"] == two[r][2]["batches"]
        assert two[r][n + 1]["batches"] + again[r][1]["batches"] == two[r][2]["batches"]


def test_a_billion_sample_epoch_plans_without_a_table_per_batch() -> None:
    """Without same-aspect batches a plan computes its batches: 10^9 samples in 10^6 shards,
    batches of 64 for 8 ranks, plan in a few MB (a table would be 250 MB), and the batches it
    deals are the same as a small table-free reference says."""
    import tracemalloc

    import numpy as np

    from loader.wds.epoch_plan import EpochOrder, EpochPlan, Layout

    counts = np.full(1_000_000, 1000, np.int64)
    counts[-1] = 1001  # a short last batch: 10^9 + 1 samples
    tracemalloc.start()
    order = EpochOrder(counts, None, seed=3, epoch=1, shuffle=True, layout=Layout(block=64))
    plan = EpochPlan(order, [(0, 640)], 8)  # the first 10 batches consumed before
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 2**20, peak  # the per-shard arrays (8 MB each), nothing per batch
    R = 10**9 + 1 - 640
    T = -(-R // 64)
    assert plan.batches_per_rank == -(-T // 8)
    assert plan.batch(3, 0).start == 3 * 64 and plan.batch(3, 0).stop == 4 * 64
    total = sum(plan.rank_samples(r) for r in range(8))
    assert R <= total < R + 8  # at most ranks - 1 padding repeats
    assert plan.consumed_after({r: (2, 0) for r in range(8)}) == [(0, 640 + 2 * 8 * 64)]
