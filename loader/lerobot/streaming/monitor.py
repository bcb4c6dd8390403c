"""Batch-wait and refill-level percentiles for ``loader.stats()``, the numbers LeRobot's
streaming troubleshooting compares ("compare p95/p99 batch wait")."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

QUANTILES = (50, 95, 99)
# A reading process publishes its counters for ``loader.stats()`` at most this often while it
# iterates, and once more when its pass ends: publishing per sample (a stats dict and a tensor
# write) took a quarter of the training process's GIL time at 0 workers, 320x240.
PUBLISH_EVERY_S = 0.05


def wait_percentiles(waits_s: Sequence[float]) -> dict[str, float]:
    """``batch_wait_s_p50/p95/p99``: seconds the training loop waited for a batch (0 when none)."""
    a = np.asarray(waits_s, dtype=np.float64)
    values = np.percentile(a, QUANTILES) if len(a) else np.zeros(len(QUANTILES))
    return {f"batch_wait_s_p{q}": float(v) for q, v in zip(QUANTILES, values, strict=True)}


def refill_percentiles(histogram: Sequence[int], queue_size: int) -> dict[str, float]:
    """``refill_p50/p95/p99``: of the decoded window (``streaming_decoded_queue_size``), the
    fraction ready when a sample was taken; ``histogram[k]`` counts samples taken at k ready."""
    counts = np.asarray(histogram, dtype=np.int64)
    total = int(counts.sum())
    out = {}
    for q in QUANTILES:
        if not total:
            out[f"refill_p{q}"] = 0.0
            continue
        # The smallest level with at least q% of the samples at or below it.
        k = int(np.searchsorted(np.cumsum(counts), q / 100 * total, side="left"))
        out[f"refill_p{q}"] = min(k, queue_size) / max(1, queue_size)
    return out
