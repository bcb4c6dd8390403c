"""Counting how batches reach the training process from DataLoader workers (loader.handoff):
by naming their slot (a pooled reconstructor) or with a buffer of their own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def count_calls(module: Any, name: str) -> Iterator[dict[str, int]]:
    """Replace ``module.name``, a reconstructor the training process calls as it unpickles a
    batch, by one that counts its calls ({"calls": n}). Workers pickle it by name and the
    training process looks it up by name: the stand-in takes the real one's name, so forked
    workers and this process both resolve to it (spawned ones send the name)."""
    calls = {"calls": 0}
    real = getattr(module, name)

    def spy(*args):
        calls["calls"] += 1
        return real(*args)

    spy.__module__, spy.__qualname__ = real.__module__, real.__qualname__
    setattr(module, name, spy)
    try:
        yield calls
    finally:
        setattr(module, name, real)
