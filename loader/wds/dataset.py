"""TwinTarDataset: the IterableDataset that reads twin tars for one data-parallel rank."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from loader.io import urls
from loader.wds.collate import collate_samples
from loader.wds.epoch_plan import UNBATCHED_BLOCK, Layout, Task
from loader.wds.errors import DecodeError
from loader.wds.expand import DECODE_ERROR_POLICIES, ExpandOptions, ExpandStats
from loader.wds.shard_table import ShardTable
from loader.wds.shardlists import PlannedBatch, ShardlistBasic, current_worker
from loader.wds.twin_reader import TwinReader, read_indexes_before_fork

STATS_KEY = "__stats__"
log = logging.getLogger(__name__)


def _in_worker_process() -> bool:
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


class TwinTarDataset(IterableDataset):
    """Samples (or batches) from twin tars.

    The shard list plans the batches (``epoch_plan.py``: one order per epoch, dealt to ranks and
    workers; ``shuffle_buffer`` is the order's shuffle window). Each planned batch is read by the
    process's ``TwinReader`` (``twin_reader.py``; it keeps a shard's tars open from one batch to
    the next), then put in plan order, decoded, mapped and collated. Every sample carries ``__key__``, ``__sid__`` (shard << 32 | member), ``__epoch__``,
    ``__pad__`` (a repeat that evens out ranks) and ``__bucket__``; a mixture's also carry
    ``__source__`` and ``__repeat__`` (``loader/mixture``).
    """

    def __init__(
        self, shards: ShardTable, shardlist: ShardlistBasic, *, modalities: Sequence[str] | None = None,
        options: ExpandOptions | None = None, shuffle_buffer: int = 0, decoder: Callable[[dict], dict] | None = None,
        maps: Sequence[Callable[[dict], dict | None]] = (), batch_size: int | None = None,
        same_aspect_batches: bool = False, collate: Callable[[list[dict]], Any] = collate_samples,
        on_decode_error: str = "raise", drop_last: bool = False,
    ):
        if on_decode_error not in DECODE_ERROR_POLICIES:
            raise ValueError(f"on_decode_error must be one of {DECODE_ERROR_POLICIES}, got {on_decode_error!r}")
        self.on_decode_error = on_decode_error
        self.shards = shards
        self.shardlist = shardlist
        self.modalities = tuple(modalities) if modalities else None
        self.options = options or ExpandOptions()
        self.shuffle_size = shuffle_buffer
        self.decoder = decoder
        self.maps = tuple(maps)
        self.same_aspect_batches = same_aspect_batches
        self.collate = collate
        if shardlist.bucket_ids is None:
            shardlist.bucket_ids = shards.bucket_ids
        self.set_batching(batch_size, drop_last=drop_last)
        self.stats = ExpandStats()  # per process; workers keep their own copy

    def set_batching(self, batch_size: int | None, *, drop_last: bool = False) -> None:
        """Batch ``batch_size`` samples (None: yield samples); ``make_loader(ds, batch_size=)``
        calls it, before the loader's first iteration."""
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        self.batch_size = batch_size
        self.drop_last = drop_last
        # The shard list deals what this dataset batches: the order and the batches are one plan.
        self.shardlist.set_layout(Layout(block=batch_size or UNBATCHED_BLOCK,
                                         same_aspect=self.same_aspect_batches and batch_size is not None,
                                         drop_last=drop_last and batch_size is not None, window=self.shuffle_size))

    def read_batch(self, pb: PlannedBatch, reader: TwinReader | None = None) -> tuple[list[int], list[dict]]:
        """The samples of one planned batch, in its order, with their slots (places in the
        batch's plan); a sample dropped while reading (missing key, shard error) is absent.
        ``reader`` keeps tars open from one batch to the next (one per process)."""
        own = reader is None
        reader = reader or self.reader()
        try:
            tasks, where = pb.reading()
            read: list[dict] = []
            for task in tasks:
                reader.read(pb.epoch, task, read)
        finally:
            if own:
                reader.close()
        if len(read) == len(pb):  # the usual case: nothing dropped, no sample twice
            if where is not None:  # read shard by shard (a mixture's batch): into the batch's order
                read = [read[i] for i in where.tolist()]
            slots = list(range(pb.skip, pb.skip + len(read)))
            self._mark(pb, slots, read, whole=True)
            return slots, read
        got = {(s["__shard__"], s["__index__"], s["__pad__"]): s for s in read}
        slots, out, used = [], [], set()
        keys = zip(pb.shards.tolist(), pb.members.tolist(), pb.pads.tolist(), strict=True)
        for i, key in enumerate(keys, pb.skip):
            s = got.get(key)
            if s is None:
                continue
            if key in used:
                s = dict(s)  # tiny sets: one sample padded in twice
            else:
                used.add(key)
            out.append(s)
            slots.append(i)
        self._mark(pb, slots, out)
        return slots, out

    def _mark(self, pb: PlannedBatch, slots: list[int], samples: list[dict], *, whole: bool = False) -> None:
        """A mixture's samples carry their source (``__source__``) and how many times they
        already came this epoch (``__repeat__``: 0 the first time); counted per source.
        ``whole``: ``samples`` are the batch's, every one in its place."""
        if pb.sources is None or pb.repeats is None:
            return
        sources, repeats = pb.sources, pb.repeats
        if not whole:
            at = np.asarray(slots, np.int64) - pb.skip
            sources, repeats = sources[at], repeats[at]
        names = pb.source_names
        for s, name, r in zip(samples, [names[i] for i in sources.tolist()], repeats.tolist(), strict=True):
            s["__source__"] = name
            s["__repeat__"] = r
        per_source = self.stats.samples_per_source
        for name, c in zip(names, np.bincount(sources, minlength=len(names)).tolist(), strict=True):
            if c:
                per_source[name] += c

    def before_fork(self) -> None:
        """Called in the training process just before DataLoader workers are forked from it:
        what every worker would read or make for itself first (the key indexes of the shards the
        plan reads first, the S3 client) is read or made once, here, and the fork copies it."""
        roots = getattr(self.shards, "roots", None)
        if not roots or all(urls.is_local(r) for r in roots):
            return
        read_indexes_before_fork(self.shards, self.first_tasks(), self.modalities, self.options)

    def first_tasks(self) -> Iterator[Task]:
        """The tasks of this rank's plan, in order (lazily: callers take its first shards)."""
        return (t for pb in self.shardlist.batches(0, 1) for t in pb.reading()[0])

    def reader(self) -> TwinReader:
        """A sample reader for this process (it holds open files: close it)."""
        return TwinReader(self.shards, self.modalities, self.options, self.stats)

    def samples(self) -> Iterator[dict]:
        """Undecoded, unbatched samples for this process, in plan order."""
        worker_id, num_workers = current_worker()
        reader = self.reader()
        try:
            for pb in reader.plan_ahead(self.shardlist.batches(worker_id, num_workers)):
                yield from self.read_batch(pb, reader)[1]
        finally:
            reader.close()

    def _decoded(self, samples: Iterator[dict]) -> Iterator[dict]:
        """Decode each sample; under ``on_decode_error="skip"`` a sample that cannot be decoded
        (a corrupt image, a caption that is not UTF-8...) is counted in the stats, with its key,
        and left out instead of ending the epoch. Unsafe data (pickle) always raises."""
        assert self.decoder is not None
        for s in samples:
            try:
                yield self.decoder(s)
            except DecodeError as exc:
                if self.on_decode_error == "raise":
                    raise
                self.stats.note_decode_error(str(s.get("__key__")))
                log.warning("skipping a sample that cannot be decoded: %s", exc)

    def _prepare(self, samples: list[dict], slots: list[int]) -> tuple[list[int], list[dict]]:
        """Decode and map one batch's samples; what a decoder skips or a map drops leaves."""
        if self.decoder is None and not self.maps:
            return slots, samples
        kept_slots, kept = [], []
        for slot, s in zip(slots, samples, strict=True):
            out: dict | None = s
            if self.decoder is not None:
                out = next(self._decoded(iter([s])), None)
            for fn in self.maps:
                if out is None:
                    break
                out = fn(out)
            if out is not None:
                kept_slots.append(slot)
                kept.append(out)
        return kept_slots, kept

    def blocks(self) -> Iterator[Block]:
        """What ``ResumableLoader`` collects: one block per planned batch, with its place in the
        plan, so that the training process can count exactly what it handed out."""
        self.stats = ExpandStats()
        worker_id, num_workers = current_worker()
        reader = self.reader()
        try:
            for pb in reader.plan_ahead(self.shardlist.batches(worker_id, num_workers)):
                read_slots, read = self.read_batch(pb, reader)
                slots, samples = self._prepare(read, read_slots)
                payload: Any = samples
                if self.batch_size is not None:
                    payload = self.collate(samples) if samples else None
                yield Block(pb.epoch, pb.index, pb.skip + len(pb), slots, payload, (worker_id, self.stats.as_dict()))
        finally:
            reader.close()

    def __iter__(self) -> Iterator[Any]:
        """Samples, or batches with ``batch_size``, for this process (without ``ResumableLoader``:
        a plain DataLoader with workers interleaves them sample by sample)."""
        # Counts start afresh per pass: a DataLoader worker gets a new copy each epoch anyway,
        # and the in-process case must not count an earlier epoch twice.
        in_worker = _in_worker_process()
        for block in self.blocks():
            items = block.payload if self.batch_size is None else [block.payload]
            for item in items:
                if item is None:
                    continue
                # Workers are separate processes: their drop counts ride along with what they
                # yield, so whoever reads them in the training process can report them.
                if in_worker and isinstance(item, dict):
                    item[STATS_KEY] = block.stats
                yield item


@dataclass
class Block:
    """One planned batch as read by a worker: ``slots`` are the places in the batch's plan of
    the samples in ``payload`` (a collated batch, or a list of samples without batching), ``end``
    the number of plan places the batch spans (what handing it out consumes)."""

    epoch: int
    index: int
    end: int
    slots: list[int]
    payload: Any
    stats: tuple[int, dict]
