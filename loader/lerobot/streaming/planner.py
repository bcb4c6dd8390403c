"""The exact-coverage episode pool of one worker, as a pure plan: which frame of which episode
each step yields, and the order episodes are fetched in.

The plan is a function of (episodes, sizes, pool size, byte budget, strategy, seed, epoch, rank,
worker) only, never of how fast fetches or decodes run, so a resume can skip to step ``k`` of
the same plan, and a replay of another configuration's plans says exactly which frames it
handed out.

The pool holds at most ``pool_size`` episodes whose sizes (the exact MP4 bytes the reader will
hold for them) sum to at most ``byte_budget``. Episodes enter in a seeded per-epoch order as
soon as both limits allow; an episode leaves when its last frame has been drawn. Frames of an
episode are drawn in frame order (the decoder moves forward), episodes are mixed:

* ``remaining``: each step draws an episode with probability proportional to its remaining
  frames, i.e. a uniformly random remaining frame of the pool;
* ``round_robin``: each round shuffles the episodes resident at its start and draws one frame
  of each; an episode admitted during a round joins the next.

Both visit every frame once. After the worker's own frames come ``padding`` steps (frames
cycled from the last episode, still resident) where its rank needs them to yield as many
batches as every other rank (``ownership``); the items of those steps are marked ``__pad__``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .ownership import EpisodeWork


class EpisodeTooLargeError(ValueError):
    """An episode's MP4 bytes exceed the whole byte budget of a worker: it could never be admitted."""


@dataclass(frozen=True, eq=False)
class WorkerPlan:
    episodes: np.ndarray      # int64 per step: episode index
    frames: np.ndarray        # int64 per step: frame offset inside the episode
    padding: int              # how many of the last steps are padding repeats
    admit_order: tuple[int, ...]   # episodes in the order they enter the pool (fetch order)
    admit_step: tuple[int, ...]    # the step at which each of them enters

    def __len__(self) -> int:
        return len(self.episodes)

    @property
    def real_steps(self) -> int:
        return len(self.episodes) - self.padding

    def uses_from(self, start: int) -> dict[int, int]:
        """Steps at or after ``start`` that read each episode (its reads left after a resume)."""
        eps, counts = np.unique(self.episodes[start:], return_counts=True)
        return dict(zip(eps.tolist(), counts.tolist(), strict=True))

    def consumed(self, steps: int) -> dict[int, int]:
        """Frames of each episode handed out by the first ``steps`` steps (padding excluded)."""
        n = min(steps, self.real_steps)
        eps, counts = np.unique(self.episodes[:n], return_counts=True)
        return dict(zip(eps.tolist(), counts.tolist(), strict=True))


def plan_worker(work: Sequence[EpisodeWork], *, quota: int, pool_size: int, byte_budget: int,
                sizes: Mapping[int, int], strategy: str, seed: int, epoch: int, rank: int,
                worker: int, donor: EpisodeWork | None = None) -> WorkerPlan:
    """The plan of one worker (see the module docstring). ``donor`` pads a worker that has no
    frames left (elastic resume late in an epoch)."""
    for w in work:
        if sizes[w.episode] > byte_budget:
            raise EpisodeTooLargeError(
                f"episode {w.episode} needs {sizes[w.episode]:,} bytes of MP4 data, more than the whole "
                f"byte budget of a worker ({byte_budget:,} bytes = streaming_byte_budget_gb / num_workers). "
                "Raise streaming_byte_budget_gb, use fewer DataLoader workers, or re-encode the dataset "
                "with fewer episodes' worth of data per episode span.")
    rng = np.random.default_rng([seed, epoch, rank, worker, 0x9E0])
    order = [work[i] for i in rng.permutation(len(work))]
    total = sum(w.remaining for w in work)
    if quota < total:
        raise ValueError(f"quota {quota} is below the worker's {total} frames")
    episodes = np.empty(quota, dtype=np.int64)
    frames = np.empty(quota, dtype=np.int64)
    admit_order: list[int] = []
    admit_step: list[int] = []

    # The pool: parallel lists in admission order.
    pool_ep: list[int] = []
    pool_next: list[int] = []
    pool_left: list[int] = []
    used = 0
    nxt = 0

    def admit(step: int) -> None:
        nonlocal used, nxt
        while nxt < len(order) and len(pool_ep) < pool_size and used + sizes[order[nxt].episode] <= byte_budget:
            w = order[nxt]
            pool_ep.append(w.episode)
            pool_next.append(w.start)
            pool_left.append(w.remaining)
            used += sizes[w.episode]
            admit_order.append(w.episode)
            admit_step.append(step)
            nxt += 1

    def take(i: int, step: int) -> None:
        nonlocal used
        episodes[step] = pool_ep[i]
        frames[step] = pool_next[i]
        pool_next[i] += 1
        pool_left[i] -= 1

    def evict_done() -> None:
        nonlocal used
        for i in range(len(pool_ep) - 1, -1, -1):
            if pool_left[i] == 0:
                used -= sizes[pool_ep[i]]
                del pool_ep[i], pool_next[i], pool_left[i]

    step = 0
    admit(0)
    if strategy == "remaining":
        draws = rng.random(total)
        while step < total:
            target = draws[step] * sum(pool_left)
            acc, i = 0, 0
            for i, left in enumerate(pool_left):  # noqa: B007 - i is used after the loop
                acc += left
                if target < acc:
                    break
            take(i, step)
            step += 1
            if pool_left[i] == 0:
                evict_done()
                admit(step)
    elif strategy == "round_robin":
        while step < total:
            members = [pool_ep[i] for i in rng.permutation(len(pool_ep))]
            for ep in members:
                i = pool_ep.index(ep)
                take(i, step)
                step += 1
                if pool_left[i] == 0:
                    evict_done()
                    admit(step)   # joins the next round: `members` is fixed for this one
    else:
        raise ValueError(f"unknown sampling strategy {strategy!r}")
    if nxt != len(order):
        raise AssertionError("planner ended with episodes never admitted")

    padding = quota - total
    if padding:
        last = int(episodes[total - 1]) if total else None
        if last is None:
            if donor is None:
                raise ValueError("a worker with no frames needs a donor episode to pad from")
            last_w = donor
            admit_order.append(donor.episode)
            admit_step.append(0)
        else:
            last_w = next(w for w in work if w.episode == last)
        episodes[total:] = last_w.episode
        frames[total:] = np.arange(padding) % last_w.length
    return WorkerPlan(episodes=episodes, frames=frames, padding=padding,
                      admit_order=tuple(admit_order), admit_step=tuple(admit_step))
