"""A weighted mixture of two LeRobot datasets (``StreamingLeRobotDataset.mixture``): one epoch
order whatever the world size and worker count, every prefix within ±1 of the shares, resumes
that continue the order under another layout, items equal to each dataset's own, ``choose``
taking other frames each epoch, and one clear error per bad definition.

Two small v3 datasets with real AV1 video (``write_v3_dataset``): ``local/arm`` (4 episodes, 22
frames) and ``local/cups`` (3 episodes, 19 frames, other tasks). Real gloo process groups of 1
and 2 ranks read them with 0 and 2 DataLoader workers.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from loader.lerobot.streaming import MixtureResumeError, StreamingLeRobotDataset, make_loader
from loader.mixture import Mixture, MixtureError, Source
from loader.wds.errors import ResumeStateError
from tests.support.dist import run_distributed, slice_order
from tests.support.lerobot_data import CAMERAS, write_v3_dataset
from tests.test_lerobot_stream import lerobot_home  # noqa: F401  (autouse: the session's shared sidecar cache)

ARM, CUPS = "local/arm", "local/cups"
ARM_EPISODES, CUPS_EPISODES = (5, 7, 6, 4), (6, 5, 8)
B = 3
SEED = 3
OPTIONS = {"streaming_episode_pool_size": 2, "seed": SEED}
DELTAS = {"observation.images.front": [-0.1, 0.0], "action": [0.0, 0.2]}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("lerobot-mixture")
    return {
        ARM: str(write_v3_dataset(base / "arm", episodes_per_file=2, episode_lengths=ARM_EPISODES)),
        CUPS: str(write_v3_dataset(base / "cups", episodes_per_file=2, episode_lengths=CUPS_EPISODES,
                                   tasks=("stack the cups", "open the drawer"))),
    }


def weighted(roots: dict[str, str], a: float = 0.7, b: float = 0.3) -> Mixture:
    return Mixture([Source({"repo_id": ARM, "root": roots[ARM]}, weight=a),
                    Source({"repo_id": CUPS, "root": roots[CUPS]}, weight=b)], name="arm+cups")


def counted(roots: dict[str, str]) -> Mixture:
    return Mixture([Source({"repo_id": ARM, "root": roots[ARM]}, choose=10),
                    Source({"repo_id": CUPS, "root": roots[CUPS]}, repeat=2)], name="counted")


def keyed(item: dict) -> tuple[int, int]:
    return int(item["dataset_index"]), int(item["index"])


def within_one_of_shares(order: list[tuple[int, int]], per_epoch: list[int]) -> None:
    n = sum(per_epoch)
    assert len(order) == n
    seen: Counter = Counter()
    for t, (i, _) in enumerate(order, 1):
        seen[i] += 1
        for s, c in enumerate(per_epoch):
            assert abs(seen[s] - t * c / n) < 1, f"after {t} items dataset {s} has {seen[s]}, share {t * c / n:.2f}"


# -- one order, any layout, resumes -------------------------------------------------------------------

def _rank_steps(rank: int, world: int, roots: dict[str, str], home: str, steps: list[dict]) -> list[dict]:
    """Each step in a fresh loader: restore a state if given, read ``stop`` batches (or the whole
    epoch), save the state after a stop. Per batch: [(dataset_index, index, pad), ...]."""
    import os

    os.environ["HF_LEROBOT_HOME"] = home
    out = []
    for step in steps:
        ds = StreamingLeRobotDataset.mixture(weighted(roots), **OPTIONS)
        loader = make_loader(ds, batch_size=B, num_workers=step["workers"])
        if step.get("state"):
            loader.load_state_dict(step["state"])
        batches = []
        for batch in loader:
            batches.append(list(zip(batch["dataset_index"].tolist(), batch["index"].tolist(),
                                    batch["__pad__"].tolist(), strict=True)))
            if len(batches) == step.get("stop"):
                break
        res: dict = {"batches": batches, "len": len(loader)}
        if step.get("stop"):
            res["state"] = json.loads(json.dumps(loader.state_dict()))
        else:
            res["per_source"] = loader.stats()["samples_per_source"]
        out.append(res)
    return out


def _real(samples: list[tuple]) -> list[tuple[int, int]]:
    return [(i, x) for i, x, pad in samples if not pad]


@pytest.mark.timeout(400)
def test_one_order_for_any_ranks_and_workers_and_resumes_continue_it(roots, lerobot_home: Path) -> None:  # noqa: F811
    want = StreamingLeRobotDataset.mixture(weighted(roots), **OPTIONS).epoch_order()
    per_epoch = [sum(1 for i, _ in want if i == s) for s in (0, 1)]
    assert per_epoch == [29, 12]           # 0.7 / 0.3 of the 41 frames, largest remainder
    within_one_of_shares(want, per_epoch)
    home = str(lerobot_home)

    def run(world: int, steps: list[dict]) -> list[list[dict]]:
        per_rank = run_distributed(_rank_steps, world, args=(roots, home, steps), timeout=300)
        return [[r[k] for r in per_rank] for k in range(len(steps))]   # [step][rank]

    one = run(1, [{"workers": 0}, {"workers": 2}, {"workers": 0, "stop": 4}])
    for step in one[:2]:
        (r,) = step
        assert [s for b in r["batches"] for s in _real(b)] == want and len(r["batches"]) == r["len"] == 14
        assert r["per_source"] == {ARM: 29, CUPS: 12}
    stopped_on_one = one[2][0]
    two = run(2, [{"workers": 0}, {"workers": 2},
                  {"workers": 2, "state": stopped_on_one["state"]},     # 1 rank -> 2 ranks, 0 -> 2 workers
                  {"workers": 0, "stop": 3}])
    for step in two[:2]:
        order = slice_order([r["batches"] for r in step])
        # Every rank has as many batches; the last step's padding repeats the epoch's first items.
        assert _real(order) == want and all(len(r["batches"]) == r["len"] == 7 for r in step)
        assert [(i, x) for i, x, pad in order if pad] == want[:1]
        assert sum(Counter(r["per_source"]).total() for r in step) == 42
    # Stopped after 4 batches on one rank, resumed on two ranks with two workers: the rest of the order.
    first = [s for b in stopped_on_one["batches"] for s in _real(b)]
    rest = _real(slice_order([r["batches"] for r in two[2]]))
    assert first + rest == want
    # Stopped after 3 steps on two ranks, resumed on one rank with two workers.
    stopped_on_two = two[3]
    first = _real(slice_order([r["batches"] for r in stopped_on_two]))
    assert len(first) == 2 * 3 * B
    (back,) = run(1, [{"workers": 2, "state": stopped_on_two[0]["state"]}])
    assert first + [s for b in back[0]["batches"] for s in _real(b)] == want


# -- items, shares, choose ------------------------------------------------------------------------------

@pytest.mark.parametrize("deltas", [None, DELTAS], ids=["frames", "windows"])
def test_items_equal_each_datasets_own_items(roots, deltas) -> None:
    # Every source counted once: each dataset's items come in its own reader's order (one stream).
    mix = Mixture([Source({"repo_id": ARM, "root": roots[ARM]}), Source({"repo_id": CUPS, "root": roots[CUPS]})])
    items = list(StreamingLeRobotDataset.mixture(mix, delta_timestamps=deltas, **OPTIONS))
    within_one_of_shares([keyed(i) for i in items], [22, 19])
    for d, repo in enumerate((ARM, CUPS)):
        alone = list(StreamingLeRobotDataset(repo, root=roots[repo], delta_timestamps=deltas, **OPTIONS))
        mine = [i for i in items if int(i["dataset_index"]) == d]
        assert [int(i["index"]) for i in mine] == [int(i["index"]) for i in alone]
        for got, want in zip(mine, alone, strict=True):
            assert list(got) == [*[k for k in want if k != "__pad__"], "dataset_index", "__pad__", "__repeat__"]
            assert got["dataset_index"].dtype == torch.int64 and got["dataset_index"].shape == ()
            assert int(got["__repeat__"]) == 0 and not bool(got["__pad__"])
            for key, value in want.items():
                if isinstance(value, torch.Tensor):
                    assert value.dtype == got[key].dtype and torch.equal(value, got[key]), (repo, key, int(got["index"]))
                else:
                    assert value == got[key]
            assert set(CAMERAS) <= set(got)


def test_choose_takes_other_frames_each_epoch_and_repeats_are_marked(roots) -> None:
    ds = StreamingLeRobotDataset.mixture(counted(roots), **OPTIONS)
    assert ds.per_epoch == [10, 38]
    epochs = []
    for epoch in range(3):
        items = list(ds)
        order = [keyed(i) for i in items]
        within_one_of_shares(order, ds.per_epoch)
        assert order == ds.epoch_order(epoch)
        arm = [x for i, x in order if i == 0]
        assert len(arm) == len(set(arm)) == 10                      # chosen once each
        cups = Counter((x, int(i["__repeat__"])) for i in items if int(i["dataset_index"]) == 1 for x in [int(i["index"])])
        assert set(cups.values()) == {1} and len(cups) == 38        # each frame twice: pass 0, then pass 1
        assert {r for _, r in cups} == {0, 1}
        epochs.append(set(arm))
    assert epochs[0] != epochs[1] != epochs[2]                      # other frames each epoch
    assert ds.stats()["samples_per_source"] == {ARM: 10, CUPS: 38}


def test_the_dataset_itself_resumes_in_process(roots) -> None:
    want = StreamingLeRobotDataset.mixture(weighted(roots), **OPTIONS).epoch_order()
    ds = StreamingLeRobotDataset.mixture(weighted(roots), **OPTIONS)
    taken = []
    for item in ds:
        taken.append(keyed(item))
        if len(taken) == 11:
            state = ds.state_dict()
            break
    again = StreamingLeRobotDataset.mixture(weighted(roots), **OPTIONS)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert taken + [keyed(i) for i in again] == want
    # ...and the next pass is epoch 1, whole.
    assert [keyed(i) for i in again] == again.epoch_order(1)


def test_persistent_workers_resume_into_the_same_loader(roots) -> None:
    want = [StreamingLeRobotDataset.mixture(weighted(roots), **OPTIONS).epoch_order(e) for e in (0, 1)]
    loader = make_loader(StreamingLeRobotDataset.mixture(weighted(roots), **OPTIONS), batch_size=B, num_workers=2,
                         persistent_workers=True)
    try:
        taken = []
        for step, batch in enumerate(loader):
            taken += list(zip(batch["dataset_index"].tolist(), batch["index"].tolist(), strict=True))
            if step == 2:
                state = loader.state_dict()
                break
        pids = [w.pid for w in loader._dataloader._iterator._workers]
        loader.load_state_dict(state)
        rest = [(int(d), int(x)) for b in loader for d, x in zip(b["dataset_index"], b["index"], strict=True)]
        assert taken + rest == want[0]
        assert [(int(d), int(x)) for b in loader for d, x in zip(b["dataset_index"], b["index"], strict=True)] == want[1]
        assert [w.pid for w in loader._dataloader._iterator._workers] == pids    # the same workers throughout
    finally:
        loader._dataloader = None   # a failed assert keeps the loader alive: let its workers go


def test_a_state_of_another_definition_is_refused(roots) -> None:
    ds = StreamingLeRobotDataset.mixture(weighted(roots), **OPTIONS)
    next(iter(ds))
    state = ds.state_dict()
    other = StreamingLeRobotDataset.mixture(weighted(roots, 0.5, 0.5), **OPTIONS)
    with pytest.raises(MixtureResumeError, match=r"source 'local/arm' weight 0.7 -> 0.5") as err:
        other.load_state_dict(state)
    assert isinstance(err.value, ResumeStateError) and "arm+cups" in str(err.value)
    single = StreamingLeRobotDataset(ARM, root=roots[ARM], **OPTIONS)
    with pytest.raises(MixtureResumeError, match="not a LeRobot mixture resume state"):
        other.load_state_dict(single.state_dict())


# -- bad definitions: one error naming the dataset, the source and the fix -----------------------------

@pytest.fixture(scope="module")
def odd_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("lerobot-mixture-odd")
    return {
        "one-camera": str(write_v3_dataset(base / "one-camera", cameras=CAMERAS[:1], episodes_per_file=2,
                                           episode_lengths=(4, 5))),
        "fps-20": str(write_v3_dataset(base / "fps-20", episodes_per_file=2, episode_lengths=(4, 5), fps=20)),
    }


@pytest.mark.parametrize(("other", "what"), [
    ("one-camera", r"features differ: it lacks \['observation.images.wrist'\]"),
    ("fps-20", r"fps 20, the first dataset 10"),
])
def test_datasets_whose_features_differ_are_refused(roots, odd_roots, other: str, what: str) -> None:
    mix = Mixture([Source({"repo_id": ARM, "root": roots[ARM]}, weight=1),
                   Source({"repo_id": "local/odd", "root": odd_roots[other]}, weight=1)], name="blend")
    with pytest.raises(MixtureError, match=what) as err:
        StreamingLeRobotDataset.mixture(mix, **OPTIONS)
    msg = str(err.value)
    assert msg.startswith("dataset 'blend', source 'local/odd': local/odd does not match local/arm (source 'local/arm')")
    assert "mix only datasets recorded alike" in msg


def test_a_weight_not_above_zero_is_refused(roots) -> None:
    with pytest.raises(MixtureError, match=r"dataset 'blend', source 'local/cups': weight 0 is not a number > 0; "
                                           r"give a positive weight"):
        Mixture([Source({"repo_id": ARM, "root": roots[ARM]}, weight=1),
                 Source({"repo_id": CUPS, "root": roots[CUPS]}, weight=0)], name="blend")


def test_an_unknown_root_is_refused(roots, tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    mix = Mixture([Source({"repo_id": ARM, "root": roots[ARM]}, weight=1),
                   Source({"repo_id": "local/gone", "root": missing}, weight=1)], name="blend")
    with pytest.raises(MixtureError) as err:
        StreamingLeRobotDataset.mixture(mix, **OPTIONS)
    msg = str(err.value)
    assert msg.startswith(f"dataset 'blend', source 'local/gone': cannot be opened from root {missing!r}")
    assert "fix its 'root'" in msg


@pytest.mark.parametrize(("episodes", "what"), [([], "selects no episode"), ([99], "episodes [99] are not in")])
def test_an_episode_selection_that_selects_nothing_names_episodes(roots, episodes: list[int], what: str) -> None:
    mix = Mixture([Source({"repo_id": ARM, "root": roots[ARM]}, weight=1),
                   Source({"repo_id": CUPS, "root": roots[CUPS], "episodes": episodes}, weight=1)], name="blend")
    with pytest.raises(MixtureError) as err:
        StreamingLeRobotDataset.mixture(mix, **OPTIONS)
    msg = str(err.value)
    assert msg.startswith(f"dataset 'blend', source 'local/cups': its episodes {episodes!r}: ") and what in msg
    assert "fix its 'episodes'" in msg and "root" not in msg.split("episodes", 1)[1].split(";")[1]


def test_a_spec_that_is_not_a_dataset_is_refused(roots) -> None:
    mix = Mixture([Source({"repo_id": ARM, "roots": roots[ARM]}, weight=1)], name="blend")
    with pytest.raises(MixtureError, match=r"dataset 'blend', source 'local/arm': .*unknown keys \['roots'\]"):
        StreamingLeRobotDataset.mixture(mix, **OPTIONS)
