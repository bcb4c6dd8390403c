"""TwinTarDataset: the IterableDataset that reads twin tars for one data-parallel rank."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from loader.wds.collate import collate_samples
from loader.wds.errors import DecodeError
from loader.wds.expand import (
    DECODE_ERROR_POLICIES,
    ExpandOptions,
    ExpandStats,
    group_by_keys,
    process_sample,
    tar_file_expander,
    url_opener,
)
from loader.wds.schema import ShardTable
from loader.wds.shardlists import ShardlistBasic, current_worker
from loader.wds.stages import batched, map_samples, shuffle_buffer, with_sid

STATS_KEY = "__stats__"
log = logging.getLogger(__name__)


def _in_worker_process() -> bool:
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


class TwinTarDataset(IterableDataset):
    """Samples (or batches) from twin tars.

    Stages, each a small generator: shard list -> url_opener -> tar_file_expander ->
    process_sample -> group_by_keys -> shuffle buffer -> decode -> user maps -> batching.
    Every sample carries ``__key__``, ``__sid__`` (shard << 32 | member), ``__epoch__``,
    ``__pad__`` (a repeat that evens out ranks) and ``__bucket__``.
    """

    def __init__(
        self, shards: ShardTable, shardlist: ShardlistBasic, *, modalities: Sequence[str] | None = None,
        options: ExpandOptions | None = None, shuffle_buffer: int = 0, decoder: Callable[[dict], dict] | None = None,
        maps: Sequence[Callable[[dict], dict | None]] = (), batch_size: int | None = None,
        same_aspect_batches: bool = False, collate: Callable[[list[dict]], Any] = collate_samples,
        on_decode_error: str = "raise",
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
        self.batch_size = batch_size
        self.same_aspect_batches = same_aspect_batches
        self.collate = collate
        self.stats = ExpandStats()  # per process; workers keep their own copy

    def samples(self) -> Iterator[dict]:
        """Undecoded, unbatched samples for this process (after the shuffle buffer)."""
        worker_id, _ = current_worker()
        stream = url_opener(iter(self.shardlist), self.shards)
        members = map(process_sample, tar_file_expander(stream, self.modalities, self.options, self.stats))
        out = with_sid(group_by_keys(members, self.stats))
        sl = self.shardlist
        rng = random.Random(f"shuffle:{sl.seed}:{sl.epoch}:{sl.rank.group_id}:{worker_id}")
        return shuffle_buffer(out, self.shuffle_size, rng)

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

    def __iter__(self) -> Iterator[Any]:
        # Counts start afresh per pass: a DataLoader worker gets a new copy each epoch anyway,
        # and the in-process case must not count an earlier epoch twice.
        self.stats = ExpandStats()
        worker_id, _ = current_worker()
        in_worker = _in_worker_process()
        out = self.samples()
        if self.decoder is not None:
            out = self._decoded(out)
        for fn in self.maps:
            out = map_samples(out, fn)
        if self.batch_size is not None:
            out = map(self.collate, batched(out, self.batch_size, self.same_aspect_batches))
        for item in out:
            # Workers are separate processes: their drop counts ride along with what they
            # yield, so the loader in the training process can report them.
            if in_worker and isinstance(item, dict):
                item[STATS_KEY] = (worker_id, self.stats.as_dict())
            yield item
