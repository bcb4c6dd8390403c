"""Epoch plans: which (shard, member range) pieces each data-parallel rank and worker reads.

The epoch's shard order is a permutation seeded by (seed, epoch) alone, identical on every
rank. The samples still to read form one sequence in that order; it is cut into equal
contiguous slices by *sample count*, one per data-parallel rank (ceil(R / ranks) each; the
last slices are topped up by repeating samples from the start of the sequence, at most
ranks - 1 samples per epoch, flagged as padding), and each rank's slice into near-equal slices
per worker. Cutting inside a shard is fine: a piece is a member range, and the key index's
offsets let a reader start there. Since the cut only needs the remaining sequence, a resume
with another world size or worker count re-splits exactly what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.wds.consumed import ConsumedSet


@dataclass(frozen=True)
class Task:
    """Read members ``ranges`` (half-open, ascending) of shard ``shard_id``."""

    shard_id: int
    ranges: tuple[tuple[int, int], ...]
    pad: bool = False

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


def shard_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(n).astype(np.int64)


def remaining_segments(order: np.ndarray, counts: np.ndarray, consumed: ConsumedSet | None):
    """(shard, start, stop) arrays of what is left to read, in epoch order."""
    if consumed is None or consumed.consumed == 0:
        keep = counts[order] > 0
        o = order[keep]
        return o, np.zeros(len(o), np.int64), counts[o].astype(np.int64)
    shards, starts, stops = [], [], []
    untouched = ~consumed.done[order]
    partial = set(consumed.partial)
    for s in order[untouched]:
        s = int(s)
        if s in partial:
            for a, b in consumed.unconsumed_ranges(s):
                shards.append(s)
                starts.append(a)
                stops.append(b)
        elif counts[s] > 0:
            shards.append(s)
            starts.append(0)
            stops.append(int(counts[s]))
    return np.asarray(shards, np.int64), np.asarray(starts, np.int64), np.asarray(stops, np.int64)


def _pieces(segs, cum: np.ndarray, a: int, b: int, pad: bool) -> list[tuple[int, int, int, bool]]:
    shards, starts, _stops = segs
    out = []
    i = int(np.searchsorted(cum, a, side="right"))
    while a < b:
        seg_begin = int(cum[i - 1]) if i > 0 else 0
        seg_end = int(cum[i])
        take_end = min(b, seg_end)
        off = int(starts[i])
        out.append((int(shards[i]), off + a - seg_begin, off + take_end - seg_begin, pad))
        a = take_end
        i += 1
    return out


def _merge(pieces: list[tuple[int, int, int, bool]]) -> list[Task]:
    tasks: list[Task] = []
    for shard, a, b, pad in pieces:
        if tasks and tasks[-1].shard_id == shard and tasks[-1].pad == pad and tasks[-1].ranges[-1][1] <= a:
            last = tasks[-1]
            if last.ranges[-1][1] == a:
                ranges = (*last.ranges[:-1], (last.ranges[-1][0], b))
            else:
                ranges = (*last.ranges, (a, b))
            tasks[-1] = Task(shard, ranges, pad)
        else:
            tasks.append(Task(shard, ((a, b),), pad))
    return tasks


@dataclass(frozen=True)
class EpochSplit:
    remaining: int  # samples left in the epoch, all ranks together
    per_rank: int  # samples each data-parallel rank reads (padding included)


def plan_epoch(
    counts: np.ndarray, *, seed: int, epoch: int, shuffle: bool, group_id: int, num_groups: int,
    worker_id: int, num_workers: int, consumed: ConsumedSet | None = None,
) -> tuple[list[Task], EpochSplit]:
    order = shard_order(len(counts), seed, epoch, shuffle)
    segs = remaining_segments(order, counts, consumed)
    lengths = segs[2] - segs[1]
    cum = np.cumsum(lengths)
    total = int(cum[-1]) if len(cum) else 0
    if total == 0:
        return [], EpochSplit(0, 0)
    per_rank = -(-total // num_groups)
    base = group_id * per_rank
    lo = base + (per_rank * worker_id) // num_workers
    hi = base + (per_rank * (worker_id + 1)) // num_workers
    pieces = []
    if lo < total:
        pieces += _pieces(segs, cum, lo, min(hi, total), False)
    if hi > total:
        # Padding repeats the start of the sequence (wrapping as often as needed for tiny sets).
        a = max(lo, total) - total
        b = hi - total
        while a < b:
            step_end = min(b, (a // total + 1) * total)
            pieces += _pieces(segs, cum, a % total, (step_end - 1) % total + 1, True)
            a = step_end
    return _merge(pieces), EpochSplit(total, per_rank)
