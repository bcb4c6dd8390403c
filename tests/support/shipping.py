"""Counting how a recycled batch buffer (loader.handoff) reaches the training process: with its
memory (shipped, the first batch in a slot) or by name (later ones)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def count_shipping(module: Any, name: str) -> Iterator[dict[str, int]]:
    """Replace ``module.name``, a reconstructor whose 5th argument is the slot's memory when
    shipped (else None), by one that counts {"ship", "named"} calls. Workers pickle it by name
    and the training process looks it up by name: the stand-in takes the real one's name, so
    forked workers and this process both resolve to it (spawned ones send the name)."""
    calls = {"ship": 0, "named": 0}
    real = getattr(module, name)

    def spy(*args):
        calls["ship" if args[4] is not None else "named"] += 1
        return real(*args)

    spy.__module__, spy.__qualname__ = real.__module__, real.__qualname__
    setattr(module, name, spy)
    try:
        yield calls
    finally:
        setattr(module, name, real)
