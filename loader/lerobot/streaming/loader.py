"""``make_loader``: a DataLoader over a StreamingLeRobotDataset that counts what it hands out,
so ``state_dict()`` resumes exactly, and that advances the epoch each pass.

Only batches handed to the training loop count; samples decoded ahead in workers are read
again after a restore. ``state_dict`` is a collective call under torch.distributed (every rank
calls it; each gets every rank's counts, so a checkpoint from any rank restores them all).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from loader.workers import worker_init

from .dataset import STAT_FIELDS, StreamingLeRobotDataset, _all_gather_ints
from .ownership import NoEpisodesError
from .state import make_state, parse_state


class StreamingLoader:
    def __init__(self, dataset: StreamingLeRobotDataset, *, batch_size: int | None = 1, num_workers: int = 0,
                 **dataloader_kwargs: Any):
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be a non-negative integer, got {num_workers!r}")
        for bad in ("shuffle", "sampler", "batch_sampler"):
            if dataloader_kwargs.get(bad):
                raise ValueError(f"{bad}= does not apply: the dataset's episode pools order the samples "
                                 "(set seed= and streaming_sampling_strategy= on the dataset)")
        if dataloader_kwargs.get("persistent_workers"):
            raise ValueError("persistent_workers=True does not apply: each epoch's plan (and a resume point) "
                             "reaches the workers when they start; use persistent_workers=False")
        most = dataset.num_workers_for(num_workers)
        if most < num_workers:
            raise NoEpisodesError(
                f"num_workers={num_workers}, but the smallest rank owns only {most} episodes and each "
                f"worker needs one: use num_workers={most} (dataset.num_workers_for({num_workers})).")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.dataloader_kwargs = dataloader_kwargs
        # drop_last=True: no padding repeats at all (and, as in PyTorch, each worker's short last
        # batch is left out); ranks may then yield different numbers of batches.
        self.drop_last = bool(dataloader_kwargs.get("drop_last", False))
        dataset._batch_size, dataset._drop_last = batch_size, self.drop_last
        self.epoch = dataset.epoch
        self.samples = 0
        self.batches = 0
        # One row of counters per worker, in shared memory: workers write, stats() reads.
        self._shared = torch.zeros((max(1, num_workers), len(STAT_FIELDS)), dtype=torch.int64).share_memory_()

    def __iter__(self) -> Iterator[Any]:
        ds = self.dataset
        if ds.epoch != self.epoch:
            ds.set_epoch(self.epoch)
        ds._batch_size, ds._drop_last = self.batch_size, self.drop_last
        ds._shared_stats = self._shared
        setup = ds.prepare_epoch(self.num_workers)
        self._layout = setup.layout
        if setup.point is None:
            self.samples = self.batches = 0
        self._shared.zero_()
        kwargs = dict(self.dataloader_kwargs)
        kwargs["worker_init_fn"] = worker_init(kwargs.get("worker_init_fn"))  # workers die with us
        loader = DataLoader(ds, batch_size=self.batch_size, num_workers=self.num_workers, **kwargs)
        for batch in loader:
            self.samples += _batch_len(batch) if self.batch_size is not None else 1
            self.batches += 1
            yield batch
        self.epoch += 1
        self.samples = self.batches = 0

    def __len__(self) -> int:
        """Batches this rank yields in a fresh epoch (every rank the same, but with drop_last)."""
        ds = self.dataset
        ds._batch_size, ds._drop_last = self.batch_size, self.drop_last
        if self.batch_size is None:
            return ds.samples_per_rank(self.num_workers)
        return ds.batches_per_rank(self.num_workers, self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)
        self.epoch = epoch
        self.samples = self.batches = 0

    def state_dict(self) -> dict[str, Any]:
        ds = self.dataset
        setup = ds._setup if ds._setup is not None and ds._setup.epoch == self.epoch else None
        layout = setup.layout if setup is not None else ds.layout(self.num_workers)
        return make_state(fingerprint=ds.fingerprint, epoch=self.epoch, layout=layout,
                          batch_size=self.batch_size if self.num_workers else None,
                          samples=_all_gather_ints(self.samples), batches=_all_gather_ints(self.batches),
                          drop_last=self.drop_last)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        point = parse_state(state, fingerprint=self.dataset.fingerprint)
        self.dataset.load_state_dict(state)
        self.epoch = point.epoch
        rank = self.dataset.rank
        same_world = point.layout.world_size == self.dataset.world_size
        self.samples = point.samples[rank] if same_world else 0
        self.batches = point.batches[rank] if same_world and point.batches is not None else 0

    def stats(self) -> dict[str, int]:
        """Counters summed over this rank's workers (live while iterating)."""
        if self.num_workers == 0:
            return self.dataset.stats()
        sums = self._shared.sum(dim=0).tolist()
        out = dict(zip(STAT_FIELDS, (int(v) for v in sums), strict=True))
        out["peak_reserved_bytes"] = int(self._shared[:, STAT_FIELDS.index("peak_reserved_bytes")].max())
        return out

    def worker_stats(self) -> list[dict[str, int]]:
        return [dict(zip(STAT_FIELDS, (int(v) for v in row), strict=True)) for row in self._shared.tolist()]


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        v = batch.get("index")
        if v is not None:
            return len(v)
        return len(next(iter(batch.values())))
    return len(batch)


def make_loader(dataset: StreamingLeRobotDataset, *, batch_size: int | None = 1, num_workers: int = 0,
                **dataloader_kwargs: Any) -> StreamingLoader:
    """A resumable DataLoader over ``dataset`` (``num_workers`` capped by nothing: too many for the
    episodes a rank owns is an error naming the number to use)."""
    return StreamingLoader(dataset, batch_size=batch_size, num_workers=num_workers, **dataloader_kwargs)
