"""The streaming reader's pure parts: options, ownership, the episode-pool plan, resume arithmetic."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest

from loader.lerobot.streaming.options import StreamingOptions
from loader.lerobot.streaming.ownership import (
    EpisodeWork,
    NoEpisodesError,
    Ownership,
    batches_of,
    max_workers,
)
from loader.lerobot.streaming.planner import EpisodeTooLargeError, plan_worker
from loader.lerobot.streaming.state import StreamResumeError, worker_steps

LENGTHS = [30, 7, 12, 45, 9, 9, 21, 16, 3, 28, 11, 40]


def _work(lengths=LENGTHS, starts=None):
    starts = starts or {}
    return [EpisodeWork(e, n, starts.get(e, 0)) for e, n in enumerate(lengths)]


# -- options ----------------------------------------------------------------------------------------

def test_options_defaults_are_the_documented_ones():
    o = StreamingOptions()
    assert (o.streaming_episode_pool_size, o.streaming_sampling_strategy, o.streaming_prefetch_episodes,
            o.streaming_byte_budget_gb, o.streaming_decode_threads, o.streaming_decoded_queue_size,
            o.video_decoder_cache_size, o.streaming_native_http_connections, o.streaming_native_http_subranges,
            o.streaming_sidecar_lock_timeout_s, o.max_num_shards, o.frame_dtype) == (
        32, "remaining", 8, 8, None, 8, None, None, 1, 1800, 16, "float32")
    # Decode threads: the cores this process may use, divided among the workers.
    cores = len(os.sched_getaffinity(0))
    assert [o.decode_threads(n) for n in (0, 1, 2, 4 * cores)] == [cores, cores, max(1, cores // 2), 1]
    assert StreamingOptions(streaming_decode_threads=3).decode_threads(2) == 3
    share = o.per_worker(4, cameras=3)
    assert share.pool_size == 8 and share.byte_budget == 2 << 30 and share.decoder_cache == 24


@pytest.mark.parametrize("kwargs, match", [
    ({"streaming_episode_pool_size": 0}, "streaming_episode_pool_size must be positive"),
    ({"streaming_byte_budget_gb": -1}, "streaming_byte_budget_gb must be positive"),
    ({"streaming_byte_budget_gb": float("inf")}, "streaming_byte_budget_gb must be positive and finite"),
    ({"streaming_decode_threads": 1.5}, "streaming_decode_threads must be an integer"),
    ({"max_num_shards": True}, "max_num_shards must be an integer"),
    ({"streaming_sampling_strategy": "random"}, "streaming_sampling_strategy must be one of"),
    ({"frame_dtype": "float16"}, r"frame_dtype must be one of \['float32', 'uint8'\]"),
    ({"streaming_pool_size": 4}, "unknown streaming option 'streaming_pool_size' .*did you mean 'streaming_episode_pool_size'"),
])
def test_options_refuse_bad_values_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamingOptions.from_kwargs(kwargs)


# -- ownership --------------------------------------------------------------------------------------

@pytest.mark.parametrize("world, workers", [(1, 0), (1, 3), (2, 2), (3, 1), (4, 2)])
def test_ownership_splits_whole_episodes_frame_balanced(world, workers):
    own = Ownership.compute(_work(), world_size=world, num_workers=workers, seed=7)
    seen = [w.episode for rank in own.parts for part in rank for w in part]
    assert sorted(seen) == list(range(len(LENGTHS)))         # each episode once, whole
    loads = [own.frames(r, w) for r in range(world) for w in range(max(1, workers))]
    # Longest-first greedy: no part exceeds the lightest by more than the longest episode.
    assert max(loads) - min(loads) <= max(LENGTHS)
    # Padding only evens out ranks: one rank pads nothing, and every rank yields the same batches.
    pads = [own.padding(r, w) for r in range(world) for w in range(max(1, workers))]
    assert all(p >= 0 for p in pads) and (world > 1 or not any(pads))
    if workers <= 1:
        assert len({own.rank_samples(r) for r in range(world)}) == 1
    batched = Ownership.compute(_work(), world_size=world, num_workers=workers, seed=7, batch_size=4)
    per_rank = {sum(batches_of(c, 4) for c in batched.counts[r]) for r in range(world)}
    assert len(per_rank) == 1
    assert not any(Ownership.compute(_work(), world_size=world, num_workers=workers, seed=7, batch_size=4,
                                     pad=False).padding(r, w) for r in range(world) for w in range(max(1, workers)))
    again = Ownership.compute(_work(), world_size=world, num_workers=workers, seed=7)
    assert again == own


def test_ownership_too_many_ranks_or_workers_gives_the_advice():
    with pytest.raises(NoEpisodesError, match="Reduce the number of ranks"):
        Ownership.compute(_work([5, 6]), world_size=3, num_workers=0, seed=0)
    with pytest.raises(NoEpisodesError, match=r"use num_workers <= 2"):
        Ownership.compute(_work([5, 6, 7, 8]), world_size=2, num_workers=3, seed=0)
    assert max_workers(_work([5, 6, 7, 8]), world_size=2, seed=0) == 2


# -- the plan ---------------------------------------------------------------------------------------

def _plan(work, *, strategy="remaining", seed=3, epoch=0, pool=4, budget=10**9, sizes=None, quota=None):
    sizes = sizes or {w.episode: 100 * w.length for w in work}
    quota = quota if quota is not None else sum(w.remaining for w in work)
    return plan_worker(work, quota=quota, pool_size=pool, byte_budget=budget, sizes=sizes,
                       strategy=strategy, seed=seed, epoch=epoch, rank=0, worker=0)


def _simulate_pool(plan, work, sizes):
    """Replay a plan: resident episodes per step, from its admission schedule."""
    last_use = {}
    for i, e in enumerate(plan.episodes[:plan.real_steps].tolist()):
        last_use[e] = i
    resident_max, bytes_max = 0, 0
    admitted = dict(zip(plan.admit_order, plan.admit_step, strict=True))
    for step in range(plan.real_steps):
        live = [e for e, a in admitted.items() if a <= step and last_use.get(e, -1) >= step]
        resident_max = max(resident_max, len(live))
        bytes_max = max(bytes_max, sum(sizes[e] for e in live))
    return resident_max, bytes_max


@pytest.mark.parametrize("strategy", ["remaining", "round_robin"])
def test_plan_visits_every_frame_once_in_frame_order(strategy):
    work = _work()
    plan = _plan(work, strategy=strategy)
    pairs = list(zip(plan.episodes.tolist(), plan.frames.tolist(), strict=True))
    assert len(pairs) == len(set(pairs)) == sum(LENGTHS)
    for e, n in enumerate(LENGTHS):
        frames = [f for ep, f in pairs if ep == e]
        assert frames == list(range(n))       # forward through each episode
    assert sorted(plan.admit_order) == list(range(len(LENGTHS)))


@pytest.mark.parametrize("strategy", ["remaining", "round_robin"])
def test_plan_respects_pool_size_and_byte_budget(strategy):
    work = _work()
    sizes = {w.episode: 1000 + 37 * w.length for w in work}
    budget = 4000
    plan = _plan(work, strategy=strategy, pool=3, budget=budget, sizes=sizes)
    resident, nbytes = _simulate_pool(plan, work, sizes)
    assert resident <= 3 and nbytes <= budget
    # The pool mixes: the first 20 steps draw from more than one episode.
    assert len(set(plan.episodes[:20].tolist())) > 1


def test_round_robin_rounds_take_one_frame_of_each_resident_episode():
    work = _work([5, 5, 5, 5])
    plan = _plan(work, strategy="round_robin", pool=4)
    eps = plan.episodes.tolist()
    for r in range(5):
        assert sorted(eps[4 * r:4 * r + 4]) == [0, 1, 2, 3]


def test_round_robin_admits_into_the_next_round():
    work = _work([1, 3, 3, 3])    # episode 0 ends in round 1; episode 3 waits for its slot
    plan = _plan(work, strategy="round_robin", pool=3)
    eps = plan.episodes.tolist()
    first_round = eps[:3]
    assert 3 not in first_round
    assert eps.count(3) == 3


def test_plan_is_a_function_of_seed_epoch_rank_worker():
    work = _work()
    a = _plan(work, seed=1)
    b = _plan(work, seed=1)
    assert np.array_equal(a.episodes, b.episodes) and np.array_equal(a.frames, b.frames)
    assert not np.array_equal(a.episodes, _plan(work, seed=2).episodes)
    assert not np.array_equal(a.episodes, _plan(work, seed=1, epoch=1).episodes)


def test_plan_pads_from_its_last_episode():
    work = _work([4, 6])
    plan = _plan(work, quota=13)
    assert plan.padding == 3 and len(plan) == 13
    last = int(plan.episodes[plan.real_steps - 1])
    assert plan.episodes[-3:].tolist() == [last] * 3
    assert plan.frames[-3:].tolist() == [0, 1, 2]
    assert plan.consumed(13) == {0: 4, 1: 6}        # padding is not consumption


def test_plan_with_start_frames_visits_only_the_rest():
    work = _work([10, 8], starts={0: 7, 1: 2})
    plan = _plan(work)
    assert sorted(zip(plan.episodes.tolist(), plan.frames.tolist(), strict=True)) == \
        [(0, f) for f in range(7, 10)] + [(1, f) for f in range(2, 8)]


def test_an_episode_larger_than_the_budget_fails_before_anything_is_fetched():
    work = _work([5, 50])
    with pytest.raises(EpisodeTooLargeError, match="episode 1 needs 5,000 bytes.*streaming_byte_budget_gb"):
        _plan(work, budget=4000, sizes={0: 500, 1: 5000})


def test_plan_prefix_consumption_counts():
    work = _work()
    plan = _plan(work)
    got = plan.consumed(50)
    assert sum(got.values()) == 50
    assert Counter(plan.episodes[:50].tolist()) == Counter(got)


# -- resume arithmetic ------------------------------------------------------------------------------

def test_worker_steps_follow_the_dataloader_round_robin():
    # 3 workers, batch 4, 10 samples each: batches of sizes 4,4,2 per worker.
    # 7 batches handed out: workers 0,1,2,0,1,2,0 -> worker 0: 3 batches (10 samples), 1 and 2: 2 (8).
    assert worker_steps(26, 7, num_workers=3, batch_size=4, counts=[10, 10, 10]) == ([10, 8, 8], 1)
    assert worker_steps(5, None, num_workers=0, batch_size=None, counts=[10]) == ([5], 0)
    with pytest.raises(StreamResumeError, match="'samples' .* and 'batches'"):
        worker_steps(25, 7, num_workers=3, batch_size=4, counts=[10, 10, 10])
    with pytest.raises(StreamResumeError, match="no batch count"):
        worker_steps(5, None, num_workers=2, batch_size=4, counts=[10, 10])


def test_worker_steps_pass_over_exhausted_workers():
    # Unequal workers (no padding between them): 1, 3 and 2 batches of 4 (samples 3, 12, 5).
    # The loader's order: w0 w1 w2 | w1 w2 | w1, passing over a worker once it is exhausted.
    counts = [3, 12, 5]
    expect = [([0, 0, 0], 0), ([3, 0, 0], 1), ([3, 4, 0], 2), ([3, 4, 4], 0), ([3, 8, 4], 2),
              ([3, 8, 5], 0), ([3, 12, 5], 0)]
    for batches, (steps, turn) in enumerate(expect):
        assert worker_steps(sum(steps), batches, num_workers=3, batch_size=4, counts=counts) == (steps, turn)
    # drop_last: each worker's short last batch never comes (w0 has none): w1 w2 | w1 | w1. After
    # 3 batches the next pass starts (w2 has nothing left, so it does not matter who is next).
    assert worker_steps(12, 3, num_workers=3, batch_size=4, counts=counts, drop_last=True) == ([0, 8, 4], 0)
    with pytest.raises(StreamResumeError, match="more than the 6 batches"):
        worker_steps(20, 7, num_workers=3, batch_size=4, counts=counts)
