"""StreamingLeRobotDataset end to end on real encoded datasets: every item equals the map-style
oracle (tests/support/lerobot_oracle.py), coverage is exact, the byte budget holds, roots and
faults change nothing, and resumes continue the uninterrupted order."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from loader.lerobot.streaming import StreamingLeRobotDataset, make_loader
from loader.lerobot.streaming.planner import EpisodeTooLargeError
from tests.support.lerobot_oracle import MapStyleOracle, assert_item_equal

REPO = "local/arm"
# fps 10: frame offsets -3..+4, reaching past both ends of the 6-16 frame episodes.
DELTAS = {"observation.images.front": [-0.3, -0.1, 0.0], "observation.images.wrist": [0.2],
          "action": [-0.2, 0.0, 0.1, 0.4], "observation.state": [-0.1, 0.0]}


@pytest.fixture(autouse=True)
def lerobot_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    # Sidecars and compact indexes of one test session share a cache, as ranks of a job would.
    home = tmp_path_factory.getbasetemp() / "lerobot-home"
    monkeypatch.setenv("HF_LEROBOT_HOME", str(home))
    return home


def stream(root, **kw) -> StreamingLeRobotDataset:
    return StreamingLeRobotDataset(REPO, root=str(root), **kw)


def indices(items) -> list[int]:
    return [int(i["index"]) for i in items]


def batch_indices(batches) -> list[int]:
    return [int(x) for b in batches for x in b["index"]]


@pytest.mark.parametrize("dataset", ["lerobot_v3_root", "lerobot_stream_h264_root"])
@pytest.mark.parametrize("deltas", [None, DELTAS], ids=["frames", "windows"])
def test_every_item_equals_the_map_style_oracle(dataset: str, deltas, request: pytest.FixtureRequest) -> None:
    root = request.getfixturevalue(dataset)
    ds = stream(root, delta_timestamps=deltas, streaming_episode_pool_size=3)
    oracle = MapStyleOracle(root, delta_timestamps=deltas)
    items = list(ds)
    assert sorted(indices(items)) == oracle.indices()
    for item in items:
        assert_item_equal(item, oracle.item(int(item["index"])), where=f"index {int(item['index'])}")


@pytest.mark.parametrize("strategy", ["remaining", "round_robin"])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_one_epoch_visits_every_frame_once(lerobot_v3_root: Path, workers: int, strategy: str) -> None:
    ds = stream(lerobot_v3_root, streaming_sampling_strategy=strategy, streaming_episode_pool_size=2)
    loader = make_loader(ds, batch_size=None, num_workers=workers)
    got = indices(loader)
    frames = MapStyleOracle(lerobot_v3_root).indices()
    padding = loader.stats()["padding_samples"]
    assert set(got) == set(frames)
    assert len(got) == len(frames) + padding == ds.samples_per_rank(workers)
    assert sum(c - 1 for c in Counter(got).values()) == padding
    again = indices(make_loader(stream(lerobot_v3_root, streaming_sampling_strategy=strategy,
                                       streaming_episode_pool_size=2), batch_size=None, num_workers=workers))
    assert again == got
    other = indices(make_loader(stream(lerobot_v3_root, streaming_sampling_strategy=strategy, seed=7,
                                       streaming_episode_pool_size=2), batch_size=None, num_workers=workers))
    assert other != got and sorted(set(other)) == sorted(set(got))


def test_next_epoch_has_another_order(lerobot_v3_root: Path) -> None:
    loader = make_loader(stream(lerobot_v3_root, streaming_episode_pool_size=2), batch_size=None)
    first, second = indices(loader), indices(loader)
    assert first != second and set(first) == set(second)


def test_episode_subset(lerobot_v3_root: Path) -> None:
    ds = stream(lerobot_v3_root, episodes=[3, 1])
    oracle = MapStyleOracle(lerobot_v3_root, episodes=[1, 3])
    items = list(ds)
    assert sorted(indices(items)) == oracle.indices()
    assert {int(i["episode_index"]) for i in items} == {1, 3}
    with pytest.raises(ValueError, match=r"episodes \[9\] are not in local/arm"):
        stream(lerobot_v3_root, episodes=[1, 9])


def test_byte_budget_holds_throughout_an_epoch(lerobot_v3_root: Path) -> None:
    sizes = stream(lerobot_v3_root).episode_bytes()
    budget = 2 * max(sizes.values())
    ds = stream(lerobot_v3_root, streaming_byte_budget_gb=budget / (1 << 30), streaming_prefetch_episodes=4)
    samples = []
    for _ in ds:
        snap = ds.byte_cache.snapshot()
        samples.append(snap["reserved_bytes"])
        assert snap["reserved_bytes"] <= budget and snap["resident_bytes"] <= snap["reserved_bytes"]
    assert ds.byte_cache.peak_reserved_bytes <= budget
    assert max(samples) > 0
    assert ds.stats()["bytes_fetched"] >= sum(sizes.values())


def test_an_episode_larger_than_the_budget_fails_before_any_fetch(lerobot_v3_root: Path) -> None:
    sizes = stream(lerobot_v3_root).episode_bytes()
    ds = stream(lerobot_v3_root, streaming_byte_budget_gb=(max(sizes.values()) - 1) / (1 << 30))
    with pytest.raises(EpisodeTooLargeError, match="streaming_byte_budget_gb"):
        next(iter(ds))
    assert ds.stats()["bytes_fetched"] == 0


def test_options_are_validated_up_front(lerobot_v3_root: Path) -> None:
    with pytest.raises(ValueError, match="streaming_decode_threads must be positive"):
        stream(lerobot_v3_root, streaming_decode_threads=0)
    with pytest.raises(ValueError, match="unknown streaming option 'streaming_buffer'"):
        stream(lerobot_v3_root, streaming_buffer=4)
    with pytest.raises(ValueError, match="not multiples of 1/fps"):
        stream(lerobot_v3_root, delta_timestamps={"action": [0.05]})
    assert stream(lerobot_v3_root, seed=None).seed == 42


def test_too_many_workers_names_the_number_to_use(lerobot_v3_root: Path) -> None:
    ds = stream(lerobot_v3_root)
    assert ds.num_workers_for(8) == 5
    with pytest.raises(ValueError, match="use num_workers=5"):
        make_loader(ds, num_workers=6)


def test_transforms_in_the_training_process_are_reproducible(lerobot_v3_root: Path) -> None:
    def jitter(x: torch.Tensor) -> torch.Tensor:
        return (x + torch.rand(()) * 0.1).clamp(0, 1)

    def run() -> list[torch.Tensor]:
        torch.manual_seed(5)
        return [i["observation.images.front"] for i in stream(lerobot_v3_root, image_transforms=jitter)]

    a, b = run(), run()
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- resume -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [3, 4])
def test_resume_after_k_batches_continues_the_uninterrupted_order(lerobot_v3_root: Path, k: int) -> None:
    def new():
        return make_loader(stream(lerobot_v3_root, streaming_episode_pool_size=2), batch_size=3, num_workers=2)

    full = batch_indices(new())
    first = new()
    taken = []
    for step, batch in enumerate(first):
        taken.append(batch)
        if step + 1 == k:
            state = first.state_dict()
            break
    resumed = new()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert batch_indices(taken) + batch_indices(rest) == full
    # And the epoch after continues as an uninterrupted second epoch would.
    second = new()
    list(second)
    assert batch_indices(resumed) == batch_indices(second)


def test_resume_with_other_workers_and_batch_size_covers_the_rest_once(lerobot_v3_root: Path) -> None:
    first = make_loader(stream(lerobot_v3_root, streaming_episode_pool_size=2), batch_size=3, num_workers=2)
    taken = []
    for step, batch in enumerate(first):
        taken.append(batch)
        if step == 2:
            state = first.state_dict()
            break
    resumed = make_loader(stream(lerobot_v3_root, streaming_episode_pool_size=3), batch_size=2, num_workers=1)
    resumed.load_state_dict(state)
    rest = batch_indices(resumed)
    frames = MapStyleOracle(lerobot_v3_root).indices()
    done = batch_indices(taken)
    real_rest = set(rest)
    assert set(done) | real_rest == set(frames)
    # Every frame not handed out before the checkpoint comes exactly once after it (plus padding
    # repeats, which only ever repeat frames of the rest).
    assert set(frames) - set(done) <= real_rest
    assert len(rest) - len(real_rest) == resumed.stats()["padding_samples"]


def test_resume_state_is_checked(lerobot_v3_root: Path) -> None:
    loader = make_loader(stream(lerobot_v3_root), batch_size=2)
    state = loader.state_dict()
    other = make_loader(stream(lerobot_v3_root, episodes=[0, 1]), batch_size=2)
    with pytest.raises(ValueError, match="'fingerprint' does not match"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="'epoch' must be an integer >= 0"):
        loader.load_state_dict({**state, "epoch": -5})
