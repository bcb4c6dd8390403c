"""torch.distributed glue: who am I, rank-0-reads-then-broadcasts, and gathering resume state."""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def dist_active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclass(frozen=True)
class DataParallelRank:
    """Which slice of the data this process reads: ranks of one tensor/context-parallel group
    share a ``group_id`` and so read the same shards in the same order."""

    group_id: int = 0
    num_groups: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.group_id < self.num_groups:
            raise ValueError(f"group_id {self.group_id} not in [0, {self.num_groups})")


def data_parallel_rank(
    group_id: int | None = None, num_groups: int | None = None, dp_group: Any = None,
) -> DataParallelRank:
    """Explicit ids win; else the rank within ``dp_group`` (the process group of ranks that
    hold different data); else the global rank; else a single process."""
    if group_id is not None or num_groups is not None:
        if group_id is None or num_groups is None:
            raise ValueError("give both group_id and num_groups, or neither")
        return DataParallelRank(group_id, num_groups)
    if dp_group is not None:
        return DataParallelRank(dist.get_rank(dp_group), dist.get_world_size(dp_group))
    if dist.is_available() and dist.is_initialized():
        return DataParallelRank(dist.get_rank(), dist.get_world_size())
    return DataParallelRank(0, 1)


class Rank0Error(RuntimeError):
    """Raised on other ranks when rank 0's error could not be re-created as its own type."""


def run_on_rank0_and_broadcast(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and give every rank its result.

    If ``fn`` fails on rank 0, every rank raises that error (nobody waits at a barrier for a
    result that will never come). Without an initialised process group, just call ``fn``.
    """
    if not dist_active():
        return fn()
    payload: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", fn())
        except Exception as exc:  # every failure must reach the other ranks
            error = exc
            tb = traceback.format_exc()
            try:
                pickle.dumps(exc)
                payload[0] = ("err", exc, tb)
            except Exception:
                payload[0] = ("err", Rank0Error(f"{type(exc).__name__}: {exc}"), tb)
    dist.broadcast_object_list(payload, src=0)
    if error is not None:
        raise error
    status, *rest = payload[0]
    if status == "ok":
        return rest[0]
    exc, tb = rest
    raise exc from Rank0Error(f"rank 0 failed while reading manifests:\n{tb}")


def all_gather_objects(obj: T) -> list[T]:
    if not dist_active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
