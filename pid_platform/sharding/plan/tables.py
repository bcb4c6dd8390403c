"""Persist samples and shard plans as parquet between build steps (and Dagster assets)."""

from __future__ import annotations

import os
from itertools import groupby
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from loader.formats.atomic import atomic_writer
from loader.formats.twin_tar import shard_relpath
from pid_platform.sharding.intake.task import Sample
from pid_platform.sharding.plan.columnar import table_modalities, write_plan_table
from pid_platform.sharding.plan.shard_plan import ShardPlan
from pid_platform.sharding.storage import FileEntry


def samples_table(samples: list[Sample], modalities: list[str], shard_of: list[tuple[str, int]] | None = None) -> pa.Table:
    cols: dict[str, pa.Array] = {
        "key": pa.array([s.key for s in samples], pa.string()),
        "basename": pa.array([s.basename for s in samples], pa.string()),
        "width": pa.array([s.width for s in samples], pa.int32()),
        "height": pa.array([s.height for s in samples], pa.int32()),
        "bucket": pa.array([s.bucket for s in samples], pa.string()),
    }
    if shard_of is not None:
        cols["shard_bucket"] = pa.array([b for b, _ in shard_of], pa.string())
        cols["shard_index"] = pa.array([i for _, i in shard_of], pa.int32())
    for m in modalities:
        # None: a key a plan kept without this modality's file (``plan/add_modality.py``, keep).
        files = [s.files.get(m) for s in samples]
        cols[f"name.{m}"] = pa.array([f and f.name for f in files], pa.string())
        cols[f"size.{m}"] = pa.array([f and f.size for f in files], pa.int64())
        cols[f"fingerprint.{m}"] = pa.array([f and f.fingerprint for f in files], pa.string())
        cols[f"path.{m}"] = pa.array([f and f.local_path for f in files], pa.string())
    return pa.table(cols)


def _folder_of(path: str | None, name: str, folders: dict[str, str]) -> str | None:
    if path is None:
        return None
    if not path.endswith("/" + name):
        raise ValueError(f"build state names file {name!r} at {path!r}; delete .pid-build/ and rebuild")
    folder = path[: -len(name) - 1]
    return folders.setdefault(folder, folder)  # one string per folder, as in a listing


def table_samples(table: pa.Table) -> list[Sample]:
    mods = table_modalities(table)
    d = table.to_pydict()
    folders: dict[str, str] = {}
    out = []
    for i in range(table.num_rows):
        files = {}
        for m in mods:
            name = d[f"name.{m}"][i]
            if name is None:
                continue  # kept without this modality's file
            folder = _folder_of(d[f"path.{m}"][i], name, folders)
            files[m] = FileEntry(m, name, d[f"size.{m}"][i], d[f"fingerprint.{m}"][i], folder)
        out.append(Sample(d["key"][i], d["basename"][i], files, d["width"][i], d["height"][i], d["bucket"][i]))
    return out


def write_table(path: str | os.PathLike[str], table: pa.Table) -> Path:
    with atomic_writer(path) as fh:
        pq.write_table(table, fh, compression="zstd")
    return Path(path)


def samples_modalities(path: Path) -> list[str]:
    """The modalities of a samples.parquet, from its schema (nothing else is read)."""
    return table_modalities(pq.read_schema(path))


def read_samples(path: Path) -> tuple[list[Sample], list[str]]:
    t = pq.read_table(path)
    return table_samples(t), table_modalities(t)


def write_plans(path: Path, plans: list[ShardPlan], modalities: list[str]) -> Path:
    samples = [s for p in plans for s in p.samples]
    shard_of = [(p.bucket, p.index) for p in plans for _ in p.samples]
    # Written as columnar.write_plan_file writes it (row groups, encodings): the same bytes.
    return write_plan_table(path, samples_table(samples, modalities, shard_of))


def read_plans(path: Path, part_size: int) -> list[ShardPlan]:
    return plans_of_table(pq.read_table(path), part_size)


def plans_of_table(t: pa.Table, part_size: int) -> list[ShardPlan]:
    """The shards of plan.parquet rows (a whole plan, or whole shards of one), in plan order."""
    mods = tuple(sorted(table_modalities(t)))
    samples = table_samples(t)
    d = t.select(["shard_bucket", "shard_index"]).to_pydict()
    keyed = zip(zip(d["shard_bucket"], d["shard_index"], strict=True), samples, strict=True)
    plans = []
    for (bucket, index), group in groupby(keyed, key=lambda x: x[0]):
        plans.append(ShardPlan(bucket, index, shard_relpath(index, part_size), tuple(s for _, s in group), mods))
    return plans
