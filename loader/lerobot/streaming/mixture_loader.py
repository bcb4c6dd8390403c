"""``make_loader`` over a LeRobot mixture: a DataLoader that counts the items it hands out, so
``state_dict()`` resumes the mixture's order exactly under any world size and worker count.

As for one dataset, only batches handed to the training loop count (items decoded ahead in
workers are read again after a restore) and ``state_dict`` is a collective call under
torch.distributed. The workers learn each epoch's setup through the shared control block, so
persistent workers work too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from .control import control_block, write_control
from .dataset import _all_gather_ints
from .loader import _CountingLoader
from .mixture import MIX_STAT_FIELDS, StreamingLeRobotMixture
from .monitor import refill_percentiles, wait_percentiles


class MixtureLoader(_CountingLoader):
    def __init__(self, dataset: StreamingLeRobotMixture, *, batch_size: int | None = 1, num_workers: int = 0,
                 **dataloader_kwargs: Any):
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be a non-negative integer, got {num_workers!r}")
        for bad in ("shuffle", "sampler", "batch_sampler"):
            if dataloader_kwargs.get(bad):
                raise ValueError(f"{bad}= does not apply: the mixture's schedule orders the items "
                                 "(set seed= on the dataset)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.dataloader_kwargs = dataloader_kwargs
        self._batches_in_dataset = batch_size is not None and dataloader_kwargs.get("collate_fn") is None
        self.drop_last = bool(dataloader_kwargs.get("drop_last", False))
        dataset._batch_size, dataset._drop_last = batch_size, self.drop_last
        self.epoch = dataset.epoch
        self.samples = self.batches = 0
        self._fields = len(MIX_STAT_FIELDS) + len(dataset.sources)
        self._shared = torch.zeros((max(1, num_workers), self._fields), dtype=torch.int64).share_memory_()
        # Room for the setup: a few consumed intervals per resume, one per rank at most each time.
        self._control = control_block(64 * dataset.world_size, dataset.world_size) if num_workers else None
        self._persistent = bool(dataloader_kwargs.get("persistent_workers")) and num_workers > 0
        self._dataloader: DataLoader | None = None
        self._waits: list[float] = []

    def __iter__(self) -> Iterator[Any]:
        ds = self.dataset
        if ds.epoch != self.epoch:
            ds.set_epoch(self.epoch)
        ds._batch_size, ds._drop_last = self.batch_size, self.drop_last
        ds._shared_stats = self._shared
        ds._control = self._control
        setup = ds.prepare_epoch(self.num_workers)
        self.samples = self.batches = 0   # counted against this setup's plan (the consumed are in it)
        self._shared.zero_()
        self._waits = []
        if self._control is not None:
            write_control(self._control, (ds.epoch, setup))
        yield from self._hand_out(ds)

    def state_dict(self) -> dict[str, Any]:
        ds = self.dataset
        if ds.epoch != self.epoch:
            ds.set_epoch(self.epoch)
        return ds.make_state(_all_gather_ints(self.samples))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self.epoch = self.dataset.epoch
        self.samples = self.batches = 0

    def stats(self) -> dict[str, Any]:
        """Counters summed over this rank's workers, ``samples_per_source`` and this epoch's
        batch-wait percentiles (as the single-dataset loader's)."""
        if self.num_workers == 0:
            out: dict[str, Any] = dict(self.dataset.stats())
            refill = list(self.dataset.counters.refill)
        else:
            sums = self._shared.sum(dim=0).tolist()
            out = dict(zip(MIX_STAT_FIELDS, (int(v) for v in sums), strict=False))
            out["peak_reserved_bytes"] = int(self._shared[:, MIX_STAT_FIELDS.index("peak_reserved_bytes")].max())
            out["samples_per_source"] = dict(zip(self.dataset.source_names, (int(v) for v in sums[len(MIX_STAT_FIELDS):]),
                                                 strict=True))
            refill = []
        out["batches_waited"] = len(self._waits)
        out.update(wait_percentiles(self._waits))
        out.update(refill_percentiles(refill, self.dataset.options.streaming_decoded_queue_size))
        return out
