"""Epoch plans: one sample order per epoch, cut into batches, dealt to ranks and workers.

**The order** of an epoch is a function of ``(seed, epoch)``, the shard list and the order
``Layout`` only, never of the world size or the worker count:

1. the shards are permuted by ``(seed, epoch)`` (identity without ``shuffle``);
2. their members, in member order, form *streams*: one stream of every sample, or with
   ``same_aspect`` one stream per aspect bucket (a shard belongs to one bucket);
3. with a shuffle ``window`` w > 1, each stream is permuted within consecutive windows of w
   stream positions, seeded by ``(seed, epoch, stream, window)``;
4. one stream is the order itself. With ``same_aspect``, each bucket's stream is cut into
   chunks of ``block`` samples; the full chunks are ordered by where their first sample comes
   in the shard order, and each bucket's short last chunk follows, in that same order. So
   a batch never mixes buckets, and the order depends on ``block`` (the batch size) here.

A sample's place in that order is its *position* (0 .. N-1).

**Batches.** What is still to read (positions not consumed: everything at an epoch's start)
is cut into batches: ``block`` consecutive samples each (the last may be short), or with
``same_aspect`` the remaining part of each chunk. Batches are dealt in *steps* of one batch per
data-parallel rank: rank r takes batch ``k * ranks + r`` in step k, so the concatenation of the
ranks' batches in step order is the order itself. The last step is split so that every rank
still gets one batch: its samples are cut into ``ranks`` equal parts, topped up with at most
``ranks - 1`` repeats of the epoch's first positions (flagged padding); with ``same_aspect``
its chunks are split into ``ranks`` single-bucket parts (padding only when fewer samples than
ranks remain). Every rank gets the same number of batches, every batch but the last of the
epoch has ``block`` samples (with ``same_aspect``: but the last few, one per bucket), and
``drop_last`` drops every batch that is not full and the incomplete last step.

**Workers.** A rank's batch k is read by DataLoader worker ``k mod workers`` (rotated by the
batches already handed out), which is the order in which the DataLoader collects them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

UNBATCHED_BLOCK = 64  # samples per block dealt to a rank when the loader does not batch


@dataclass(frozen=True)
class Task:
    """Read members ``ranges`` (half-open, ascending) of shard ``shard_id``."""

    shard_id: int
    ranges: tuple[tuple[int, int], ...]
    pad: bool = False

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


@dataclass(frozen=True)
class Layout:
    """What, besides (seed, epoch) and the shards, defines an epoch's order and its batches."""

    block: int = UNBATCHED_BLOCK  # samples per batch
    same_aspect: bool = False  # batches never mix aspect buckets (the order depends on block)
    drop_last: bool = False  # leave out batches that are not full
    window: int = 0  # shuffle window in stream positions (0 or 1: none)

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"batch size must be >= 1, got {self.block}")


def shard_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(n).astype(np.int64)


def merge_intervals(starts: np.ndarray, stops: np.ndarray) -> list[tuple[int, int]]:
    """Union of half-open intervals, as sorted disjoint (start, stop) pairs."""
    keep = stops > starts
    starts, stops = np.asarray(starts)[keep], np.asarray(stops)[keep]
    if not len(starts):
        return []
    o = np.argsort(starts, kind="stable")
    starts, stops = starts[o], np.maximum.accumulate(stops[o])
    new = np.concatenate(([True], starts[1:] > stops[:-1]))
    first = np.flatnonzero(new)
    last = np.concatenate((first[1:] - 1, [len(starts) - 1]))
    return [(int(a), int(b)) for a, b in zip(starts[first], stops[last], strict=True)]


class EpochOrder:
    """Position -> (shard, member) for one epoch (see the module docstring)."""

    def __init__(self, counts: np.ndarray, bucket_ids: np.ndarray | None, *, seed: int, epoch: int,
                 shuffle: bool, layout: Layout):
        self.seed, self.epoch, self.layout = seed, epoch, layout
        counts = np.asarray(counts, np.int64)
        self.counts = counts
        order = shard_order(len(counts), seed, epoch, shuffle)
        order = order[counts[order] > 0]
        self.size = int(counts[order].sum())
        if layout.same_aspect and bucket_ids is not None and len(order):
            b = np.asarray(bucket_ids)[order]
            self.streams = [order[b == u] for u in np.unique(b)]
        else:
            self.streams = [order]
        self.stream_ends = [np.cumsum(counts[s]) for s in self.streams]
        self.chunked = layout.same_aspect
        if self.chunked:
            self._chunks(order)
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _chunks(self, order: np.ndarray) -> None:
        """Chunk table: stream, first stream position, size, first position; in epoch order."""
        block = self.layout.block
        shard_start = np.zeros(len(self.counts), np.int64)  # position of a shard's member 0 in shard order
        shard_start[order] = np.cumsum(self.counts[order]) - self.counts[order]
        full, short = [], []
        for s, (shards, ends) in enumerate(zip(self.streams, self.stream_ends, strict=True)):
            n = int(ends[-1]) if len(ends) else 0
            q0 = np.arange(0, n, block, dtype=np.int64)
            i = np.searchsorted(ends, q0, side="right")
            key = shard_start[shards[i]] + q0 - (ends[i] - self.counts[shards[i]])
            size = np.minimum(q0 + block, n) - q0
            rows = np.stack([key, np.full(len(q0), s), q0, size], axis=1)
            full.append(rows[size == block])
            short.append(rows[size < block])
        table = [np.concatenate(x) if x else np.zeros((0, 4), np.int64) for x in (full, short)]
        table = np.concatenate([t[np.argsort(t[:, 0], kind="stable")] for t in table])
        self.chunk_stream, self.chunk_q0, self.chunk_size = table[:, 1], table[:, 2], table[:, 3]
        self.chunk_start = np.cumsum(self.chunk_size) - self.chunk_size

    def _perm(self, stream: int, window: int, size: int) -> np.ndarray:
        key = (stream, window)
        p = self._perms.get(key)
        if p is None:
            if len(self._perms) > 64:
                self._perms.clear()
            p = self._perms[key] = np.random.default_rng(
                [self.seed, self.epoch, stream, window, 0x5F1]).permutation(size)
        return p

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard ids, member indexes) of these positions."""
        g = np.asarray(positions, np.int64)
        if self.chunked:
            c = np.searchsorted(self.chunk_start, g, side="right") - 1
            stream, q = self.chunk_stream[c], self.chunk_q0[c] + g - self.chunk_start[c]
        else:
            stream, q = np.zeros(len(g), np.int64), g
        shards, members = np.empty(len(g), np.int64), np.empty(len(g), np.int64)
        w = self.layout.window
        for s in np.unique(stream):
            sel = stream == s
            qs = q[sel]
            ends = self.stream_ends[s]
            if w > 1:
                n = int(ends[-1])
                win = qs // w
                out = qs.copy()
                for wi in np.unique(win):
                    at = win == wi
                    base = int(wi) * w
                    out[at] = base + self._perm(int(s), int(wi), min(w, n - base))[qs[at] - base]
                qs = out
            i = np.searchsorted(ends, qs, side="right")
            sh = self.streams[s][i]
            shards[sel], members[sel] = sh, qs - (ends[i] - self.counts[sh])
        return shards, members


class Remaining:
    """The positions of an epoch not yet consumed, numbered 0 .. R-1 in order ("indexes")."""

    def __init__(self, size: int, consumed: list[tuple[int, int]]):
        edges = [0]
        for a, b in consumed:
            edges += [a, b]
        edges.append(size)
        e = np.asarray(edges, np.int64).reshape(-1, 2)
        e = e[e[:, 1] > e[:, 0]]
        self.free_start, self.free_len = e[:, 0], e[:, 1] - e[:, 0]
        self.free_end_index = np.cumsum(self.free_len)
        self.count = int(self.free_end_index[-1]) if len(e) else 0

    def to_positions(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, np.int64)
        seg = np.searchsorted(self.free_end_index, idx, side="right")
        return self.free_start[seg] + idx - (self.free_end_index[seg] - self.free_len[seg])

    def to_index(self, positions: np.ndarray) -> np.ndarray:
        """How many remaining positions come before each position."""
        g = np.asarray(positions, np.int64)
        seg = np.searchsorted(self.free_start, g, side="right") - 1
        inside = np.minimum(g - self.free_start[np.maximum(seg, 0)], self.free_len[np.maximum(seg, 0)])
        before = np.where(seg >= 0, self.free_end_index[np.maximum(seg, 0)] - self.free_len[np.maximum(seg, 0)], 0)
        return np.where(seg >= 0, before + inside, 0)

    def intervals(self, a: int, b: int) -> list[tuple[int, int]]:
        """Positions of indexes [a, b), as intervals (an index range may span consumed holes)."""
        out = []
        while a < b:
            seg = int(np.searchsorted(self.free_end_index, a, side="right"))
            seg_end = int(self.free_end_index[seg])
            take = min(b, seg_end)
            g = int(self.free_start[seg]) + a - (seg_end - int(self.free_len[seg]))
            out.append((g, g + take - a))
            a = take
        return out


@dataclass(frozen=True)
class RankBatch:
    """Indexes [start, stop) of the remaining order, then ``pads`` (positions repeated as padding)."""

    start: int
    stop: int
    pads: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return self.stop - self.start + len(self.pads)


class EpochPlan:
    """The batches of every data-parallel rank for one epoch, given what was consumed before."""

    def __init__(self, order: EpochOrder, consumed: list[tuple[int, int]], num_ranks: int):
        self.order, self.ranks, self.consumed = order, num_ranks, consumed
        layout = order.layout
        B, W = layout.block, num_ranks
        self.B = B
        self.remaining = rem = Remaining(order.size, consumed)
        self.R = R = rem.count
        # Without same-aspect chunks batch i is [i*B, min((i+1)*B, R)) of the remaining order:
        # computed, not stored (a table would hold one entry per batch: 250 MB at 1e9 samples).
        self.starts: np.ndarray | None = None
        self.stops: np.ndarray | None = None
        if order.chunked:
            starts = rem.to_index(order.chunk_start)
            stops = rem.to_index(order.chunk_start + order.chunk_size)
            keep = stops > starts
            if layout.drop_last:
                keep &= stops - starts == B
            self.starts, self.stops = starts[keep], stops[keep]
            T = len(self.starts)
        else:
            T = R // B if layout.drop_last else -(-R // B)
        self.T = T
        if layout.drop_last:
            self.full_steps = T // W
            self.tail: list[RankBatch] | None = None
        else:
            self.full_steps = T // W if (order.chunked and T % W == 0) else max(0, -(-T // W) - 1)
            if self.full_steps * W < T:
                starts, stops = self._bounds(self.full_steps * W, T)
                self.tail = self._split_tail(starts, stops)
            else:
                self.tail = None
        self.batches_per_rank = self.full_steps + (self.tail is not None)

    def _bounds(self, first: int, stop: int, step: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Starts and stops (remaining-order indexes) of batches first, first + step, ... < stop."""
        if self.starts is None or self.stops is None:
            a = np.arange(first, stop, step, dtype=np.int64) * self.B
            return a, np.minimum(a + self.B, self.R)
        return self.starts[first:stop:step], self.stops[first:stop:step]

    def _pad(self, ordinal: int) -> int:
        return ordinal % self.order.size

    def _split_tail(self, starts: np.ndarray, stops: np.ndarray) -> list[RankBatch]:
        W = self.ranks
        if not self.order.chunked:
            a0, end = int(starts[0]), int(stops[-1])
            q = -(-(end - a0) // W)
            out = []
            for r in range(W):
                a, b = a0 + r * q, a0 + (r + 1) * q
                lo, hi = min(a, end), min(b, end)
                pads = tuple(self._pad(o - end) for o in range(max(a, end), b))
                out.append(RankBatch(lo, hi, pads))
            return out
        sizes = (stops - starts).tolist()
        total = sum(sizes)
        if total < W:  # one sample each, then padding
            out = [RankBatch(i, i + 1) for a, b in zip(starts.tolist(), stops.tolist(), strict=True)
                   for i in range(a, b)]
            return out + [RankBatch(0, 0, (self._pad(o),)) for o in range(W - total)]
        parts = [1] * len(sizes)
        for _ in range(W - len(sizes)):  # split the chunk with the largest parts, earliest on ties
            i = max((i for i in range(len(sizes)) if parts[i] < sizes[i]),
                    key=lambda i: (-(-sizes[i] // parts[i]), -i))
            parts[i] += 1
        out = []
        for a, n, p in zip(starts.tolist(), sizes, parts, strict=True):
            for j in range(p):
                lo = a + j * (n // p) + min(j, n % p)
                out.append(RankBatch(lo, lo + n // p + (j < n % p)))
        return out

    def batch(self, rank: int, k: int) -> RankBatch:
        if k < self.full_steps:
            i = k * self.ranks + rank
            if self.starts is None or self.stops is None:
                return RankBatch(i * self.B, min((i + 1) * self.B, self.R))
            return RankBatch(int(self.starts[i]), int(self.stops[i]))
        if k == self.full_steps and self.tail is not None:
            return self.tail[rank]
        raise IndexError(f"rank {rank} has {self.batches_per_rank} batches, not {k + 1}")

    def rank_samples(self, rank: int) -> int:
        if self.starts is None:
            full = self.full_steps * self.B  # every batch before the tail is whole
        else:
            starts, stops = self._bounds(rank, self.full_steps * self.ranks, self.ranks)
            full = int((stops - starts).sum())
        return full + (self.tail[rank].size if self.tail is not None else 0)

    def progress(self, rank: int, samples: int) -> tuple[int, int]:
        """(whole batches, samples into the next) that the first ``samples`` of a rank's plan make."""
        k = 0
        while k < self.batches_per_rank and samples >= (n := self.batch(rank, k).size):
            samples -= n
            k += 1
        return k, (samples if k < self.batches_per_rank else 0)

    def positions(self, rank: int, k: int, skip: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(positions, pad flags) of a rank's batch k in order, its first ``skip`` left out."""
        b = self.batch(rank, k)
        real = self.remaining.to_positions(np.arange(b.start, b.stop, dtype=np.int64))
        positions = np.concatenate((real, np.asarray(b.pads, np.int64)))[skip:]
        return positions, (np.arange(b.size) >= b.stop - b.start)[skip:]

    def slots(self, rank: int, k: int, skip: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shards, members, pad flags) of a rank's batch k in order, its first ``skip`` left out."""
        positions, pads = self.positions(rank, k, skip)
        shards, members = self.order.samples(positions)
        return shards, members, pads

    def consumed_after(self, progress: dict[int, tuple[int, int]]) -> list[tuple[int, int]]:
        """Positions consumed once each rank in ``progress`` (rank -> (batches, samples into the
        next)) has consumed that much of its plan, plus what was consumed before this plan."""
        if not progress:
            return list(self.consumed)
        W = self.ranks
        low = min(c for c, _ in progress.values())
        low_full = min(low, self.full_steps)
        # Every rank has all of steps < low_full: one vectorised union (one interval unchunked).
        if self.starts is None or self.stops is None:
            idx_starts = [np.asarray([0], np.int64)] if low_full else []
            idx_stops = [np.asarray([low_full * W * self.B], np.int64)] if low_full else []
        else:
            idx_starts, idx_stops = [self.starts[: low_full * W]], [self.stops[: low_full * W]]
        extra: list[tuple[int, int]] = []
        for rank, (c, s) in progress.items():
            for k in range(low_full, min(c + (s > 0), self.batches_per_rank)):
                b = self.batch(rank, k)
                stop = b.stop if k < c else min(b.stop, b.start + s)
                extra.append((b.start, stop))
        idx = merge_intervals(np.concatenate([*idx_starts, np.asarray([a for a, _ in extra], np.int64)]),
                              np.concatenate([*idx_stops, np.asarray([b for _, b in extra], np.int64)]))
        pos = [iv for a, b in idx for iv in self.remaining.intervals(a, b)]
        pos += list(self.consumed)
        return merge_intervals(np.asarray([a for a, _ in pos], np.int64), np.asarray([b for _, b in pos], np.int64))
