"""Collate a list of decoded samples into a batch dict (tensors where shapes agree)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def collate_samples(samples: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    keys = list(dict.fromkeys(k for s in samples for k in s))  # union, first-seen order
    for key in keys:
        values = [s.get(key) for s in samples]
        if key in ("__sid__", "__epoch__", "__shard__", "__index__"):
            out[key] = torch.tensor(values, dtype=torch.int64)
        elif key == "__pad__":
            out[key] = torch.tensor(values, dtype=torch.bool)
        elif all(isinstance(v, torch.Tensor) for v in values) and len({v.shape for v in values}) == 1:
            out[key] = torch.stack(values)
        elif all(isinstance(v, np.ndarray) for v in values) and len({v.shape for v in values}) == 1:
            out[key] = torch.from_numpy(np.stack(values))
        else:
            out[key] = values
    return out
