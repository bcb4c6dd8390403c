"""Shard lists: which tasks this process reads, epoch after epoch.

``ShardlistBasic`` splits by data-parallel rank (the global rank), then by DataLoader worker.
``ShardlistBasicParallelSync`` splits by data-parallel *group*: every rank of one tensor- or
context-parallel group reads the same shards in the same order, groups stay disjoint. Both
balance by sample count (see ``plan.py``), never consult the clock, and resume exactly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from loader.wds.consumed import ConsumedSet
from loader.wds.distributed import DataParallelRank, data_parallel_rank
from loader.wds.plan import EpochSplit, Task, plan_epoch

START_INDEX_ENV = "WDS_START_INDEX"
EPOCH_ENV = "WDS_EPOCH_NUM"


def current_worker() -> tuple[int, int]:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class ShardlistBasic:
    def __init__(
        self, counts: np.ndarray, *, seed: int = 0, shuffle: bool = True, infinite: bool = False,
        rank: DataParallelRank | None = None, chunk_size: int = 0,
        start_index: int | None = None, epoch: int | None = None,
    ):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.seed = seed
        self.shuffle = shuffle
        self.infinite = infinite
        self.rank = rank or data_parallel_rank()
        self.chunk_size = chunk_size or int(self.counts.max(initial=1))
        # PiD compatibility: WDS_EPOCH_NUM / WDS_START_INDEX (samples this rank already read).
        env_epoch = os.environ.get(EPOCH_ENV)
        env_start = os.environ.get(START_INDEX_ENV)
        self.epoch = epoch if epoch is not None else int(env_epoch or 0)
        self.start_index = start_index if start_index is not None else int(env_start or 0)
        self.start_epoch = self.epoch  # the epoch start_index belongs to (later epochs start at 0)
        self.consumed: dict[int, ConsumedSet] = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_consumed(self, consumed: dict[int, ConsumedSet]) -> None:
        """Exact resume: these samples are skipped (takes precedence over WDS_START_INDEX)."""
        self.consumed = consumed
        if consumed:
            self.start_index = 0

    def tasks(self, epoch: int, worker_id: int, num_workers: int) -> tuple[list[Task], EpochSplit]:
        tasks, split = plan_epoch(
            self.counts, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
            group_id=self.rank.group_id, num_groups=self.rank.num_groups,
            worker_id=worker_id, num_workers=num_workers, consumed=self.consumed.get(epoch),
        )
        if self.start_index and epoch == self.start_epoch:
            # As PiD: samples read -> shards read (// chunk_size) -> shards per worker to skip.
            skip = (self.start_index // self.chunk_size) // num_workers
            tasks = tasks[skip:]
        return tasks, split

    def __iter__(self) -> Iterator[tuple[int, Task]]:
        worker_id, num_workers = current_worker()
        epoch = self.epoch
        while True:
            tasks, _ = self.tasks(epoch, worker_id, num_workers)
            for t in tasks:
                yield epoch, t
            if not self.infinite:
                return
            epoch += 1


class ShardlistBasicParallelSync(ShardlistBasic):
    def __init__(
        self, counts: np.ndarray, *, group_id: int | None = None, num_groups: int | None = None,
        dp_group=None, **kwargs,
    ):
        kwargs.pop("rank", None)
        super().__init__(counts, rank=data_parallel_rank(group_id, num_groups, dp_group), **kwargs)
