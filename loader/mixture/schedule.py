"""Which source gives each sample of a mixture's epoch: a smooth weighted interleave.

Source i gives ``c_i`` samples of an epoch of ``N = sum(c)``. Its j-th sample (j = 0 .. c_i - 1)
gets the key ``(j + 1/2) / c_i`` and the epoch takes the samples of every source in key order
(ties: a seeded order of the sources). That is the Sainte-Laguë (Webster) sequence, a pure
function of the counts, the seed and the epoch; random access to any position costs a bisection,
no table per sample, so a billion-sample epoch plans in microseconds.

**Smoothness.** In every prefix of t samples source i has ``m_i`` with
``|m_i - t * c_i / N| <= (1 + p_i (S - 2)) / 2`` (``p_i = c_i / N``, S sources): below 1 for
two and three sources whatever the shares, i.e. every prefix holds each source's share within
±1 sample (never a run of coin flips that drifts). For four or more sources a share above
``1 / (S - 2)`` can drift up to that bound.

Keys are compared exactly: as 64-bit fixed-point fractions ``floor(key * 2**64)``, distinct for
distinct keys while ``c_i * c_k < 2**62`` (counts below 2**31 samples per source and epoch).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from loader.mixture.definition import MAX_COUNT

KEY_BITS = 64


class Schedule:
    """Position -> (source, j: the source's j-th sample of the epoch)."""

    def __init__(self, counts: list[int], *, seed: int, epoch: int):
        if any(c > MAX_COUNT for c in counts):
            raise ValueError(f"a source gives more than {MAX_COUNT} samples per epoch ({counts}); split it")
        self.counts = [int(c) for c in counts]
        self.size = sum(self.counts)
        # Ties (equal keys of different sources) go to the sources in a seeded order.
        order = np.random.default_rng([seed, epoch, 0x5C4ED]).permutation(len(counts)).tolist()
        self.tie_rank = [0] * len(counts)
        for r, i in enumerate(order):
            self.tie_rank[i] = r
        self._before: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def _count_at_most(self, x: int) -> list[int]:
        """Per source: samples whose key is <= x / 2**KEY_BITS."""
        one = 1 << KEY_BITS
        return [min(c, max(0, ((2 * x * c - one) >> (KEY_BITS + 1)) + 1)) for c in self.counts]

    def before(self, a: int) -> tuple[int, ...]:
        """Per source: how many of the epoch's first ``a`` samples it gives (sums to ``a``)."""
        if not 0 <= a <= self.size:
            raise IndexError(f"position {a} outside the epoch [0, {self.size}]")
        hit = self._before.get(a)
        if hit is not None:
            return hit
        if a == 0:
            out = tuple(0 for _ in self.counts)
        elif a == self.size:
            out = tuple(self.counts)
        else:
            # The smallest grid point x with at least a keys <= x: the a-th key lies in (x - 1, x],
            # and every key there is the same value (keys differ by more than the grid step).
            lo, hi = 0, 1 << KEY_BITS
            while lo < hi:
                mid = (lo + hi) // 2
                if sum(self._count_at_most(mid)) >= a:
                    hi = mid
                else:
                    lo = mid + 1
            below = self._count_at_most(lo - 1)
            at = self._count_at_most(lo)
            tied = sorted((i for i in range(len(at)) if at[i] > below[i]), key=self.tie_rank.__getitem__)
            need = a - sum(below)
            for i in tied[:need]:
                below[i] += 1
            out = tuple(below)
        self._before[a] = out
        if len(self._before) > 64:
            self._before.popitem(last=False)
        return out

    def run(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(sources, j) of positions a .. b - 1."""
        lo, hi = self.before(a), self.before(b)
        src, idx, keys, ranks = [], [], [], []
        for i, (j0, j1) in enumerate(zip(lo, hi, strict=True)):
            if j1 <= j0:
                continue
            j = np.arange(j0, j1, dtype=np.uint64)
            c = self.counts[i]
            # floor((2j + 1) / (2c) * 2**64) = (2j + 1) * q + ((2j + 1) * r) // c, q, r = divmod(2**63, c):
            # every term stays below 2**64 for c < 2**31.
            q, r = divmod(1 << (KEY_BITS - 1), c)
            odd = 2 * j + np.uint64(1)
            keys.append(odd * np.uint64(q) + (odd * np.uint64(r)) // np.uint64(c))
            src.append(np.full(len(j), i, np.int64))
            idx.append(j.astype(np.int64))
            ranks.append(np.full(len(j), self.tie_rank[i], np.int64))
        if not src:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        s, j, k, t = (np.concatenate(x) for x in (src, idx, keys, ranks))
        o = np.lexsort((t, k))
        return s[o], j[o]

    def at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sources, j) of any positions (consecutive runs are computed together)."""
        g = np.asarray(positions, np.int64)
        src, idx = np.empty(len(g), np.int64), np.empty(len(g), np.int64)
        if not len(g):
            return src, idx
        cut = np.flatnonzero(g[1:] != g[:-1] + 1) + 1
        starts = np.concatenate(([0], cut)).tolist()
        stops = np.concatenate((cut, [len(g)])).tolist()
        for a, b in zip(starts, stops, strict=True):
            p = int(g[a])
            src[a:b], idx[a:b] = self.run(p, p + b - a)
        return src, idx
