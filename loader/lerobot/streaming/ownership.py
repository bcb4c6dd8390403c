"""Who reads which episodes: ranks, then DataLoader workers, each a frame-balanced set of whole
episodes, and the number of samples every worker yields per epoch.

Episodes are never split: an episode's windows reach across it, and its MP4 span and parquet rows
are fetched once. Balancing is longest-first onto the least-loaded part (ties to the lowest
part), after a permutation drawn from the seed alone, so ownership is the same every epoch
(caches stay warm) and the same on every rank that computes it.

Padding only where a contract needs it: every rank must yield the same number of batches (DDP
steps in lockstep; a rank short of a batch would leave the others waiting). Each worker yields
its own frames, then, on a rank that would yield fewer batches than the busiest, the fewest
repeated frames that give it as many (``pads``): a worker yields ``counts[rank][worker]`` samples
in all. The workers of one rank are *not* evened out: the DataLoader takes batches from its
workers in turn, skipping a worker once it is exhausted, which is a fixed order whatever the
counts are, so an exact resume needs no padding between them (``state.worker_steps``). With one
stream per rank (no workers, or one) ranks are evened out to the same number of samples, which
gives the same number of batches for any batch size. Every repeat is marked ``__pad__`` in its
item; ``pad=False`` (the loader's ``drop_last=True``) pads nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class NoEpisodesError(ValueError):
    """A rank or DataLoader worker would own no episode."""


@dataclass(frozen=True)
class EpisodeWork:
    """One episode a worker visits this epoch: frames ``start .. length-1`` (start > 0 only after
    an elastic resume took its first frames elsewhere)."""

    episode: int
    length: int
    start: int = 0

    @property
    def remaining(self) -> int:
        return self.length - self.start


def balance(work: Sequence[EpisodeWork], parts: int, rng: np.random.Generator) -> list[list[EpisodeWork]]:
    """Split ``work`` into ``parts`` lists of whole episodes with near-equal remaining frames."""
    order = rng.permutation(len(work))
    # Stable sort of the permuted list: equal lengths keep the seeded order.
    ranked = sorted((work[i] for i in order), key=lambda w: -w.remaining)
    out: list[list[EpisodeWork]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for w in ranked:
        p = min(range(parts), key=lambda i: (loads[i], i))
        out[p].append(w)
        loads[p] += w.remaining
    for part in out:
        part.sort(key=lambda w: w.episode)
    return out


def batches_of(samples: int, batch_size: int, drop_last: bool = False) -> int:
    """The batches a DataLoader worker makes of ``samples`` (its last one short, or left out)."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def _even_out(frames: list[list[int]], batch_size: int) -> list[list[int]]:
    """Samples per (rank, worker): ``frames`` plus the fewest repeats that give every rank the
    batches of the busiest one (``batch_size`` 1 also evens out samples)."""
    target = max((sum(batches_of(n, batch_size) for n in rank) for rank in frames), default=0)
    counts = [list(rank) for rank in frames]
    for rank in counts:
        missing = target - sum(batches_of(n, batch_size) for n in rank)
        for _ in range(missing):
            # One more batch on the worker where it costs the fewest repeats: fill its short last
            # batch, plus one sample. Ties: the worker with fewer samples, then the lowest one.
            cost = [(-n % batch_size) + 1 for n in rank]
            w = min(range(len(rank)), key=lambda i: (cost[i], rank[i], i))
            rank[w] += cost[w]
    return counts


@dataclass(frozen=True)
class Ownership:
    """Episodes of every (rank, worker) for one configuration, and how many samples each yields."""

    parts: tuple[tuple[tuple[EpisodeWork, ...], ...], ...]   # [rank][worker] -> episodes
    counts: tuple[tuple[int, ...], ...]                      # [rank][worker] -> samples (frames + pads)

    @classmethod
    def compute(cls, work: Sequence[EpisodeWork], *, world_size: int, num_workers: int, seed: int,
                allow_empty: bool = False, batch_size: int | None = None, pad: bool = True) -> Ownership:
        """``num_workers`` 0 means the training process reads (one part per rank).

        ``allow_empty`` (elastic resumes late in an epoch): a part with nothing left is allowed
        and pads from a donor episode instead of failing. ``batch_size``: of the DataLoader with
        more than one worker (ranks are evened out to its batches); ``pad=False``: no repeats.
        """
        work = [w for w in work if w.remaining > 0]
        n = max(1, num_workers)
        ranks = balance(work, world_size, np.random.default_rng([seed, 0x0A11]))
        parts = []
        for r, mine in enumerate(ranks):
            if not mine and not allow_empty:
                raise NoEpisodesError(
                    f"rank {r} of {world_size} owns no episode: only {len(work)} episodes are selected. "
                    "Reduce the number of ranks so that each rank owns at least one of the selected episodes "
                    "(or select more episodes).")
            split = balance(mine, n, np.random.default_rng([seed, 0x0A12, r]))
            for w, part in enumerate(split):
                if not part and not allow_empty:
                    raise NoEpisodesError(
                        f"DataLoader worker {w} of rank {r} owns no episode: the rank owns {len(mine)} "
                        f"episodes and num_workers={num_workers}. A worker needs at least one episode: "
                        f"use num_workers <= {max_workers(work, world_size=world_size, seed=seed)} "
                        "(StreamingLeRobotDataset.num_workers_for(...) gives it).")
            parts.append(tuple(tuple(p) for p in split))
        frames = [[sum(w.remaining for w in p) for p in rank] for rank in parts]
        if pad:
            # One stream per rank: even out samples. Several workers: batches, as the DataLoader cuts them.
            frames = _even_out(frames, batch_size if n > 1 and batch_size else 1)
        return cls(parts=tuple(parts), counts=tuple(tuple(rank) for rank in frames))

    def frames(self, rank: int, worker: int) -> int:
        return sum(w.remaining for w in self.parts[rank][worker])

    def count(self, rank: int, worker: int) -> int:
        """Samples worker ``worker`` of rank ``rank`` yields: its frames, then its padding."""
        return self.counts[rank][worker]

    def padding(self, rank: int, worker: int) -> int:
        return self.count(rank, worker) - self.frames(rank, worker)

    def rank_samples(self, rank: int) -> int:
        return sum(self.counts[rank])

    @property
    def num_workers(self) -> int:
        return len(self.parts[0]) if self.parts else 1


def max_workers(work: Sequence[EpisodeWork], *, world_size: int, seed: int) -> int:
    """The most DataLoader workers every rank can feed: the fewest episodes any rank owns."""
    work = [w for w in work if w.remaining > 0]
    ranks = balance(work, world_size, np.random.default_rng([seed, 0x0A11]))
    return min(len(r) for r in ranks) if ranks else 0
