"""The resume state of a streaming epoch: a small value, and what each worker derives from it.

A state records the configuration the epoch's plans were made with (world size, workers, seed,
strategy, pool, budget, and ``base``: the first frame of each episode when the epoch itself
started from an elastic resume) and, per rank, the samples and batches handed to the training
loop. With the same configuration and batch size a worker skips exactly its share of those
samples (a DataLoader takes batches from its workers in turn, passing over a worker once it is
exhausted, so which worker made each batch follows from the batch count) and the workers are
rotated so the next batch comes from the worker whose turn it was: the rest of the epoch is the
uninterrupted order. With any other configuration the old
plans are replayed to find which frames were handed out, and the rest of the epoch visits each
remaining frame exactly once under the new one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .options import worker_share
from .ownership import batches_of

STATE_FORMAT = "pid-lerobot-stream"
STATE_VERSION = 1


class StreamResumeError(ValueError):
    """A resume state that is malformed or belongs to another dataset selection."""


@dataclass(frozen=True)
class Layout:
    """What the plans of an epoch depend on (besides the dataset and the epoch)."""

    world_size: int
    num_workers: int
    seed: int
    strategy: str
    pool_size: int       # per rank
    byte_budget: int     # per rank, bytes
    base: tuple[tuple[int, int], ...] = ()   # (episode, first frame) for episodes not starting at 0

    def worker_pool(self) -> tuple[int, int]:
        """(pool size, byte budget) of one worker under this layout."""
        return worker_share(self.pool_size, self.num_workers), worker_share(self.byte_budget, self.num_workers)


@dataclass(frozen=True)
class ResumePoint:
    epoch: int
    layout: Layout
    batch_size: int | None
    samples: tuple[int, ...]            # per rank
    batches: tuple[int, ...] | None     # per rank (None: counted per sample, no DataLoader batches)
    drop_last: bool = False             # the loader's drop_last: no padding, short batches left out


def selection_fingerprint(repo_id: str, episodes: Sequence[int], lengths: Sequence[int], fps: int) -> str:
    h = hashlib.sha256(f"{repo_id}\x00{fps}\x00".encode())
    h.update(",".join(f"{e}:{n}" for e, n in zip(episodes, lengths, strict=True)).encode())
    return h.hexdigest()[:32]


def make_state(*, fingerprint: str, epoch: int, layout: Layout, batch_size: int | None,
               samples: Sequence[int], batches: Sequence[int] | None, drop_last: bool = False) -> dict[str, Any]:
    return {
        "format": STATE_FORMAT, "version": STATE_VERSION, "fingerprint": fingerprint, "epoch": int(epoch),
        "world_size": layout.world_size, "num_workers": layout.num_workers, "seed": layout.seed,
        "strategy": layout.strategy, "pool_size": layout.pool_size, "byte_budget": layout.byte_budget,
        "base": [list(b) for b in layout.base], "batch_size": batch_size,
        "samples": [int(s) for s in samples],
        "batches": None if batches is None else [int(b) for b in batches],
        "drop_last": bool(drop_last),
    }


def _int(state: dict[str, Any], name: str, *, minimum: int = 0, allow_none: bool = False) -> int | None:
    v = state.get(name)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise StreamResumeError(f"resume state field {name!r} must be an integer >= {minimum}, got {v!r}")
    return v


def parse_state(state: Any, *, fingerprint: str) -> ResumePoint:
    """Check a state (each field named on error) and that it belongs to this selection."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise StreamResumeError("not a StreamingLeRobotDataset resume state (no 'format': "
                                f"{STATE_FORMAT!r}); was it taken from another loader?")
    if state.get("version") != STATE_VERSION:
        raise StreamResumeError(f"resume state field 'version' is {state.get('version')!r}; this reader "
                                f"reads version {STATE_VERSION}")
    if state.get("fingerprint") != fingerprint:
        raise StreamResumeError(
            "resume state field 'fingerprint' does not match: it was taken on another dataset, episode "
            "selection or fps (repo_id, episodes= and their lengths must be the same to resume)")
    world = _int(state, "world_size", minimum=1)
    samples = state.get("samples")
    if not isinstance(samples, list) or len(samples) != world:
        raise StreamResumeError(f"resume state field 'samples' must list one count per rank ({world}), got {samples!r}")
    batches = state.get("batches")
    if batches is not None and (not isinstance(batches, list) or len(batches) != world):
        raise StreamResumeError(f"resume state field 'batches' must be null or list one count per rank, got {batches!r}")
    for name, values in (("samples", samples), ("batches", batches or [])):
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise StreamResumeError(f"resume state field {name!r} must hold integers >= 0, got {values!r}")
    strategy = state.get("strategy")
    if strategy not in ("remaining", "round_robin"):
        raise StreamResumeError(f"resume state field 'strategy' is {strategy!r}")
    base = state.get("base")
    if not isinstance(base, list) or any(not isinstance(b, list | tuple) or len(b) != 2 for b in base):
        raise StreamResumeError(f"resume state field 'base' must be a list of [episode, frame] pairs, got {base!r}")
    layout = Layout(world_size=world, num_workers=_int(state, "num_workers"), seed=_int(state, "seed"),
                    strategy=strategy, pool_size=_int(state, "pool_size", minimum=1),
                    byte_budget=_int(state, "byte_budget", minimum=1),
                    base=tuple((int(e), int(f)) for e, f in base))
    drop_last = state.get("drop_last", False)   # absent in states written before it existed
    if not isinstance(drop_last, bool):
        raise StreamResumeError(f"resume state field 'drop_last' must be true or false, got {drop_last!r}")
    return ResumePoint(epoch=_int(state, "epoch"), layout=layout,
                       batch_size=_int(state, "batch_size", minimum=1, allow_none=True),
                       samples=tuple(samples), batches=None if batches is None else tuple(batches),
                       drop_last=drop_last)


def worker_steps(samples: int, batches: int | None, *, num_workers: int, batch_size: int | None,
                 counts: Sequence[int], drop_last: bool = False) -> tuple[list[int], int]:
    """Samples each (logical) worker of one rank had handed out, from the rank's counts, and the
    worker whose turn is next. ``counts``: the samples each worker yields in the epoch.

    The DataLoader asks its workers in turn, 0, 1, ..., N-1, 0, ..., passing over a worker once it
    is exhausted; so pass k hands out batch k of every worker that has more than k of them, in
    worker order, and a batch count says exactly where in which pass the loader stopped."""
    if num_workers <= 1:
        return [min(samples, counts[0])], 0
    if batches is None or batch_size is None:
        raise StreamResumeError(
            "resume state has no batch count: with DataLoader workers, take the state from the loader "
            "make_loader() returns (it counts batches), not from the dataset")
    per = [batches_of(c, batch_size, drop_last) for c in counts]
    if batches > sum(per):
        raise StreamResumeError(
            f"resume state field 'batches' ({batches}) is more than the {sum(per)} batches of the epoch")
    lo, hi = 0, max(per, default=0)   # the most whole passes that fit in `batches`
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(b, mid) for b in per) <= batches:
            lo = mid
        else:
            hi = mid - 1
    taken = [min(b, lo) for b in per]
    left, turn = batches - sum(taken), 0
    for w in range(num_workers):
        if left and per[w] > lo:
            taken[w] += 1
            left -= 1
            turn = (w + 1) % num_workers
    steps = [min(t * batch_size, c) for t, c in zip(taken, counts, strict=True)]
    if sum(steps) != samples:
        raise StreamResumeError(
            f"resume state fields 'samples' ({samples}) and 'batches' ({batches}) do not agree with "
            f"batch_size={batch_size}, num_workers={num_workers} and the workers' {list(counts)} samples")
    return steps, turn
