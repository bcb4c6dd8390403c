"""ResumableLoader: a DataLoader whose state_dict() is sample-exact, elastic and small.

An epoch's order is one sequence of positions, dealt to ranks batch by batch (``epoch_plan.py``).
Only what this loader has handed to the training loop counts as consumed: batches prefetched by
workers are read again after a restore. ``state_dict`` is a collective call when
torch.distributed is initialised (every rank calls it; all get the same merged state): the
epoch, the *position* up to which the epoch's order is consumed, and, only when ranks stopped
at different points, the few stretches consumed beyond it. A restore with any world size and
worker count continues the same order from there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from loader.handoff import BufferLender, SharedPayload
from loader.wds.dataset import Block, TwinTarDataset
from loader.wds.distributed import all_gather_objects
from loader.wds.epoch_plan import EpochPlan, merge_intervals
from loader.wds.errors import EpochEndedEarlyError, ResumeStateError
from loader.workers import worker_init

STATE_VERSION = 2


def _identity(x):
    return x


def _add_stats(into: dict[str, Any], snap: dict[str, Any]) -> None:
    for k, v in snap.items():
        if isinstance(v, dict):
            d = into.setdefault(k, {})
            for kk, vv in v.items():
                d[kk] = d.get(kk, 0) + vv
        else:
            into[k] = into.get(k, 0) + v


class _InProcess(dict):
    """Live stats view of a dataset iterated in this process (no DataLoader workers)."""

    def __init__(self, dataset: TwinTarDataset):
        super().__init__()
        self.dataset = dataset

    def values(self):  # type: ignore[override]
        return [self.dataset.stats.as_dict()]


class _Blocks(IterableDataset):
    """The dataset as the loader's workers read it: one ``Block`` per planned batch."""

    def __init__(self, dataset: TwinTarDataset):
        self.dataset = dataset

    def __iter__(self) -> Iterator[Block]:
        if get_worker_info() is None:
            yield from self.dataset.blocks()
            return
        # In a worker: the batch's bytes go to the training process through a recycled
        # shared-memory buffer, not pickled through the DataLoader's pipe (loader.handoff); it
        # arrives as it was.
        for block in self.dataset.blocks():
            block.payload = SharedPayload(block.payload)
            yield block


def _forks(context: Any) -> bool:
    """Whether DataLoader workers started with ``context`` are forked (they copy this process)."""
    import multiprocessing

    if context is None:  # the default context; the first method listed is the platform's default
        return (multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]) == "fork"
    method = context if isinstance(context, str) else getattr(context, "get_start_method", lambda: None)()
    return method == "fork"


def _done_samples(plan: EpochPlan, rank: int, progress: tuple[int, int]) -> int:
    c, s = progress
    return sum(plan.batch(rank, k).size for k in range(c)) + s


class ResumableLoader:
    def __init__(self, dataset: TwinTarDataset, *, num_workers: int = 0, **dataloader_kwargs: Any):
        self.dataset = dataset
        self.num_workers = num_workers
        self.dataloader_kwargs = dataloader_kwargs
        sl = dataset.shardlist
        self.epoch = sl.epoch
        self._shardlist_epoch = sl.epoch
        # Per epoch: positions consumed by every rank before this loader's plan (from a restored
        # state), and how far into its own plan this rank is (batches, samples into the next).
        self.consumed: dict[int, list[tuple[int, int]]] = {}
        self.progress: dict[int, tuple[int, int]] = {}
        if sl.start_index:  # PiD's WDS_START_INDEX: samples this rank read in epoch WDS_EPOCH_NUM
            self.progress[sl.start_epoch] = sl.plan(sl.start_epoch).progress(sl.rank.group_id, sl.start_index)
        self._done_stats: dict[str, Any] = {}
        self._live_stats: dict[int, dict[str, Any]] = {}

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` afresh at the next iteration (its order, all of its samples)."""
        self.epoch = epoch
        self.consumed = {}
        self.progress = {}
        self.dataset.shardlist.set_epoch(epoch)
        self._shardlist_epoch = epoch

    def _advance(self, block: Block, upto: int) -> None:
        if block.epoch > self.epoch:  # infinite mode: this rank finished the epoch before
            self.epoch = block.epoch
        self.progress[block.epoch] = (block.index, upto) if upto < block.end else (block.index + 1, 0)

    def __iter__(self) -> Iterator[Any]:
        sl = self.dataset.shardlist
        if sl.epoch != self._shardlist_epoch:  # someone called dataset.shardlist.set_epoch(n)
            self.set_epoch(sl.epoch)
        sl.set_epoch(self.epoch)
        sl.consumed = {e: c for e, c in self.consumed.items() if e >= self.epoch}
        sl.progress = {e: p for e, p in self.progress.items() if e >= self.epoch}
        sl.start_index = 0  # the loader's own progress says what is read
        kwargs = dict(self.dataloader_kwargs)
        kwargs["worker_init_fn"] = worker_init(kwargs.get("worker_init_fn"))  # workers die with us
        if self.num_workers and _forks(kwargs.get("multiprocessing_context")):
            self.dataset.before_fork()
        blocks_ds = _Blocks(self.dataset)
        if self.num_workers:
            # The workers' recycled batch buffers (loader.handoff): a slot per batch in flight
            # from a worker, the one it is filling and a spare. A slot is freed as soon as its
            # batch's bytes are copied out, while the batch is unpickled.
            lender = BufferLender(self.num_workers, int(kwargs.get("prefetch_factor") or 2) + 2)
            lender.attach(blocks_ds)  # kept by this generator's frame while its batches arrive
        loader = DataLoader(blocks_ds, batch_size=None, num_workers=self.num_workers, collate_fn=_identity, **kwargs)
        self._fold_stats()
        if self.num_workers == 0:
            # In-process: the dataset's own counters are the live ones.
            self._live_stats = _InProcess(self.dataset)
        batched = self.dataset.batch_size is not None
        # Every planned batch comes as one block, even one whose samples were all dropped (they
        # are counted): fewer blocks means a reader ended its plan early, and samples were lost
        # with nothing counted. It happened once (the twin-tar planner, under S3 503s).
        epoch, first = self.epoch, sl.skip(self.epoch)[0]
        received = np.zeros(0 if sl.infinite else max(0, sl.plan(epoch).batches_per_rank - first), dtype=bool)
        for block in loader:
            if not sl.infinite:
                received[block.index - first] = True
            if self.num_workers:
                worker_id, snapshot = block.stats
                self._live_stats[worker_id] = snapshot
            if batched:
                self._advance(block, block.end)
                if block.payload is not None:
                    yield block.payload
                continue
            for slot, sample in zip(block.slots, block.payload, strict=True):
                self._advance(block, slot + 1)
                yield sample
            self._advance(block, block.end)
        if not sl.infinite:
            unread = (first + np.flatnonzero(~received)).tolist()
            if unread:
                raise EpochEndedEarlyError(
                    f"epoch {epoch} ended with {len(unread)} of the {len(received)} batches this rank's plan "
                    f"holds never read (batches {unread[:8]}{' ...' if len(unread) > 8 else ''}, "
                    f"{self.num_workers} DataLoader workers): a reader stopped before its plan's end. "
                    "This is a loader bug; report it with loader.stats")
            # This rank has read all of its share; the epoch is over for it.
            self.set_epoch(self.epoch + 1)

    def _fold_stats(self) -> None:
        for snap in self._live_stats.values():
            _add_stats(self._done_stats, snap)
        self._live_stats: dict = {}

    @property
    def stats(self) -> dict[str, Any]:
        """What this rank's readers counted (samples, shards, missing keys, duplicates, shard
        errors...), summed over workers and epochs; nothing dropped goes unreported."""
        total: dict[str, Any] = {}
        _add_stats(total, self._done_stats)
        for snap in self._live_stats.values():
            _add_stats(total, snap)
        return total

    def __len__(self) -> int:
        """Batches (or samples, without batching) this rank yields in the current epoch, padding
        included, what was already consumed left out. The same on every rank, whatever
        ``num_workers`` is."""
        sl = self.dataset.shardlist
        sl.consumed = {e: c for e, c in self.consumed.items() if e >= self.epoch}  # as __iter__ does
        plan = sl.plan(self.epoch)
        c, s = self.progress.get(self.epoch, (0, 0))
        if self.dataset.batch_size is not None:
            return plan.batches_per_rank - c
        return plan.rank_samples(sl.rank.group_id) - _done_samples(plan, sl.rank.group_id, (c, s))

    def _order_settings(self) -> dict[str, Any]:
        layout = self.dataset.shardlist.layout
        return {"batch_size": self.dataset.batch_size, "same_aspect_batches": layout.same_aspect,
                "shuffle_buffer": layout.window}

    def state_dict(self) -> dict[str, Any]:
        """Where every rank is in the epoch's order (a collective call under torch.distributed)."""
        sl = self.dataset.shardlist
        local = {"group": sl.rank.group_id, "epoch": self.epoch, "progress": dict(self.progress)}
        gathered = all_gather_objects(local)
        sl.consumed = dict(self.consumed)
        epoch = min(g["epoch"] for g in gathered)
        last = max([epoch, *(e for g in gathered for e in g["progress"])])
        merged: dict[int, list[tuple[int, int]]] = {}
        rank_samples = 0
        for e in range(epoch, last + 1):
            plan = sl.plan(e)
            progress: dict[int, tuple[int, int]] = {}
            for g in gathered:
                if e < g["epoch"] and e not in g["progress"]:
                    p = (plan.batches_per_rank, 0)  # that rank finished the epoch
                else:
                    p = g["progress"].get(e, (0, 0))
                progress[g["group"]] = min(progress.get(g["group"], p), p)
            for group in range(plan.ranks):
                progress.setdefault(group, (0, 0))
            if all(c >= plan.batches_per_rank for c, _ in progress.values()) and e == epoch:
                epoch += 1  # every rank has all of its batches: the epoch is over
                continue
            merged[e] = plan.consumed_after(progress)
            if e == epoch:
                before = sum(b - a for a, b in self.consumed.get(e, []))
                rank_samples = -(-before // plan.ranks) + max(
                    _done_samples(plan, g["group"], g["progress"].get(e, (0, 0))) for g in gathered)
        for e in [e for e in self.consumed if e < epoch]:
            del self.consumed[e]
        first = merged.pop(epoch, [])
        position = first[0][1] if first and first[0][0] == 0 else 0
        ahead = {epoch: [iv for iv in first if iv[0] != 0]} if first else {}
        ahead.update(merged)
        return {
            "version": STATE_VERSION,
            "fingerprint": self.dataset.shards.fingerprint(),
            **({"mixture": sl.definition()} if sl.definition() is not None else {}),
            "seed": sl.seed,
            "shuffle": sl.shuffle,
            "order": self._order_settings(),
            "epoch": epoch,
            "position": position,
            # Stretches of the order consumed beyond ``position`` (only when ranks stopped at
            # different points), per epoch: [[start, stop), ...].
            "ahead": {str(e): [[a, b] for a, b in ivs] for e, ivs in sorted(ahead.items()) if ivs},
            # PiD compatibility: the variables its shard list reads on restart.
            "WDS_EPOCH_NUM": epoch,
            "WDS_START_INDEX": rank_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a state that does not fit raises ``ResumeStateError``
        naming the field."""
        if not isinstance(state, dict):
            raise ResumeStateError(f"resume state must be a dict (from state_dict()), got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ResumeStateError(
                f"resume state field 'version' is {state.get('version')!r}; this loader reads {STATE_VERSION}"
            )
        sl = self.dataset.shardlist
        changed = sl.definition_changes(state.get("mixture"))
        if changed:
            raise ResumeStateError(
                f"resume state field 'mixture' is for another definition: {changed}; resume with the definition "
                "the state was taken with, or start this one afresh (loader.set_epoch(n) instead of load_state_dict)"
            )
        fp = self.dataset.shards.fingerprint()
        if state.get("fingerprint") != fp:
            raise ResumeStateError(
                f"resume state is for another shard list (field 'fingerprint' {state.get('fingerprint')!r}, "
                f"this dataset {fp}); resume with the same manifests, modalities and aspect-ratio filter"
            )
        if state.get("seed") != sl.seed or state.get("shuffle") != sl.shuffle:
            raise ResumeStateError(
                f"resume state was taken with seed={state.get('seed')!r} shuffle={state.get('shuffle')!r} "
                f"(fields 'seed', 'shuffle'), this loader has seed={sl.seed} shuffle={sl.shuffle}"
            )
        order = state.get("order")
        mine = self._order_settings()
        if not isinstance(order, dict):
            raise ResumeStateError(f"resume state field 'order' is {type(order).__name__}; it must be a dict")
        # What defines the order must match; the batch size does only with same-aspect batches.
        defining = ["same_aspect_batches", "shuffle_buffer"] + (["batch_size"] if mine["same_aspect_batches"] else [])
        for name in defining:
            if order.get(name) != mine[name]:
                raise ResumeStateError(
                    f"resume state field 'order.{name}' is {order.get(name)!r}, this loader has {mine[name]!r}; "
                    "it defines the epoch's order: resume with the same value"
                )
        epoch = state.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ResumeStateError(f"resume state field 'epoch' is {epoch!r}; it must be a whole number >= 0")
        total = sl.epoch_size()
        position = state.get("position")
        if not isinstance(position, int) or isinstance(position, bool) or not 0 <= position <= total:
            raise ResumeStateError(
                f"resume state field 'position' is {position!r}; it must be a whole number in [0, {total}]"
            )
        raw = state.get("ahead")
        if not isinstance(raw, dict):
            raise ResumeStateError(f"resume state field 'ahead' is {type(raw).__name__}; it must be a dict")
        consumed: dict[int, list[tuple[int, int]]] = {epoch: [(0, position)]} if position else {}
        for e, ivs in raw.items():
            try:
                ep = int(e)
                pairs = [(int(a), int(b)) for a, b in ivs]
            except (TypeError, ValueError):
                ep, pairs = -1, []
            if ep < epoch or not all(0 <= a < b <= total for a, b in pairs):
                raise ResumeStateError(
                    f"resume state field 'ahead' has {e!r}: {ivs!r}; keys are epochs >= 'epoch' ({epoch}), values "
                    f"lists of [start, stop) with 0 <= start < stop <= {total}"
                )
            have = consumed.get(ep, []) + pairs
            consumed[ep] = merge_intervals(np.asarray([a for a, _ in have], np.int64),
                                           np.asarray([b for _, b in have], np.int64))
        self.epoch = epoch
        sl.set_epoch(epoch)
        self._shardlist_epoch = epoch
        self.consumed = consumed
        self.progress = {}
