"""Collate a list of decoded samples into a batch dict (tensors where shapes agree)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_INT_FIELDS = ("__sid__", "__epoch__", "__shard__", "__index__", "__repeat__")


def _bookkeeping(samples: list[dict], keys: list[str]) -> dict[str, torch.Tensor]:
    """The int64 bookkeeping fields and ``__pad__`` of a batch, as views of ONE buffer.

    A batch made in a DataLoader worker reaches the training process tensor by tensor, each
    storage through its own shared-memory file descriptor (a socket round trip): five small
    tensors cost more main-process CPU than the batch's images (0.9 ms vs 0.4 ms a batch, measured).
    """
    ints = [k for k in _INT_FIELDS if k in keys]
    n = len(samples)
    buf = np.zeros(len(ints) * n * 8 + n, np.uint8)
    table = buf[: len(ints) * n * 8].view(np.int64).reshape(len(ints), n)
    for row, key in zip(table, ints, strict=True):
        row[:] = [s.get(key) for s in samples]
    buf[len(ints) * n * 8 :] = [bool(s.get("__pad__")) for s in samples]
    whole = torch.from_numpy(buf)
    out = {}
    ints_view = whole[: len(ints) * n * 8].view(torch.int64).view(len(ints), n)
    for j, key in enumerate(ints):
        out[key] = ints_view[j]
    if "__pad__" in keys:
        out["__pad__"] = whole[len(ints) * n * 8 :].view(torch.bool)
    return out


def collate_samples(samples: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    keys = list(dict.fromkeys(k for s in samples for k in s))  # union, first-seen order
    meta = _bookkeeping(samples, keys)
    for key in keys:
        if key in meta:
            out[key] = meta[key]
            continue
        values = [s.get(key) for s in samples]
        if all(isinstance(v, torch.Tensor) for v in values) and len({v.shape for v in values}) == 1:
            out[key] = torch.stack(values)
        elif all(isinstance(v, np.ndarray) for v in values) and len({v.shape for v in values}) == 1:
            out[key] = torch.from_numpy(np.stack(values))
        else:
            out[key] = values
    return out
