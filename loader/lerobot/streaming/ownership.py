"""Who reads which episodes: ranks, then DataLoader workers, each a frame-balanced set of whole
episodes, and the number of samples every worker yields per epoch.

Episodes are never split: an episode's windows reach across it, and its MP4 span and parquet rows
are fetched once. Balancing is longest-first onto the least-loaded part (ties to the lowest
part), after a permutation drawn from the seed alone, so ownership is the same every epoch
(caches stay warm) and the same on every rank that computes it.

Every worker of every rank yields ``quota`` samples: its own frames, then padding frames
repeated from its last episode (counted and reported). Equal counts per worker give every rank
the same number of samples and, with a DataLoader taking batches from its workers in turn,
the same number of batches, so no rank waits at the end of an epoch for a batch that never comes.
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


@dataclass(frozen=True)
class Ownership:
    """Episodes of every (rank, worker) for one configuration, and the per-worker quota."""

    parts: tuple[tuple[tuple[EpisodeWork, ...], ...], ...]   # [rank][worker] -> episodes
    quota: int

    @classmethod
    def compute(cls, work: Sequence[EpisodeWork], *, world_size: int, num_workers: int, seed: int,
                allow_empty: bool = False) -> Ownership:
        """``num_workers`` 0 means the training process reads (one part per rank).

        ``allow_empty`` (elastic resumes late in an epoch): a part with nothing left is allowed
        and pads from a donor episode instead of failing.
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
        quota = max((sum(w.remaining for w in p) for rank in parts for p in rank), default=0)
        return cls(parts=tuple(parts), quota=quota)

    def frames(self, rank: int, worker: int) -> int:
        return sum(w.remaining for w in self.parts[rank][worker])

    def padding(self, rank: int, worker: int) -> int:
        return self.quota - self.frames(rank, worker)

    @property
    def num_workers(self) -> int:
        return len(self.parts[0]) if self.parts else 1


def max_workers(work: Sequence[EpisodeWork], *, world_size: int, seed: int) -> int:
    """The most DataLoader workers every rank can feed: the fewest episodes any rank owns."""
    work = [w for w in work if w.remaining > 0]
    ranks = balance(work, world_size, np.random.default_rng([seed, 0x0A11]))
    return min(len(r) for r in ranks) if ranks else 0
