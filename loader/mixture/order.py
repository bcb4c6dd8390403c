"""A mixture's epoch order: each source's own one-order plan, interleaved by the schedule.

Source i gives ``c_i`` samples of the epoch (``Mixture.counts``) out of its ``n_i``. Its j-th
sample (the schedule says where in the epoch it goes) is, with ``k = j // n_i``:

* for ``k < c_i // n_i`` (a full pass): position ``j mod n_i`` of the source's pass-k order;
* in the last, partial pass (``c_i mod n_i`` samples: all of a ``choose`` below the size, or
  the fraction of a ``repeat`` like 0.5 or 1.5): the ``c_i mod n_i`` consecutive positions of
  the pass's order from a seeded start, wrapping, so each epoch chooses other samples, each
  once.

Every pass reads the source's own order of the epoch (``loader/wds/epoch_plan.py``: what
``build_dataset`` of that source alone gives with the same seed). The schedule spreads a
source's samples evenly over the epoch, so the repeats of a sample are exactly ``n_i`` of its
source's samples apart (about ``N * n_i / c_i`` positions): as far apart as the epoch allows. A
sample of pass k carries ``__repeat__ = k``: it came k times before in this epoch.

Everything is a pure function of (seed, epoch, the sources' shard counts, the definition).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.mixture.schedule import Schedule
from loader.wds.epoch_plan import EpochOrder, Layout


@dataclass(frozen=True)
class Part:
    """One source as the order sees it: its shards' place in the mixture's table, their counts."""

    offset: int
    counts: np.ndarray
    per_epoch: int

    @property
    def size(self) -> int:
        return int(self.counts.sum())


class MixtureOrder:
    """Position -> (shard, member, repeat, source) for one epoch of a mixture."""

    chunked = False  # EpochPlan: batches are plain stretches of the order

    def __init__(self, parts: list[Part], *, seed: int, epoch: int, shuffle: bool, layout: Layout):
        self.parts, self.seed, self.epoch, self.shuffle, self.layout = parts, seed, epoch, shuffle, layout
        self.schedule = Schedule([p.per_epoch for p in parts], seed=seed, epoch=epoch)
        self.size = self.schedule.size
        self._orders: dict[int, EpochOrder] = {}

    def _order(self, i: int) -> EpochOrder:
        """Source i's own order of this epoch."""
        o = self._orders.get(i)
        if o is None:
            o = self._orders[i] = EpochOrder(self.parts[i].counts, None, seed=self.seed, epoch=self.epoch,
                                             shuffle=self.shuffle, layout=self.layout)
        return o

    def window_start(self, i: int) -> int:
        """Where source i's partial pass starts in that pass's order (seeded per epoch)."""
        return int(np.random.default_rng([self.seed, self.epoch, i, 0xC4005E]).integers(self.parts[i].size))

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(shards, members, repeats, sources) of these positions."""
        src, j = self.schedule.at(positions)
        shards, members = np.empty(len(j), np.int64), np.empty(len(j), np.int64)
        passes = np.empty(len(j), np.int64)
        for i in np.unique(src).tolist():
            sel = np.flatnonzero(src == i)
            part = self.parts[i]
            n = part.size
            full = part.per_epoch // n
            k, local = j[sel] // n, j[sel] % n
            partial = k == full
            if partial.any():
                local[partial] = (self.window_start(i) + local[partial]) % n
            passes[sel] = k
            sh, mm = self._order(i).samples(local)
            shards[sel], members[sel] = sh + part.offset, mm
        return shards, members, passes, src

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shards, members, _, _ = self.locate(positions)
        return shards, members
