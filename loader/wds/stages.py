"""Small generator stages after expansion: shuffle buffer, mapping, batching."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator

from loader.wds.consumed import make_sid


def shuffle_buffer(samples: Iterable[dict], size: int, rng: random.Random) -> Iterator[dict]:
    """Reservoir-style shuffle; ``rng`` comes from (seed, epoch, rank/group, worker)."""
    if size <= 1:
        yield from samples
        return
    buf: list[dict] = []
    for s in samples:
        if len(buf) < size:
            buf.append(s)
            continue
        i = rng.randrange(size)
        buf[i], s = s, buf[i]
        yield s
    rng.shuffle(buf)
    yield from buf


def map_samples(samples: Iterable[dict], fn: Callable[[dict], dict | None]) -> Iterator[dict]:
    for s in samples:
        out = fn(s)
        if out is not None:
            yield out


def with_sid(samples: Iterable[dict]) -> Iterator[dict]:
    for s in samples:
        s["__sid__"] = make_sid(s["__shard__"], s["__index__"])
        yield s


def batched(samples: Iterable[dict], batch_size: int, same_aspect: bool = False) -> Iterator[list[dict]]:
    """Lists of ``batch_size`` samples; with ``same_aspect`` every batch is from one bucket.

    Partial batches are flushed at the end, so no sample is lost.
    """
    if not same_aspect:
        batch: list[dict] = []
        for s in samples:
            batch.append(s)
            if len(batch) == batch_size:
                yield batch
                batch = []
        if batch:
            yield batch
        return
    pending: dict[str | None, list[dict]] = defaultdict(list)
    for s in samples:
        b = pending[s.get("__bucket__")]
        b.append(s)
        if len(b) == batch_size:
            yield b
            pending[s.get("__bucket__")] = []
    for bucket in sorted(pending, key=lambda x: (x is None, x or "")):
        if pending[bucket]:
            yield pending[bucket]
