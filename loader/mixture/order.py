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

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loader.mixture.schedule import Schedule
from loader.wds.epoch_plan import EpochOrder, Layout

CHUNK = 4096  # positions worked out together (see MixtureOrder.locate)
KEEP_CHUNKS = 8


def window_start(seed: int, epoch: int, source: int, size: int) -> int:
    """Where source ``source``'s partial pass starts in that pass's order (seeded per epoch)."""
    return int(np.random.default_rng([seed, epoch, source, 0xC4005E]).integers(size))


def source_passes(j: np.ndarray, size: int, per_epoch: int, start: Callable[[], int]) -> tuple[np.ndarray, np.ndarray]:
    """(pass, position in the source's own order) of a source's j-th samples of the epoch (see
    the module docstring); ``start()`` gives the partial pass's seeded start, asked for only
    when one of them is in it. Shared by the twin-tar and the LeRobot mixtures."""
    full = per_epoch // size
    k, local = j // size, j % size
    partial = k == full
    if partial.any():
        local[partial] = (start() + local[partial]) % size
    return k, local


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
        self._starts: dict[int, int] = {}
        self._chunks: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def _order(self, i: int) -> EpochOrder:
        """Source i's own order of this epoch."""
        o = self._orders.get(i)
        if o is None:
            o = self._orders[i] = EpochOrder(self.parts[i].counts, None, seed=self.seed, epoch=self.epoch,
                                             shuffle=self.shuffle, layout=self.layout)
        return o

    def window_start(self, i: int) -> int:
        """Where source i's partial pass starts in that pass's order (seeded per epoch)."""
        start = self._starts.get(i)
        if start is None:
            start = self._starts[i] = window_start(self.seed, self.epoch, i, self.parts[i].size)
        return start

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(shards, members, repeats, sources) of these positions.

        Worked out a chunk of CHUNK positions at a time and kept (a few chunks): a batch is a
        few dozen neighbouring positions, and numpy's cost per call would otherwise dominate."""
        g = np.asarray(positions, np.int64)
        if not len(g):
            return tuple(np.zeros(0, np.int64) for _ in range(4))  # type: ignore[return-value]
        chunk = g // CHUNK
        first, last = int(chunk.min()), int(chunk.max())
        if first == last:
            cols = self._chunk(first)
            at = g - first * CHUNK
            return cols[0][at], cols[1][at], cols[2][at], cols[3][at]
        out = tuple(np.empty(len(g), np.int64) for _ in range(4))
        for c in np.unique(chunk).tolist():
            sel = np.flatnonzero(chunk == c)
            cols = self._chunk(c)
            for o, col in zip(out, cols, strict=True):
                o[sel] = col[g[sel] - c * CHUNK]
        return out  # type: ignore[return-value]

    def _chunk(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        cols = self._chunks.get(c)
        if cols is None:
            if len(self._chunks) >= KEEP_CHUNKS:
                self._chunks.popitem(last=False)
            cols = self._chunks[c] = self._locate(np.arange(c * CHUNK, min((c + 1) * CHUNK, self.size), dtype=np.int64))
        return cols

    def _locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        src, j = self.schedule.at(positions)
        shards, members = np.empty(len(j), np.int64), np.empty(len(j), np.int64)
        passes = np.empty(len(j), np.int64)
        for i in np.unique(src).tolist():
            sel = np.flatnonzero(src == i)
            part = self.parts[i]
            k, local = source_passes(j[sel], part.size, part.per_epoch, lambda i=i: self.window_start(i))
            passes[sel] = k
            sh, mm = self._order(i).samples(local)
            shards[sel], members[sel] = sh + part.offset, mm
        return shards, members, passes, src

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shards, members, _, _ = self.locate(positions)
        return shards, members
