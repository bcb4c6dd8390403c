"""Shard lists: which batches this process reads, epoch after epoch.

``ShardlistBasic`` deals by data-parallel rank (the global rank), then by DataLoader worker.
``ShardlistBasicParallelSync`` deals by data-parallel *group*: every rank of one tensor- or
context-parallel group reads the same batches in the same order, groups stay disjoint. The
order and the dealing are in ``epoch_plan.py``; nothing consults the clock.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from loader.wds.distributed import DataParallelRank, data_parallel_rank
from loader.wds.epoch_plan import EpochOrder, EpochPlan, Layout, Task

START_INDEX_ENV = "WDS_START_INDEX"
EPOCH_ENV = "WDS_EPOCH_NUM"


def current_worker() -> tuple[int, int]:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


@dataclass(frozen=True)
class PlannedBatch:
    """One batch of this rank's plan: its samples in order (``skip`` of them already consumed)."""

    epoch: int
    index: int  # the batch's place in this rank's plan of the epoch
    skip: int
    shards: np.ndarray
    members: np.ndarray
    pads: np.ndarray
    # Mixtures (``loader.mixture``): per sample, its source (an index into ``source_names``) and
    # how many times it already came this epoch (``__repeat__``); ``None`` for one source.
    sources: np.ndarray | None = None
    repeats: np.ndarray | None = None
    source_names: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.shards)

    def runs(self) -> tuple[list[Task], bool]:
        """(tasks, in order): one task per run of consecutive members of one shard, in the order
        the batch first needs them; ``in order`` when reading them one after another yields the
        batch's own order (each shard's members one run, ascending by one, no shard twice)."""
        tasks, where = replace(self, sources=None).reading()
        return tasks, where is None

    def reading(self) -> tuple[list[Task], np.ndarray | None]:
        """(tasks, where): the tasks of ``runs`` and, unless reading them yields the batch's own
        order (``None``), for each of the batch's samples its place in what the tasks read.

        A mixture's batch switches shards every sample or two: read source by source when that
        reads each source's shards in order (the tasks then go source by source, not in the
        order the batch first needs them); else each (shard, pad) is read once, its members
        ascending, the groups in the order the batch first needs them (as ``runs``). Worked out
        with numpy, not a loop per sample."""
        s, m, p = self.shards, self.members, np.asarray(self.pads, bool)
        n = len(s)
        if not n:
            return [], np.zeros(0, np.int64)
        code = np.asarray(s, np.int64) * 2 + p  # one number per (shard, pad)
        if self.sources is not None:
            # A mixture's batch interleaves its sources, but each source's samples come in that
            # source's own order, which reads in order as one source's batch does: source by source.
            o = np.argsort(self.sources, kind="stable")
            tasks = _in_order(s[o], m[o], p[o], code[o])
            if tasks is not None:
                where = np.empty(n, np.int64)
                where[o] = np.arange(n)
                return tasks, where
        else:
            tasks = _in_order(s, m, p, code)
            if tasks is not None:
                return tasks, None
        _, seen_at, group = np.unique(code, return_index=True, return_inverse=True)
        rank = np.empty(len(seen_at), np.int64)
        rank[np.argsort(seen_at, kind="stable")] = np.arange(len(seen_at))
        group = rank[group.reshape(-1)]
        o = np.lexsort((m, group))
        gs, ms = group[o], m[o]
        new = np.ones(n, bool)  # the first of equal (group, member): a duplicate is read once
        new[1:] = (gs[1:] != gs[:-1]) | (ms[1:] != ms[:-1])
        where = np.empty(n, np.int64)
        where[o] = np.cumsum(new) - 1
        ug, um, uo = gs[new], ms[new], o[new]
        k = len(ug)
        starts = np.ones(k, bool)
        starts[1:] = (ug[1:] != ug[:-1]) | (um[1:] != um[:-1] + 1)
        fi = np.flatnonzero(starts)
        la = np.concatenate((fi[1:] - 1, [k - 1]))
        return _tasks(s[uo[fi]], um[fi], um[la] + 1, p[uo[fi]]), where

    def tasks(self) -> list[Task]:
        """What to read: one task per run of consecutive members of one shard, in the order the
        batch first needs them (a reader starts each run at its member's offset)."""
        return self.runs()[0]


def _tasks(shards: np.ndarray, starts: np.ndarray, stops: np.ndarray, pads: np.ndarray) -> list[Task]:
    return [Task(sh, ((a, b),), pd) for sh, a, b, pd in
            zip(shards.tolist(), starts.tolist(), stops.tolist(), pads.tolist(), strict=True)]


def _in_order(s: np.ndarray, m: np.ndarray, p: np.ndarray, code: np.ndarray) -> list[Task] | None:
    """One task per run of consecutive members of one (shard, pad) (``code``), if no (shard,
    pad) has two runs: then reading the tasks one after another yields this order."""
    cut = np.flatnonzero((code[1:] != code[:-1]) | (m[1:] != m[:-1] + 1)) + 1
    first = np.concatenate(([0], cut))
    if len(first) > 1:
        seen = np.sort(code[first])
        if not (seen[1:] != seen[:-1]).all():
            return None
    last = np.concatenate((cut - 1, [len(s) - 1]))
    return _tasks(s[first], m[first], m[last] + 1, p[first])


class ShardlistBasic:
    def __init__(
        self, counts: np.ndarray, *, seed: int = 0, shuffle: bool = True, infinite: bool = False,
        rank: DataParallelRank | None = None, chunk_size: int = 0,
        start_index: int | None = None, epoch: int | None = None, bucket_ids: np.ndarray | None = None,
        layout: Layout | None = None,
    ):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.bucket_ids = bucket_ids
        self.seed = seed
        self.shuffle = shuffle
        self.infinite = infinite
        self.rank = rank or data_parallel_rank()
        self.chunk_size = chunk_size or int(self.counts.max(initial=1))
        self.layout = layout or Layout()
        # PiD compatibility: WDS_EPOCH_NUM / WDS_START_INDEX (samples this rank already read).
        env_epoch = os.environ.get(EPOCH_ENV)
        env_start = os.environ.get(START_INDEX_ENV)
        self.epoch = epoch if epoch is not None else int(env_epoch or 0)
        self.start_index = start_index if start_index is not None else int(env_start or 0)
        self.start_epoch = self.epoch  # the epoch start_index belongs to (later epochs start at 0)
        # Exact resume: per epoch, the positions consumed before (all ranks) and how far into
        # its own plan this rank already is (batches, samples into the next).
        self.consumed: dict[int, list[tuple[int, int]]] = {}
        self.progress: dict[int, tuple[int, int]] = {}
        self.rotation = 0  # batches this rank handed out before, within this pass: rotates workers
        self._plans: dict[tuple, EpochPlan] = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_layout(self, layout: Layout) -> None:
        self.layout = layout
        self._plans.clear()

    def order(self, epoch: int) -> EpochOrder:
        """The epoch's one order (a mixture's shard list gives its interleave instead)."""
        return EpochOrder(self.counts, self.bucket_ids, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                          layout=self.layout)

    def epoch_size(self) -> int:
        """Samples in one epoch's order."""
        return int(self.counts[self.counts > 0].sum())

    def definition(self) -> dict | None:
        """What, besides the shards, defines the order (a mixture's definition); ``None`` here."""
        return None

    def definition_changes(self, saved: dict | None) -> str:
        """How a resume state's ``mixture`` field differs from this shard list ('' if not)."""
        if saved is not None:
            return f"the state is for the mixture {saved.get('name')!r}, this loader reads one source list"
        return ""

    def planned_batch(self, plan: EpochPlan, epoch: int, k: int, skip: int) -> PlannedBatch:
        shards, members, pads = plan.slots(self.rank.group_id, k, skip)
        return PlannedBatch(epoch, k, skip, shards, members, pads)

    def plan(self, epoch: int) -> EpochPlan:
        """This epoch's plan for every rank, after what ``consumed`` says was read before."""
        consumed = self.consumed.get(epoch, [])
        key = (epoch, tuple(consumed))
        p = self._plans.get(key)
        if p is None:
            if len(self._plans) > 4:
                self._plans.clear()
            p = self._plans[key] = EpochPlan(self.order(epoch), consumed, self.rank.num_groups)
        return p

    def skip(self, epoch: int) -> tuple[int, int]:
        """(batches, samples) of this rank's plan already consumed: from an exact state, or from
        PiD's WDS_START_INDEX (samples this rank read; exact when world size and batch size are
        those of the run that wrote it)."""
        if epoch in self.progress:
            return self.progress[epoch]
        if self.start_index and epoch == self.start_epoch and not self.consumed.get(epoch):
            return self.plan(epoch).progress(self.rank.group_id, self.start_index)
        return 0, 0

    def batches(self, worker_id: int, num_workers: int) -> Iterator[PlannedBatch]:
        """This worker's batches: a rank's k-th batch of the pass goes to worker k mod workers."""
        epoch = self.epoch
        handed = self.rotation  # the rank's batches before this one, in this pass
        while True:
            plan = self.plan(epoch)
            first, partial = self.skip(epoch)
            for k in range(first, plan.batches_per_rank):
                if handed % num_workers == worker_id:
                    yield self.planned_batch(plan, epoch, k, partial if k == first else 0)
                handed += 1
            if not self.infinite:
                return
            epoch += 1

    def __iter__(self) -> Iterator[tuple[int, Task]]:
        """(epoch, task) pairs of this process, batch after batch (what a plain reader needs)."""
        worker_id, num_workers = current_worker()
        for b in self.batches(worker_id, num_workers):
            for t in b.tasks():
                yield b.epoch, t


class ShardlistBasicParallelSync(ShardlistBasic):
    def __init__(
        self, counts: np.ndarray, *, group_id: int | None = None, num_groups: int | None = None,
        dp_group=None, **kwargs,
    ):
        kwargs.pop("rank", None)
        super().__init__(counts, rank=data_parallel_rank(group_id, num_groups, dp_group), **kwargs)
