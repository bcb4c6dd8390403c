"""ResumableLoader: a DataLoader whose state_dict() is sample-exact and elastic.

Only what this loader has handed to the training loop counts as consumed: samples prefetched
by workers or waiting in a shuffle buffer are read again after a restore. ``state_dict`` is a
collective call when torch.distributed is initialised (every rank calls it; all get the same
merged state), so a checkpoint taken with W ranks and N workers restores with any W' and N'.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from loader.wds.consumed import ConsumedSet, split_sid
from loader.wds.dataset import STATS_KEY, TwinTarDataset
from loader.wds.distributed import all_gather_objects
from loader.wds.errors import ResumeStateError

STATE_VERSION = 1


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


class ResumableLoader:
    def __init__(self, dataset: TwinTarDataset, *, num_workers: int = 0, **dataloader_kwargs: Any):
        self.dataset = dataset
        self.num_workers = num_workers
        self.dataloader_kwargs = dataloader_kwargs
        self.counts = np.asarray(dataset.shards.counts)
        self.epoch = dataset.shardlist.epoch
        self.consumed: dict[int, ConsumedSet] = {}
        # For WDS_START_INDEX (PiD's per-rank sample count); a PiD-style restart starts from it.
        self.rank_consumed_in_epoch = dataset.shardlist.start_index
        self._done_stats: dict[str, Any] = {}
        self._live_stats: dict[int, dict[str, Any]] = {}

    def _mark(self, item: Any) -> None:
        if isinstance(item, dict) and "__sid__" in item and not isinstance(item["__sid__"], int):
            sids = item["__sid__"].tolist()
            epochs = item["__epoch__"].tolist()
            pads = item["__pad__"].tolist() if "__pad__" in item else [False] * len(sids)
        elif isinstance(item, dict):
            sids, epochs, pads = [item["__sid__"]], [item["__epoch__"]], [item.get("__pad__", False)]
        else:
            sids = [s["__sid__"] for s in item]
            epochs = [s["__epoch__"] for s in item]
            pads = [s.get("__pad__", False) for s in item]
        for sid, ep, pad in zip(sids, epochs, pads, strict=True):
            if ep == self.epoch:
                self.rank_consumed_in_epoch += 1
            if pad:
                # A padding repeat is not its original: the rank that owns the original may
                # not have handed it over yet, and marking it here would skip it on resume.
                continue
            cs = self.consumed.get(ep)
            if cs is None:
                cs = self.consumed[ep] = ConsumedSet(self.counts)
            cs.add(*split_sid(sid))

    def __iter__(self) -> Iterator[Any]:
        sl = self.dataset.shardlist
        sl.set_epoch(self.epoch)
        sl.set_consumed({e: c for e, c in self.consumed.items() if e >= self.epoch})
        loader = DataLoader(
            self.dataset, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
            **self.dataloader_kwargs,
        )
        self._fold_stats()
        if self.num_workers == 0:
            # In-process: the dataset's own counters are the live ones.
            self._live_stats = _InProcess(self.dataset)
        for item in loader:
            if isinstance(item, dict) and STATS_KEY in item:
                worker_id, snapshot = item.pop(STATS_KEY)
                self._live_stats[worker_id] = snapshot
            self._mark(item)
            yield item
        if not sl.infinite:
            # This rank has read all of its share; the epoch is over for it.
            self.consumed.pop(self.epoch, None)
            self.epoch += 1
            self.rank_consumed_in_epoch = 0

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
        """Batches (or samples) this rank yields in the current epoch, padding included: each
        DataLoader worker batches its own part, so the count is summed per worker. What a
        restored state already consumed is left out. (With same-aspect batches the count is a
        lower bound: each bucket may end in a partial batch.)"""
        from loader.wds.shardlists import ShardlistBasic

        sl: ShardlistBasic = self.dataset.shardlist
        sl.set_consumed({e: c for e, c in self.consumed.items() if e >= self.epoch})  # as __iter__ does
        bs = self.dataset.batch_size or 1
        workers = max(1, self.num_workers)
        total = 0
        for w in range(workers):
            tasks, _ = sl.tasks(self.epoch, w, workers)
            total += -(-sum(t.size for t in tasks) // bs)
        return total

    def state_dict(self) -> dict[str, Any]:
        """Merged consumed-sample state of every rank (a collective call under torch.distributed)."""
        local = {
            "epoch": self.epoch,
            "consumed": {e: c.to_state() for e, c in self.consumed.items()},
            "rank_consumed": self.rank_consumed_in_epoch,
        }
        gathered = all_gather_objects(local)
        epoch = min(g["epoch"] for g in gathered)
        merged: dict[int, ConsumedSet] = {}
        for g in gathered:
            for e, st in g["consumed"].items():
                cs = ConsumedSet.from_state(st, self.counts)
                if e in merged:
                    merged[e].merge(cs)
                else:
                    merged[e] = cs
        # Epochs every sample of which was consumed are over.
        while epoch in merged and merged[epoch].complete:
            del merged[epoch]
            epoch += 1
        for e in [e for e in self.consumed if e < epoch]:
            del self.consumed[e]  # over on every rank: no need to keep it in memory either
        sl = self.dataset.shardlist
        return {
            "version": STATE_VERSION,
            "fingerprint": self.dataset.shards.fingerprint(),
            "seed": sl.seed,
            "shuffle": sl.shuffle,
            "epoch": epoch,
            "consumed": {str(e): c.to_state() for e, c in sorted(merged.items()) if e >= epoch},
            # PiD compatibility: the variables its shard list reads on restart.
            "WDS_EPOCH_NUM": epoch,
            "WDS_START_INDEX": max(g["rank_consumed"] for g in gathered),
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
        fp = self.dataset.shards.fingerprint()
        if state.get("fingerprint") != fp:
            raise ResumeStateError(
                f"resume state is for another shard list (field 'fingerprint' {state.get('fingerprint')!r}, "
                f"this dataset {fp}); resume with the same manifests, modalities and aspect-ratio filter"
            )
        sl = self.dataset.shardlist
        if state.get("seed") != sl.seed or state.get("shuffle") != sl.shuffle:
            raise ResumeStateError(
                f"resume state was taken with seed={state.get('seed')!r} shuffle={state.get('shuffle')!r} "
                f"(fields 'seed', 'shuffle'), this loader has seed={sl.seed} shuffle={sl.shuffle}"
            )
        epoch = state.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ResumeStateError(f"resume state field 'epoch' is {epoch!r}; it must be a whole number >= 0")
        raw = state.get("consumed")
        if not isinstance(raw, dict):
            raise ResumeStateError(f"resume state field 'consumed' is {type(raw).__name__}; it must be a dict")
        consumed: dict[int, ConsumedSet] = {}
        for e, st in raw.items():
            try:
                ep = int(e)
            except (TypeError, ValueError):
                ep = -1
            if ep < epoch:
                raise ResumeStateError(
                    f"resume state field 'consumed' has key {e!r}; keys are epochs >= 'epoch' ({epoch})"
                )
            try:
                consumed[ep] = ConsumedSet.from_state(st, self.counts)
            except (ResumeStateError, TypeError, AttributeError) as exc:
                raise ResumeStateError(f"resume state field 'consumed.{e}': {exc}") from None
        self.epoch = epoch
        self.consumed = consumed
        self.rank_consumed_in_epoch = 0
