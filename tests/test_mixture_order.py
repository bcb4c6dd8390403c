"""A weighted mixture's epoch is one order, whatever the world size and worker count, and
resumes continue it.

Three sources built by the real build side (``photos`` 32 samples, ``web`` 20, ``hq`` 8; tars
of at most 3) in one output root; the catalog defines ``weighted`` (0.6 / 0.3 / 0.1 of 40
samples) and ``counted`` (``choose: 12``, ``repeat: 0.5``, ``repeat: 2``). Real gloo process
groups of 1, 2 and 3 ranks read them with 0 and 2 DataLoader workers.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from loader.mixture import Mixture
from tests.support.dist import run_distributed, slice_order
from tests.support.loader_data import COUNTED, WEIGHTED, mixture_build

B = 3
SEED = 5
PER_EPOCH = {"weighted": {"photos": 24, "web": 12, "hq": 4}, "counted": {"photos": 12, "web": 10, "hq": 16}}


@pytest.fixture(scope="module")
def mixroot(tmp_path_factory, photo_drop_template) -> Path:
    return mixture_build(tmp_path_factory, photo_drop_template)


def _rank_steps(rank: int, world_size: int, root: str, steps: list[dict]) -> list[dict]:
    """Each step in a fresh loader: restore a state if given, read ``stop`` batches (or
    ``epochs`` whole epochs), save the state after a stop. Per batch: [(sid, pad, repeat,
    source, epoch), ...]."""
    from loader.wds.pipeline import build_dataset, make_loader

    out = []
    for step in steps:
        ds = build_dataset(step["data"], catalog=root, batch_size=B, decode=None, seed=SEED)
        loader = make_loader(ds, num_workers=step["workers"])
        if step.get("state"):
            loader.load_state_dict(step["state"])
        batches: list[list[tuple]] = []
        for _ in range(step.get("epochs", 1)):
            for batch in loader:
                batches.append(list(zip(batch["__sid__"].tolist(), batch["__pad__"].tolist(),
                                        batch["__repeat__"].tolist(), batch["__source__"],
                                        batch["__epoch__"].tolist(), strict=True)))
                if len(batches) == step.get("stop"):
                    break
        res: dict = {"batches": batches, "stats": loader.stats["samples_per_source"]}
        if step.get("stop"):
            res["state"] = json.loads(json.dumps(loader.state_dict()))
        out.append(res)
    return out


def _real(samples: list[tuple]) -> list[tuple]:
    return [(sid, rep, src, ep) for sid, pad, rep, src, ep in samples if not pad]


def _within_one_of_shares(order: list[tuple], per_epoch: dict[str, int], what: str) -> None:
    n = sum(per_epoch.values())
    assert len(order) == n, f"{what}: {len(order)} samples, not {n}"
    seen: Counter = Counter()
    for t, s in enumerate(order, 1):
        seen[s[2]] += 1
        for name, c in per_epoch.items():
            assert abs(seen[name] - t * c / n) < 1, f"{what}: after {t} samples {name} has {seen[name]}, share {t * c / n}"


STEPS = [{"data": "weighted", "workers": 0}, {"data": "weighted", "workers": 2},
         {"data": "counted", "workers": 0}, {"data": "counted", "workers": 2}]


@pytest.mark.timeout(400)
def test_one_mixture_order_for_any_ranks_and_workers_and_resumes_continue_it(mixroot: Path) -> None:
    root = str(mixroot)
    n = len(STEPS)
    two = run_distributed(_rank_steps, 2, timeout=180, args=(root, STEPS + [
        {"data": "weighted", "workers": 2, "stop": 3}, {"data": "counted", "workers": 2, "stop": 2},
    ]))
    w_state, c_state = two[0][n]["state"], two[0][n + 1]["state"]
    assert all(r[n]["state"] == w_state for r in two)  # one merged state on every rank
    assert w_state["position"] == 3 * B * 2 and set(w_state["mixture"]) >= {"sources", "samples_per_epoch"}
    three = run_distributed(_rank_steps, 3, timeout=180, args=(root, STEPS + [
        {"data": "weighted", "workers": 0, "state": w_state}, {"data": "counted", "workers": 2, "state": c_state},
        {"data": "weighted", "workers": 2, "stop": 1},
    ]))
    w3_state = three[0][n + 2]["state"]
    one = run_distributed(_rank_steps, 1, timeout=180, args=(root, STEPS + [
        {"data": "weighted", "workers": 2, "state": w3_state}, {"data": "counted", "workers": 0, "state": c_state},
        {"data": Mixture.from_json("weighted", WEIGHTED), "workers": 0},  # the same definition in Python
        {"data": "counted", "workers": 2, "epochs": 2},
    ]))
    worlds = {1: one, 2: two, 3: three}

    def order(runs, i: int) -> list[tuple]:
        return _real(slice_order([r[i]["batches"] for r in runs]))

    refs = {"weighted": order(one, 0), "counted": order(one, 2)}
    for name, ref in refs.items():
        _within_one_of_shares(ref, PER_EPOCH[name], name)
    for world, runs in worlds.items():
        for i, cfg in enumerate(STEPS):
            assert order(runs, i) == refs[cfg["data"]], f"{world} ranks, {cfg}: another order"
            for r in runs:  # every batch but a rank's last is whole
                sizes = [len(b) for b in r[i]["batches"]]
                assert sizes[:-1] == [B] * (len(sizes) - 1), f"{world} ranks, {cfg}: batch sizes {sizes}"
        pads = [s for r in runs for b in r[1]["batches"] for s in b if s[1]]
        assert len(pads) < world
    assert order(one, n + 2) == refs["weighted"]
    # Counts per source: what the ranks read, summed, is each source's share (pads aside).
    assert Counter(s[2] for s in refs["weighted"]) == PER_EPOCH["weighted"]
    stats = Counter()
    for r in one:
        stats.update(r[0]["stats"])
    assert stats == PER_EPOCH["weighted"]

    # Resumes go on with exactly the rest of the order, at another world size and worker count.
    def resumed(before_runs, bi: int, after_runs, ai: int, ref: list[tuple], what: str) -> None:
        assert order(before_runs, bi) + order(after_runs, ai) == ref, f"{what}: the order does not go on"

    resumed(two, n, three, n, refs["weighted"], "weighted: 2 ranks x 2 workers after 3 batches -> 3 ranks x 0")
    resumed(two, n + 1, three, n + 1, refs["counted"], "counted: 2 ranks after 2 batches -> 3 ranks x 2 workers")
    resumed(three, n + 2, one, n, refs["weighted"], "weighted: 3 ranks after 1 batch -> 1 rank x 2 workers")
    resumed(two, n + 1, one, n + 1, refs["counted"], "counted: 2 ranks after 2 batches -> 1 rank x 0 workers")

    # repeat: 2 -> each hq sample twice, marked 0 then 1, half an epoch apart; repeat: 0.5 and
    # choose: 12 -> that many distinct samples, each once.
    counted = refs["counted"]
    hq = [(t, s) for t, s in enumerate(counted) if s[2] == "hq"]
    places: dict[int, list[tuple[int, int]]] = {}
    for t, s in hq:
        places.setdefault(s[0], []).append((t, s[1]))
    assert len(places) == 8 and all([rep for _, rep in p] == [0, 1] for p in places.values())
    assert min(p[1][0] - p[0][0] for p in places.values()) >= len(counted) // 2 - 3  # spread, never bunched
    for name, want in (("photos", 12), ("web", 10)):
        sids = [s[0] for s in counted if s[2] == name]
        assert len(sids) == len(set(sids)) == want and {s[1] for s in counted if s[2] == name} == {0}

    # The next epoch: the same shares, other chosen samples, each once.
    both = _real([s for b in one[0][n + 3]["batches"] for s in b])
    e0, e1 = [s for s in both if s[3] == 0], [s for s in both if s[3] == 1]
    assert e0 == counted
    _within_one_of_shares(e1, PER_EPOCH["counted"], "counted, epoch 1")
    for name, want in (("photos", 12), ("web", 10)):
        s0, s1 = ([s[0] for s in e if s[2] == name] for e in (e0, e1))
        assert len(set(s1)) == len(s1) == want, f"{name}: a chosen sample twice in epoch 1"
        assert set(s0) != set(s1), f"{name}: epoch 1 chose the same samples"
    assert Counter(s[0] for s in e1 if s[2] == "hq") == Counter({sid: 2 for sid in places})


def _order_in_process(root: Path, data, **kw) -> list[tuple]:
    from loader.wds.pipeline import build_dataset, make_loader

    ds = build_dataset(data, catalog=str(root), batch_size=B, decode=None, seed=SEED, **kw)
    return [(sid, src) for b in make_loader(ds) for sid, src in zip(b["__sid__"].tolist(), b["__source__"], strict=True)]


@pytest.mark.timeout(120)
def test_each_source_keeps_its_own_order(mixroot: Path) -> None:
    """Within a mixture a source's samples come in its own order (what ``build_dataset`` of that
    source alone gives with the seed): a stretch of it from a seeded start when the mixture
    takes fewer than all, the whole of it again for a repeat."""
    from loader.wds.discovery import load_wdinfo
    from loader.wds.pipeline import build_dataset, make_loader

    mixed = _order_in_process(mixroot, "counted")
    offset = 0
    for name in COUNTED["sources"]:  # the mixture's table holds the sources' shards in this order
        alone = build_dataset(name, catalog=str(mixroot), batch_size=B, decode=None, seed=SEED)
        own = [sid + (offset << 32) for b in make_loader(alone) for sid in b["__sid__"].tolist()]
        taken = [sid for sid, src in mixed if src == name]
        start = own.index(taken[0])
        assert taken == (own * 3)[start:start + len(taken)], name
        offset += len(load_wdinfo(name, catalog=str(mixroot)).tar_files)


def test_the_schedule_keeps_every_prefix_within_one_of_the_shares_and_is_random_access() -> None:
    """Two and three sources, many share vectors: every prefix within ±1; any stretch computed on
    its own equals the same stretch of the whole epoch; a billion-sample epoch answers at once."""
    import random

    import numpy as np

    from loader.mixture.schedule import Schedule

    rng = random.Random(7)
    for trial in range(150):
        counts = [rng.randint(1, 120) for _ in range(rng.choice((2, 3)))]
        sched = Schedule(counts, seed=trial, epoch=trial % 3)
        src, j = sched.run(0, sched.size)
        for i, c in enumerate(counts):
            assert (j[src == i] == np.arange(c)).all()  # each source's samples in its own order
        taken = np.cumsum(np.eye(len(counts), dtype=np.int64)[src], axis=0)
        t = np.arange(1, sched.size + 1)[:, None]
        assert (np.abs(taken - t * np.asarray(counts) / sched.size) < 1).all(), counts
        for _ in range(4):
            a = rng.randint(0, sched.size)
            b = rng.randint(a, sched.size)
            s2, j2 = Schedule(counts, seed=trial, epoch=trial % 3).run(a, b)
            assert (s2 == src[a:b]).all() and (j2 == j[a:b]).all()
    big = Schedule([600_000_000, 300_000_000, 100_000_000], seed=0, epoch=0)
    s, j = big.run(700_000_000, 700_000_010)
    assert len(s) == 10 and sorted(set(s.tolist())) == [0, 1, 2]
    assert big.before(700_000_000) == (420_000_000, 210_000_000, 70_000_000)


@pytest.mark.timeout(120)
def test_tensor_parallel_groups_are_dealt_the_mixture_order(mixroot: Path) -> None:
    """With ``parallel_sync`` (groups of tensor-parallel ranks) the groups' batches, step by
    step, are the mixture's one order, as for ranks."""
    from loader.wds.pipeline import build_dataset, make_loader

    whole = _order_in_process(mixroot, "weighted")
    per_group = []
    for g in range(2):
        ds = build_dataset("weighted", catalog=str(mixroot), batch_size=B, decode=None, seed=SEED,
                           parallel_sync=True, group_id=g, num_groups=2)
        per_group.append([[(s, src, p) for s, src, p in zip(b["__sid__"].tolist(), b["__source__"],
                                                             b["__pad__"].tolist(), strict=True)]
                          for b in make_loader(ds)])
    dealt = [(s, src) for k in range(len(per_group[0])) for g in per_group for s, src, p in g[k] if not p]
    assert dealt == [(s, src) for s, src in whole]
