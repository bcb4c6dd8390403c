"""A build's plan on disk, and who reads how much of it.

Two files in a build's state folder: ``plan.parquet`` (every sample, in shard order, in row
groups of ``columnar.ROW_GROUP_ROWS``) and ``shards.parquet`` (one row per shard: its count,
tar sizes and plan digest). The coordinator's steps (plan, commit, the Dagster ``plan`` and
``collect``) read only ``shards.parquet``; a write task, the one-process build's writer and
the key indexes read ``plan.parquet`` a row group's shards at a time; only a build that adds
modality folders to a committed plan (``add_modality``) holds a whole plan as objects.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pid_platform.sharding.layout import state_dir
from pid_platform.sharding.plan.columnar import (
    ShardRef,
    read_shard_refs,
    read_shards_file,
    write_plan_file,
    write_shards_file,
)
from pid_platform.sharding.plan.shard_plan import ShardingConfig, ShardPlan
from pid_platform.sharding.plan.tables import plans_of_table, write_plans

log = logging.getLogger(__name__)
PLAN = "plan.parquet"  # in a build's state folder: every sample of the version, in shard order
SHARDS = "shards.parquet"  # beside it: one row per shard


def shard_ref(plan: ShardPlan) -> ShardRef:
    """What the coordinator keeps of a planned shard (its samples dropped)."""
    mods = tuple(plan.modalities)
    return ShardRef(plan.bucket, plan.index, plan.relpath, mods, plan.count,
                    tuple(plan.tar_bytes(m) for m in mods), plan.digest())


def write_planned(folder: Path, plans: list[ShardPlan], modalities: list[str], config: ShardingConfig,
                  ) -> list[ShardRef]:
    """Both plan files for a plan held as objects (the one-process build; a plan that modalities
    were added to). The same bytes as :func:`write_cut` gives for the same samples."""
    state = state_dir(folder)
    # First: a crash between the two files leaves no shards.parquet of an older plan beside this one.
    (state / SHARDS).unlink(missing_ok=True)
    write_plans(state / PLAN, plans, modalities)
    refs = [shard_ref(p) for p in plans]
    write_shards_file(state / SHARDS, refs, config.part_size, sum(r.count for r in refs))
    return refs


def write_cut(folder: Path, samples: Path, config: ShardingConfig) -> list[ShardRef]:
    """Both plan files cut from ``samples`` (a samples.parquet) as columns, in bounded memory
    (``columnar.write_plan_file``): no Python object per sample."""
    state = state_dir(folder)
    (state / SHARDS).unlink(missing_ok=True)
    write_plan_file(samples, state / PLAN, config, shards_path=state / SHARDS)
    return read_shards_file(state / SHARDS, state / PLAN, config.part_size)


# plan.parquet as a path, or as an open seekable file (``ObjectStore.open_ranged``: a write task
# on any machine reads the footer and its row groups from the bucket, not the whole plan).
PlanSource = Path | BinaryIO


def load_shards(folder: Path, config: ShardingConfig, plan: PlanSource | None = None) -> list[ShardRef]:
    """Every shard of the plan in ``folder``'s state, in plan order, without its samples: from
    ``shards.parquet``, else (a build made before it existed, or a plan written again without it)
    from one pass over ``plan.parquet`` in batches. ``plan``: that plan, where it is not in the
    folder's state."""
    state = state_dir(folder)
    plan = state / PLAN if plan is None else plan
    if (state / SHARDS).is_file():
        try:
            return read_shards_file(state / SHARDS, plan, config.part_size)
        except ValueError as exc:
            log.warning("%s; reading the shards from the plan itself", exc)
    return read_shard_refs(plan, config.part_size)


def shards_identity(shards: list[ShardRef]) -> str:
    """The sha256 of a plan's shard list (each shard's place, count, tar sizes and plan digest):
    it names the bytes of every tar as a hash of plan.parquet does, without reading the plan
    (1 GB at ten million samples), so each write task and the commit compute it for free."""
    h = hashlib.sha256()
    for r in shards:
        h.update(json.dumps([r.bucket, r.index, r.relpath, r.count, list(r.modalities), list(r.sizes),
                             r.plan_digest]).encode())
        h.update(b"\n")
    return h.hexdigest()


def iter_shard_range(folder: Path, config: ShardingConfig, shards: list[ShardRef], first: int, stop: int,
                     plan: PlanSource | None = None, *, verify: bool = True) -> Iterator[list[ShardPlan]]:
    """Shards ``first:stop`` of the plan (``shards``: :func:`load_shards`) with their samples, a
    row group of ``plan.parquet`` (``plan``, default the folder's) at a time, each shard whole
    in one batch: a write task holds the samples of one row group's shards, not of its range.
    Only the row groups that hold them are read. Each shard read must have the plan digest
    ``shards`` gives it (unless not ``verify``): rows of another plan are refused, never written."""
    if first >= stop:
        return
    counts = np.fromiter((r.count for r in shards), dtype=np.int64, count=len(shards))
    ends = np.cumsum(counts)  # the row after each shard
    begin = int(ends[first - 1]) if first else 0
    end = int(ends[stop - 1])
    pf = pq.ParquetFile(state_dir(folder) / PLAN if plan is None else plan)
    groups, at = [], 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if at < end and at + n > begin:
            groups.append((g, at))
        at += n
    if at != int(counts.sum()):
        raise ValueError(f"{_name(plan, folder)} holds {at} samples, its shards {int(counts.sum())}: "
                         "the plan files are of two plans; plan again")
    carry: pa.Table | None = None  # the rows of a shard that runs on into the next row group
    done = first  # shards handed out so far
    for g, start in groups:
        t = pf.read_row_group(g)
        lo, hi = max(begin - start, 0), min(end - start, t.num_rows)
        rows = t.slice(lo, hi - lo)
        if carry is not None:
            rows = pa.concat_tables([carry, rows])
        # Whole shards only: those that end within the rows read so far.
        upto = int(np.searchsorted(ends, start + hi, side="right"))
        upto = min(upto, stop)
        take = int(ends[upto - 1] - (ends[done - 1] if done else 0)) if upto > done else 0
        batch, carry = rows.slice(0, take), rows.slice(take)
        if batch.num_rows:
            plans = plans_of_table(batch, config.part_size)
            yield _checked(plans, shards[done:upto], plan, folder) if verify else plans
            done = upto
    if done != stop or (carry is not None and carry.num_rows):
        raise ValueError(f"{_name(plan, folder)}: rows {begin}:{end} are not shards {first}:{stop} of "
                         f"{state_dir(folder) / SHARDS}: the plan files are of two plans; plan again")


def _checked(plans: list[ShardPlan], want: list[ShardRef], plan: PlanSource | None, folder: Path) -> list[ShardPlan]:
    if [(p.bucket, p.index, p.digest()) for p in plans] != [(r.bucket, r.index, r.plan_digest) for r in want]:
        raise ValueError(f"{_name(plan, folder)}: its rows are not shards {want[0].index}.. of "
                         f"{state_dir(folder) / SHARDS}: the plan files are of two plans; plan again")
    return plans


def iter_shard_plans(folder: Path, config: ShardingConfig) -> Iterator[list[ShardPlan]]:
    """Every shard of ``folder``'s plan with its samples, a row group's shards at a time
    (:func:`iter_shard_range` over all of them, the digests not checked again): for steps that
    read every member of every shard (key indexes) in the memory of one row group, at any source
    size."""
    shards = load_shards(folder, config)
    yield from iter_shard_range(folder, config, shards, 0, len(shards), verify=False)


def _name(plan: PlanSource | None, folder: Path) -> str:
    return str(state_dir(folder) / PLAN if plan is None else getattr(plan, "name", plan))
