"""A build's plan on disk, and who reads how much of it.

Two files in a build's state folder: ``plan.parquet`` (every sample, in shard order, in row
groups of ``columnar.ROW_GROUP_ROWS``) and ``shards.parquet`` (one row per shard: its count,
tar sizes and plan digest). The coordinator's steps (plan, commit, the Dagster ``plan`` and
``collect``) read only ``shards.parquet``; a write task reads the row groups of
``plan.parquet`` that hold its own shards; only the one-process build and the checks over
every shard's members hold the whole plan as objects.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
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


def load_shard_range(folder: Path, config: ShardingConfig, shards: list[ShardRef], first: int, stop: int,
                     plan: PlanSource | None = None) -> list[ShardPlan]:
    """Shards ``first:stop`` of the plan (``shards``: :func:`load_shards`) with their samples,
    read from the row groups of ``plan.parquet`` (``plan``, default the folder's) that hold them
    and no others. Each shard read must have the plan digest ``shards`` gives it: rows of another
    plan are refused, never written."""
    if first >= stop:
        return []
    counts = np.fromiter((r.count for r in shards), dtype=np.int64, count=len(shards))
    begin = int(counts[:first].sum())
    end = begin + int(counts[first:stop].sum())
    pf = pq.ParquetFile(state_dir(folder) / PLAN if plan is None else plan)
    groups, tables, at = [], [], 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if at < end and at + n > begin:
            groups.append((g, at))
        at += n
    if at != int(counts.sum()):
        raise ValueError(f"{_name(plan, folder)} holds {at} samples, its shards {int(counts.sum())}: "
                         "the plan files are of two plans; plan again")
    for g, start in groups:
        t = pf.read_row_group(g)
        lo, hi = max(begin - start, 0), min(end - start, t.num_rows)
        tables.append(t.slice(lo, hi - lo))
    plans = plans_of_table(pa.concat_tables(tables), config.part_size)
    want = [(r.bucket, r.index, r.plan_digest) for r in shards[first:stop]]
    if [(p.bucket, p.index, p.digest()) for p in plans] != want:
        raise ValueError(f"{_name(plan, folder)}: rows {begin}:{end} are not shards {first}:{stop} of "
                         f"{state_dir(folder) / SHARDS}: the plan files are of two plans; plan again")
    return plans


def iter_shard_plans(folder: Path, config: ShardingConfig) -> Iterator[list[ShardPlan]]:
    """Every shard of ``folder``'s plan with its samples, a row group's shards at a time (a shard
    that runs on into the next row group comes with that one's): for steps that read every
    member of every shard (key indexes) in the memory of one row group, at any source size."""
    pf = pq.ParquetFile(state_dir(folder) / PLAN)
    carry = None
    for g in range(pf.num_row_groups):
        t = pf.read_row_group(g)
        if carry is not None:
            t = pa.concat_tables([carry, t])
        carry = None
        if g + 1 < pf.num_row_groups and t.num_rows:
            index = t.column("shard_index").to_numpy()
            bucket = t.column("shard_bucket")
            same = (index == index[-1]) & pc.equal(bucket, bucket[-1]).to_numpy(zero_copy_only=False)
            start = int(np.flatnonzero(~same)[-1]) + 1 if not same.all() else 0
            t, carry = t.slice(0, start), t.slice(start)
        if t.num_rows:
            yield plans_of_table(t, config.part_size)


def _name(plan: PlanSource | None, folder: Path) -> str:
    return str(state_dir(folder) / PLAN if plan is None else getattr(plan, "name", plan))
