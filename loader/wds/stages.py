"""Small generator stages after expansion."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from loader.wds.consumed import make_sid


def map_samples(samples: Iterable[dict], fn: Callable[[dict], dict | None]) -> Iterator[dict]:
    for s in samples:
        out = fn(s)
        if out is not None:
            yield out


def with_sid(samples: Iterable[dict]) -> Iterator[dict]:
    for s in samples:
        s["__sid__"] = make_sid(s["__shard__"], s["__index__"])
        yield s
