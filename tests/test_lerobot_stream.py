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


@pytest.mark.parametrize("batch_size", [None, 2])
def test_a_15_frame_epoch_with_2_workers_yields_each_frame_once(lerobot_v3_root: Path, batch_size) -> None:
    # Episodes 0 and 1 (6 + 9 frames): one each per worker. One rank needs no padding at all; the
    # old reader evened the workers out to 9 frames each, 18 items with 3 frames twice.
    ds = stream(lerobot_v3_root, episodes=[0, 1], streaming_episode_pool_size=2)
    loader = make_loader(ds, batch_size=batch_size, num_workers=2)
    got = list(loader)
    items = got if batch_size is None else [{"index": i, "__pad__": p} for b in got
                                            for i, p in zip(b["index"], b["__pad__"], strict=True)]
    assert sorted(indices(items)) == list(range(15)) and not any(bool(i["__pad__"]) for i in items)
    assert loader.stats()["padding_samples"] == 0 and len(got) == len(loader)


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

def stop_after_and_resume(new, k: int):
    """The first ``k`` batches of a fresh loader from ``new()``, and another fresh loader
    restored from the state saved after them."""
    first, taken = new(), []
    for step, batch in enumerate(first):
        taken.append(batch)
        if step + 1 == k:
            state = first.state_dict()
            break
    resumed = new()
    resumed.load_state_dict(state)
    return taken, resumed


@pytest.mark.parametrize("k", [3, 4])
def test_resume_after_k_batches_continues_the_uninterrupted_order(lerobot_v3_root: Path, k: int) -> None:
    def new():
        return make_loader(stream(lerobot_v3_root, streaming_episode_pool_size=2), batch_size=3, num_workers=2)

    full = batch_indices(new())
    taken, resumed = stop_after_and_resume(new, k)
    rest = list(resumed)
    assert batch_indices(taken) + batch_indices(rest) == full
    # And the epoch after continues as an uninterrupted second epoch would.
    second = new()
    list(second)
    assert batch_indices(resumed) == batch_indices(second)


@pytest.mark.parametrize("k", [5, 6, 7])
def test_resume_after_one_worker_ran_out_continues_the_uninterrupted_order(lerobot_v3_root: Path, k: int) -> None:
    # Episodes 0 and 1, one per worker: 3 and 5 batches of 2. From batch 6 on only one worker has any.
    def new():
        return make_loader(stream(lerobot_v3_root, episodes=[0, 1], streaming_episode_pool_size=2),
                           batch_size=2, num_workers=2)

    full = batch_indices(new())
    taken, resumed = stop_after_and_resume(new, k)
    assert batch_indices(taken) + batch_indices(resumed) == full and sorted(full) == list(range(15))


def test_the_dataset_itself_resumes_in_process(lerobot_v3_root: Path) -> None:
    full = indices(stream(lerobot_v3_root, streaming_episode_pool_size=3))
    ds = stream(lerobot_v3_root, streaming_episode_pool_size=3)
    taken = []
    for item in ds:
        taken.append(int(item["index"]))
        if len(taken) == 7:
            state = ds.state_dict()
            break
    again = stream(lerobot_v3_root, streaming_episode_pool_size=3)
    again.load_state_dict(state)
    assert taken + indices(again) == full
    assert state["samples"] == [7] and state["batches"] is None


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


# -- ranks: real gloo process groups ------------------------------------------------------------------

def _rank_epochs(rank: int, world: int, root: str, home: str) -> dict:
    """Every (workers, strategy) epoch on this rank, then an exact resume after 3 batches."""
    import os

    os.environ["HF_LEROBOT_HOME"] = home
    out = {}
    for workers in (0, 1, 2):
        for strategy in ("remaining", "round_robin"):
            ds = StreamingLeRobotDataset(REPO, root=root, streaming_sampling_strategy=strategy,
                                         streaming_episode_pool_size=2)
            loader = make_loader(ds, batch_size=2, num_workers=workers)
            got = list(loader)
            out[workers, strategy] = {"batches": [b["index"].tolist() for b in got],
                                      "pads": [b["__pad__"].tolist() for b in got],
                                      "padding": loader.stats()["padding_samples"], "len": len(loader)}
    for workers in (0, 2):
        loader = make_loader(StreamingLeRobotDataset(REPO, root=root, streaming_episode_pool_size=2),
                             batch_size=2, num_workers=workers, drop_last=True)
        got = list(loader)
        out["drop_last", workers] = {"batches": [b["index"].tolist() for b in got],
                                     "pads": [b["__pad__"].tolist() for b in got],
                                     "padding": loader.stats()["padding_samples"], "len": len(loader)}

    def new():
        return make_loader(StreamingLeRobotDataset(REPO, root=root, streaming_episode_pool_size=2),
                           batch_size=2, num_workers=2)

    first, taken = new(), []
    for step, batch in enumerate(first):
        taken.append(batch["index"].tolist())
        if step == 2:
            state = first.state_dict()      # a collective: both ranks call it
            break
    resumed = new()
    resumed.load_state_dict(state)
    out["resume"] = {"taken": taken, "rest": [b["index"].tolist() for b in resumed], "state": state}
    return out


@pytest.fixture(scope="module")
def two_ranks(lerobot_v3_root: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from tests.support.dist import run_distributed

    home = tmp_path_factory.mktemp("lerobot-home-2ranks")
    return run_distributed(_rank_epochs, 2, args=(str(lerobot_v3_root), str(home)), timeout=240)


@pytest.mark.parametrize("strategy", ["remaining", "round_robin"])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_two_ranks_cover_every_frame_once(two_ranks: list[dict], lerobot_v3_root: Path, workers: int,
                                          strategy: str) -> None:
    frames = MapStyleOracle(lerobot_v3_root).indices()
    per_rank = [two_ranks[r][workers, strategy] for r in (0, 1)]
    flat = [[i for b in rank["batches"] for i in b] for rank in per_rank]
    # Whole episodes per rank: no frame is read by both ranks.
    assert not set(flat[0]) & set(flat[1])
    assert set(flat[0]) | set(flat[1]) == set(frames)
    padding = sum(rank["padding"] for rank in per_rank)
    assert sum(map(len, flat)) == len(frames) + padding
    # The same number of batches on every rank: no rank waits at the end (and len() says it).
    assert len(per_rank[0]["batches"]) == len(per_rank[1]["batches"]) == per_rank[0]["len"] == per_rank[1]["len"]
    if workers <= 1:  # one stream per rank: the same samples too
        assert len(flat[0]) == len(flat[1])
    # Each frame exactly once unmarked; every repeat, and nothing else, marked __pad__.
    marked = [(i, p) for rank in per_rank for b, pads in zip(rank["batches"], rank["pads"], strict=True)
              for i, p in zip(b, pads, strict=True)]
    assert sorted(i for i, p in marked if not p) == sorted(frames)
    assert sum(p for _, p in marked) == padding


@pytest.mark.parametrize("workers", [0, 2])
def test_drop_last_leaves_padding_out(two_ranks: list[dict], workers: int) -> None:
    for r in (0, 1):
        run = two_ranks[r]["drop_last", workers]
        assert run["padding"] == 0 and not any(p for pads in run["pads"] for p in pads)
        assert all(len(b) == 2 for b in run["batches"]) and len(run["batches"]) == run["len"]
    # Without drop_last the same epoch needs padding (44 frames, 2 ranks of whole episodes).
    assert sum(two_ranks[r][workers, "remaining"]["padding"] for r in (0, 1)) > 0


def test_two_ranks_resume_continues_each_ranks_order(two_ranks: list[dict]) -> None:
    for r in (0, 1):
        res = two_ranks[r]["resume"]
        uninterrupted = two_ranks[r][2, "remaining"]["batches"]
        assert res["taken"] + res["rest"] == uninterrupted
    assert two_ranks[0]["resume"]["state"] == two_ranks[1]["resume"]["state"]


def test_a_two_rank_state_resumes_on_one_rank_exactly_once(two_ranks: list[dict], lerobot_v3_root: Path) -> None:
    state = two_ranks[0]["resume"]["state"]
    done = {i for r in (0, 1) for b in two_ranks[r]["resume"]["taken"] for i in b}
    loader = make_loader(stream(lerobot_v3_root, streaming_episode_pool_size=2), batch_size=4, num_workers=0)
    loader.load_state_dict(state)
    rest = batch_indices(loader)
    frames = set(MapStyleOracle(lerobot_v3_root).indices())
    assert not done & set(rest)
    assert done | set(rest) == frames and len(rest) == len(frames - done)


# -- roots: local, s3:// (real SeaweedFS), http:// (real range server), with faults ------------------

def _signature(items) -> list[tuple]:
    return [(int(i["index"]), float(i["observation.images.front"].sum()), float(i["observation.images.wrist"].sum()),
             tuple(i["action"].tolist())) for i in items]


@pytest.fixture(scope="module")
def local_items(lerobot_v3_root: Path) -> list[dict]:
    return list(stream(lerobot_v3_root, delta_timestamps=DELTAS, streaming_episode_pool_size=3))


def _same_items(got: list[dict], want: list[dict]) -> None:
    assert [int(i["index"]) for i in got] == [int(i["index"]) for i in want]
    for g, w in zip(got, want, strict=True):
        assert_item_equal(g, w, where=f"index {int(w['index'])}")


def _fast():
    from loader.io import StreamConfig

    return StreamConfig(max_retries=30, backoff_base_s=0.01, backoff_max_s=0.05, read_timeout_s=0.5,
                        connect_timeout_s=2.0)


def test_s3_root_gives_the_same_items(s3_env, lerobot_v3_root: Path, local_items: list[dict]) -> None:
    from tests.support.seaweedfs import upload_to_new_bucket

    root = upload_to_new_bucket(s3_env, lerobot_v3_root, "lerobot-stream", "datasets/arm")
    ds = StreamingLeRobotDataset(REPO, root=root, delta_timestamps=DELTAS,
                                 streaming_episode_pool_size=3, stream_config=_fast())
    _same_items(list(ds), local_items)
    assert ds.stats()["requests"] > 0


def test_s3_with_resets_and_stalls_gives_the_same_items(s3_env, fault_proxy, lerobot_v3_root: Path,
                                                        local_items: list[dict],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.fault_proxy import drop, stall
    from tests.support.seaweedfs import upload_to_new_bucket

    root = upload_to_new_bucket(s3_env, lerobot_v3_root, "lerobot-stream-faults", "datasets/arm")
    ds = StreamingLeRobotDataset(REPO, root=root, delta_timestamps=DELTAS,
                                 streaming_episode_pool_size=3, stream_config=_fast())
    # Faults only for the payload reads (metadata and sidecar were read above, fault-free).
    proxy = fault_proxy(s3_env.endpoint_url, [drop(1_500), stall(800, 1.0), drop(3_000, rst=False)] * 4)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)   # clients are keyed by endpoint: new ones use it
    _same_items(list(ds), local_items)
    assert proxy.fired, "no fault fired: the test would prove nothing"


def test_http_root_with_503s_resets_and_stalls_gives_the_same_items(http_server, fault_proxy, lerobot_v3_root: Path,
                                                                    local_items: list[dict]) -> None:
    from tests.support.fault_proxy import drop, stall

    server = http_server(lerobot_v3_root)
    clean = StreamingLeRobotDataset(REPO, root=server.url + "/", delta_timestamps=DELTAS,
                                    streaming_episode_pool_size=3, stream_config=_fast(),
                                    streaming_native_http_subranges=2, streaming_native_http_connections=2)
    _same_items(list(clean), local_items)
    proxy = fault_proxy(server.url, [drop(1_500), stall(800, 1.0), drop(3_000, rst=False)] * 4)
    faulty = StreamingLeRobotDataset(REPO, root=proxy.url + "/", delta_timestamps=DELTAS,
                                     streaming_episode_pool_size=3, stream_config=_fast())
    server.fail_gets = 6     # and the next six GETs answer 503
    _same_items(list(faulty), local_items)
    assert proxy.fired and server.fail_gets == 0
    assert faulty.stats()["retries"] > 0


# -- a killed trainer leaves nothing behind ----------------------------------------------------------

_TRAINER = """
import os, sys, time
from loader.lerobot.streaming import StreamingLeRobotDataset, make_loader
ds = StreamingLeRobotDataset("local/arm", root=sys.argv[1], streaming_episode_pool_size=2)
loader = make_loader(ds, batch_size=1, num_workers=2)
for i, batch in enumerate(loader):
    if i == 1:
        kids = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
        print(" ".join(kids), flush=True)
    time.sleep(0.5)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_end_when_the_trainer_is_killed(lerobot_v3_root: Path, tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "HF_LEROBOT_HOME": str(tmp_path / "home"), "PYTHONPATH": str(Path.cwd())}
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, str(lerobot_v3_root)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) >= 2, workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in workers if _alive(p)], "DataLoader workers outlived a kill -9 of the trainer"
    finally:
        if proc.poll() is None:
            proc.kill()
