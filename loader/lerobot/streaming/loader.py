"""``make_loader``: a DataLoader over a StreamingLeRobotDataset that counts what it hands out,
so ``state_dict()`` resumes exactly, and that advances the epoch each pass.

Only batches handed to the training loop count; samples decoded ahead in workers are read
again after a restore. ``state_dict`` is a collective call under torch.distributed (every rank
calls it; each gets every rank's counts, so a checkpoint from any rank restores them all).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from loader.handoff import BufferLender
from loader.workers import worker_init

from .collate import PackedBatch
from .control import control_block, write_control
from .dataset import STAT_FIELDS, StreamingLeRobotDataset, _all_gather_ints
from .monitor import refill_percentiles, wait_percentiles
from .ownership import NoEpisodesError
from .state import make_state, parse_state

if TYPE_CHECKING:
    from .mixture import StreamingLeRobotMixture
    from .mixture_loader import MixtureLoader


# Batches each worker builds ahead when the workers collate (make_loader without a collate_fn):
# PyTorch's default is 2. A worker's batch buffers are recycled (handoff.BufferPool), so every
# batch a worker may have built ahead is a buffer it keeps mapped for good: at 640x480, 8 items
# of 2 float32 cameras, 59 MB. With 1, a worker cycles through 2 buffers (the batch in flight,
# the one the training loop holds) instead of 3. A caller's prefetch_factor always wins.
COLLATED_PREFETCH_FACTOR = 1


class _CountingLoader:
    """What both loaders share: the DataLoader they hand batches out of (kept across epochs with
    ``persistent_workers``), counting each batch the training loop takes and timing its wait."""

    dataset: Any
    batch_size: int | None
    num_workers: int
    dataloader_kwargs: dict[str, Any]
    drop_last: bool
    epoch: int
    samples: int
    batches: int
    _batches_in_dataset: bool
    _persistent: bool
    _dataloader: DataLoader | None
    _waits: list[float]
    _lender: BufferLender | None = None

    def _hand_out(self, ds: Any) -> Iterator[Any]:
        kwargs = dict(self.dataloader_kwargs)
        kwargs["worker_init_fn"] = worker_init(kwargs.get("worker_init_fn"))  # workers die with us
        if self._batches_in_dataset and self.num_workers and kwargs.get("prefetch_factor") is None:
            kwargs["prefetch_factor"] = COLLATED_PREFETCH_FACTOR
        drop_last = bool(kwargs.pop("drop_last", False)) if self._batches_in_dataset else False
        # The dataset batches for this loader only (workers take their copy when they start).
        ds._collate = (self.batch_size, drop_last) if self._batches_in_dataset else None
        try:
            loader = self._dataloader if self._persistent else None
            if loader is None:
                # The workers' recycled batch buffers: a lender per set of workers (they take
                # the flags when they start); slots for the batches in flight, the one the
                # training loop holds and the one it has just dropped.
                lender = None
                if self._batches_in_dataset and self.num_workers:
                    lender = BufferLender(self.num_workers, int(kwargs.get("prefetch_factor") or 2) + 3)
                self._lender = lender
                if lender is not None:
                    lender.attach(ds)
                else:
                    BufferLender.detach(ds)  # no pool: batches built in this process
                loader = DataLoader(ds, batch_size=None if self._batches_in_dataset else self.batch_size,
                                    num_workers=self.num_workers, **kwargs)
                if self._persistent:
                    self._dataloader = loader   # its workers (and their caches) live across epochs
            it = iter(loader)
            lender = self._lender
            while True:
                if lender is not None:
                    lender.reclaim()
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                self._waits.append(time.perf_counter() - t0)
                if isinstance(batch, PackedBatch):
                    if lender is not None:
                        lender.lend(batch)
                    batch = batch.unpack()
                self.samples += _batch_len(batch) if self.batch_size is not None else 1
                self.batches += 1
                yield batch
        finally:
            ds._collate = None
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


class StreamingLoader(_CountingLoader):
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
        most = dataset.num_workers_for(num_workers)
        if most < num_workers:
            raise NoEpisodesError(
                f"num_workers={num_workers}, but the smallest rank owns only {most} episodes and each "
                f"worker needs one: use num_workers={most} (dataset.num_workers_for({num_workers})).")
        self.dataset = dataset
        self.batch_size = batch_size
        # Without a collate_fn of the caller's, the dataset's processes build the batches (frames
        # written once, converted on the way, straight into shared memory) and the DataLoader only
        # moves them; a caller's collate_fn gets the items as LeRobot's dataset gives them.
        self._batches_in_dataset = batch_size is not None and dataloader_kwargs.get("collate_fn") is None
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
        self._queue_size = dataset.options.streaming_decoded_queue_size
        self._refill = torch.zeros((max(1, num_workers), self._queue_size + 1), dtype=torch.int64).share_memory_()
        # Each epoch's setup reaches the workers through it (persistent ones were started earlier).
        self._control = control_block(dataset.num_episodes, dataset.world_size) if num_workers else None
        self._persistent = bool(dataloader_kwargs.get("persistent_workers")) and num_workers > 0
        self._dataloader: DataLoader | None = None
        self._waits: list[float] = []    # seconds the training loop waited for each batch, this epoch

    def __iter__(self) -> Iterator[Any]:
        ds = self.dataset
        if ds.epoch != self.epoch:
            ds.set_epoch(self.epoch)
        ds._batch_size, ds._drop_last = self.batch_size, self.drop_last
        ds._shared_stats = self._shared
        ds._shared_refill = self._refill
        ds._control = self._control
        setup = ds.prepare_epoch(self.num_workers)
        self._layout = setup.layout
        if setup.point is None:
            self.samples = self.batches = 0
        self._shared.zero_()
        self._refill.zero_()
        self._waits = []
        if self._control is not None:
            write_control(self._control, (ds.epoch, setup))
        yield from self._hand_out(ds)

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

    def stats(self) -> dict[str, int | float]:
        """Counters summed over this rank's workers (live while iterating), and this epoch's
        percentiles: ``batch_wait_s_p50/p95/p99`` (seconds the training loop waited for a
        batch) and ``refill_p50/p95/p99`` (the fraction of a worker's decoded window ready when
        a sample was taken: near 1 the loader is ahead, near 0 the training loop waits on it)."""
        if self.num_workers == 0:
            out: dict[str, int | float] = dict(self.dataset.stats())
            refill = list(self.dataset.counters.refill)
        else:
            sums = self._shared.sum(dim=0).tolist()
            out = dict(zip(STAT_FIELDS, (int(v) for v in sums), strict=True))
            out["peak_reserved_bytes"] = int(self._shared[:, STAT_FIELDS.index("peak_reserved_bytes")].max())
            refill = self._refill.sum(dim=0).tolist()
        out["batches_waited"] = len(self._waits)
        out.update(wait_percentiles(self._waits))
        out.update(refill_percentiles(refill, self._queue_size))
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


def make_loader(dataset: StreamingLeRobotDataset | StreamingLeRobotMixture, *, batch_size: int | None = 1,
                num_workers: int = 0, **dataloader_kwargs: Any) -> StreamingLoader | MixtureLoader:
    """A resumable DataLoader over ``dataset`` (``num_workers`` capped by nothing: too many for the
    episodes a rank owns is an error naming the number to use). A mixture
    (``StreamingLeRobotDataset.mixture``) gets its own loader, with the same interface.

    ``dataloader_kwargs`` go to the DataLoader; when the workers build the batches (no
    ``collate_fn``), ``prefetch_factor`` defaults to 1 rather than PyTorch's 2
    (``COLLATED_PREFETCH_FACTOR``: each batch built ahead is a buffer a worker keeps)."""
    from .mixture import StreamingLeRobotMixture  # noqa: F811 - at run time, not only for type checks

    if isinstance(dataset, StreamingLeRobotMixture):
        from .mixture_loader import MixtureLoader  # noqa: F811

        return MixtureLoader(dataset, batch_size=batch_size, num_workers=num_workers, **dataloader_kwargs)
    return StreamingLoader(dataset, batch_size=batch_size, num_workers=num_workers, **dataloader_kwargs)
