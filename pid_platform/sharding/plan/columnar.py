"""The shard plan as columns: one array per field, shard boundaries as offsets.

A source of ten million samples is planned and committed without one Python object per
sample. The plan is a permutation of the samples table (bucket by bucket, key order or the
seeded shuffle within a bucket) cut into shards, so it is held as arrays:

* :func:`layout_shards` - the plan itself, from each sample's bucket and byte span;
* :func:`plan_table` - ``plan.parquet``'s table, in memory (small sources, tests);
* :func:`write_plan_file` - ``samples.parquet`` to ``plan.parquet`` in bounded memory (a few
  columns of every sample, plus one row group of the output at a time);
* :func:`read_shard_refs` - what the commit needs of each shard (count, tar sizes, digest),
  streamed from ``plan.parquet`` in batches;
* :func:`write_shards_file` / :func:`read_shards_file` - the same, one row per shard, written
  beside the plan by :func:`write_plan_file` so the commit need not read every sample again.

Everything here gives exactly what the object plan (:func:`shard_plan.plan_shards`, which
wraps :func:`layout_shards`) gives: the same shards, the same order, the same digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from loader.formats.atomic import atomic_writer
from loader.formats.twin_tar import BLOCK, END_OF_ARCHIVE, RECORD, shard_relpath
from pid_platform.sharding.compute import ascending, pc
from pid_platform.sharding.plan.shard_plan import FLAT, PLAN_VERSION, ShardingConfig, ShardPlan

# Rows per row group of plan.parquet (both writers: this module and ``tables.write_plans``, so the
# bytes are the same whichever wrote them). 128 Ki rows keep one row group - what the writer and
# a reader hold at once - to a few tens of MB at any source size (pyarrow's default, 1 Mi rows,
# is a few hundred MB of 4K-class sample rows).
ROW_GROUP_ROWS = 128 * 1024
BATCH_ROWS = 64 * 1024  # rows per streamed batch: a few MB of each column at a time
SHARD_BUCKET, SHARD_INDEX = "shard_bucket", "shard_index"
# Columns with a handful of values (the aspect buckets) are dictionary-encoded; the others (keys,
# names, fingerprints, sizes) are nearly all distinct, where trying a dictionary first only costs
# time before the writer falls back to plain pages.
DICTIONARY_COLUMNS = ("bucket", SHARD_BUCKET)
_POS = "__plan_row"  # column of the scatter files: the row's place in the plan
SHARDS_VERSION = 1  # of shards.parquet's columns


def spans(sizes: Sequence[np.ndarray]) -> np.ndarray:
    """Bytes each sample takes in its shard's tars, all modalities together (headers and
    padding): what the size bound counts, as in ``shard_plan._sample_span``."""
    total = None
    for s in sizes:
        s = np.asarray(s, dtype=np.int64)
        span = BLOCK + (s + (BLOCK - 1)) // BLOCK * BLOCK
        total = span if total is None else total + span
    if total is None:
        raise ValueError("a plan needs at least one modality")
    return total


@dataclass(frozen=True)
class ShardLayout:
    """The plan as arrays. Plan row ``r`` is sample ``order[r]`` of the input; shard ``s`` is
    plan rows ``offsets[s]:offsets[s + 1]``, shard ``shard_index[s]`` of bucket
    ``bucket_names[shard_bucket[s]]``. Shards come bucket by bucket, buckets in name order."""

    order: np.ndarray  # int64, one per sample
    offsets: np.ndarray  # int64, one per shard plus one
    bucket_names: list[str]  # sorted; FLAT ("") in flat mode
    shard_bucket: np.ndarray  # int32, one per shard
    shard_index: np.ndarray  # int32, one per shard

    def shard_of_rows(self, start: int, stop: int) -> np.ndarray:
        """The shard of each plan row in ``start:stop``."""
        rows = np.arange(start, stop, dtype=np.int64)
        return np.searchsorted(self.offsets, rows, side="right") - 1


def _group_by_bytes(span: np.ndarray, bound: int, fixed: int) -> np.ndarray:
    """Greedy cut of one bucket (in plan order) into shards, as ``shard_plan._group_by_bytes``:
    a shard takes samples while its spans plus ``fixed`` stay within ``bound``, and always its
    first sample. One binary search per shard over the prefix sums, not one step per sample."""
    n = len(span)
    cum = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(span, out=cum[1:])
    room = bound - fixed
    if n and int(span.min()) > room:
        return np.arange(n + 1, dtype=np.int64)  # no two samples fit together: every one alone
    starts = [0]
    i = 0
    while i < n:
        # Samples i..j-1 fit when cum[j] - cum[i] <= room; the first cum past it ends the shard.
        j = max(int(np.searchsorted(cum, int(cum[i]) + room, side="right")) - 1, i + 1)
        starts.append(j)
        i = j
    return np.asarray(starts, dtype=np.int64)


def _shuffled(rows: np.ndarray, seed: int, bucket: str) -> np.ndarray:
    # random.shuffle of the bucket's samples, applied to their positions: the same Random, the
    # same swaps, so the same order as shuffling the objects. array('q') keeps it at 8 bytes a
    # sample (a list of ints would hold one int object each).
    perm = array("q", range(len(rows)))
    random.Random(f"{seed}:{bucket}").shuffle(perm)
    return rows[np.frombuffer(perm, dtype=np.int64)]


def _bucket_codes(buckets: pa.Array | pa.ChunkedArray, classify: bool) -> tuple[np.ndarray, list[str]]:
    """Each sample's bucket as a code into the sorted bucket names (None and "" are FLAT)."""
    n = len(buckets)
    if not classify or n == 0:
        return np.zeros(n, dtype=np.int32), [FLAT]
    if not pa.types.is_dictionary(buckets.type):
        buckets = pc.dictionary_encode(buckets)
    if isinstance(buckets, pa.ChunkedArray):
        buckets = buckets.combine_chunks()  # the chunks' dictionaries unified into one
    values = [v or FLAT for v in buckets.dictionary.to_pylist()] + [FLAT]  # the last one: a null's
    idx = buckets.indices.fill_null(len(values) - 1).to_numpy(zero_copy_only=False)
    # A name in the dictionary that no row uses is no bucket.
    used = np.bincount(idx, minlength=len(values)) > 0
    names = sorted({v for v, u in zip(values, used, strict=True) if u})
    rank = np.array([names.index(v) if u else -1 for v, u in zip(values, used, strict=True)], dtype=np.int32)
    return rank[idx], names


def layout_shards(buckets: pa.Array | pa.ChunkedArray, sample_spans: np.ndarray, config: ShardingConfig, *,
                  modalities: int, keys: pa.Array | pa.ChunkedArray | None = None) -> ShardLayout:
    """The shard plan of samples given as columns: each one's bucket (string or dictionary
    array, None in flat mode), its byte span (:func:`spans`) over ``modalities`` modalities and, unless they are known to be
    in key order already (``keys=None``: what intake writes), its key.

    The same shards as ``shard_plan.plan_shards`` on the same samples.
    """
    codes, names = _bucket_codes(buckets, config.classify_aspect_ratio)
    sample_spans = np.asarray(sample_spans, dtype=np.int64)
    if keys is not None and not ascending(keys):
        # Stable, so equal keys keep their order as Python's sorted does; arrow compares UTF-8
        # bytes, which order as code points do.
        key_order = pc.sort_indices(keys).to_numpy()
    else:
        key_order = None
    # Fixed per-tar cost: end-of-archive blocks plus at most one record of padding per modality.
    fixed = modalities * (END_OF_ARCHIVE + RECORD)
    orders, offsets, shard_bucket, shard_index = [], [np.zeros(1, dtype=np.int64)], [], []
    base = 0
    for b, bucket in enumerate(names):
        if key_order is None:
            rows = np.flatnonzero(codes == b).astype(np.int64)
        else:
            rows = key_order[codes[key_order] == b].astype(np.int64)
        if config.shuffle:
            rows = _shuffled(rows, config.seed, bucket)
        n = len(rows)
        if config.shard_size > 0:
            starts = np.append(np.arange(0, n, config.shard_size, dtype=np.int64), n)
        else:
            starts = _group_by_bytes(sample_spans[rows], config.max_shard_bytes, fixed)
        orders.append(rows)
        offsets.append(starts[1:] + base)
        shard_bucket.append(np.full(len(starts) - 1, b, dtype=np.int32))
        shard_index.append(np.arange(len(starts) - 1, dtype=np.int32))
        base += n
    return ShardLayout(
        order=np.concatenate(orders) if orders else np.zeros(0, dtype=np.int64),
        offsets=np.concatenate(offsets),
        bucket_names=names,
        shard_bucket=np.concatenate(shard_bucket) if shard_bucket else np.zeros(0, dtype=np.int32),
        shard_index=np.concatenate(shard_index) if shard_index else np.zeros(0, dtype=np.int32),
    )


def plan_layout(buckets: pa.Array | pa.ChunkedArray, sizes: Sequence[np.ndarray], config: ShardingConfig,
                keys: pa.Array | pa.ChunkedArray | None = None) -> ShardLayout:
    """:func:`layout_shards` from each modality's file sizes (one array per modality)."""
    return layout_shards(buckets, spans(sizes), config, modalities=len(sizes), keys=keys)


# ---------------------------------------------------------------- plan.parquet

def table_modalities(table: pa.Table | pa.Schema) -> list[str]:
    """The modalities of a samples or plan table (or its schema), in column order."""
    names = table.names if isinstance(table, pa.Schema) else table.column_names
    return [c.split(".", 1)[1] for c in names if c.startswith("name.")]


def plan_schema(samples_schema: pa.Schema) -> pa.Schema:
    """plan.parquet's columns: the samples table's, with the shard columns after ``bucket``."""
    fields = [f for f in samples_schema if f.name not in (SHARD_BUCKET, SHARD_INDEX)]
    at = [f.name for f in fields].index("bucket") + 1
    fields[at:at] = [pa.field(SHARD_BUCKET, pa.string()), pa.field(SHARD_INDEX, pa.int32())]
    return pa.schema(fields)


def _with_shard_columns(rows: pa.Table, layout: ShardLayout, start: int, schema: pa.Schema) -> pa.Table:
    """Plan rows ``start:`` (``rows``, in plan order) with their shard columns, as ``schema``."""
    sid = layout.shard_of_rows(start, start + rows.num_rows)
    cols = {name: rows.column(name).combine_chunks() for name in rows.column_names if name != _POS}
    cols[SHARD_BUCKET] = pc.take(pa.array(layout.bucket_names, pa.string()), pa.array(layout.shard_bucket[sid]))
    cols[SHARD_INDEX] = pa.array(layout.shard_index[sid], pa.int32())
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def plan_table(samples: pa.Table, config: ShardingConfig) -> tuple[pa.Table, ShardLayout]:
    """plan.parquet's table for a samples table (``tables.samples_table``), held in memory."""
    sizes = [samples.column(f"size.{m}").to_numpy() for m in sorted(table_modalities(samples))]
    layout = plan_layout(samples.column("bucket"), sizes, config, samples.column("key"))
    schema = plan_schema(samples.schema.remove_metadata())
    rows = samples.take(pa.array(layout.order))
    return _with_shard_columns(rows, layout, 0, schema), layout


def plan_writer(where, schema: pa.Schema) -> pq.ParquetWriter:
    """The ParquetWriter every plan.parquet is written with (its bytes depend on these settings)."""
    return pq.ParquetWriter(where, schema, compression="zstd",
                            use_dictionary=[c for c in DICTIONARY_COLUMNS if c in schema.names])


def write_plan_table(path: str | os.PathLike[str], table: pa.Table, row_group_rows: int | None = None) -> Path:
    """Write plan.parquet from a table in memory, one call per row group (default ``ROW_GROUP_ROWS``)."""
    row_group_rows = row_group_rows or ROW_GROUP_ROWS
    with atomic_writer(path) as fh, plan_writer(fh, table.schema) as w:
        for start in range(0, max(table.num_rows, 1), row_group_rows):
            w.write_table(table.slice(start, row_group_rows).combine_chunks(), row_group_size=row_group_rows)
    return Path(path)


def _batches(pf: pq.ParquetFile, batch_rows: int, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """``pf.iter_batches`` one row group at a time: one reader over a whole file of many row
    groups keeps growing (about 100 MB per 1 Mi-row group of samples read), one per row group
    holds only that group."""
    for g in range(pf.num_row_groups):
        yield from pf.iter_batches(batch_size=batch_rows, row_groups=[g], columns=columns)


def _read_plan_inputs(pf: pq.ParquetFile, mods: list[str], batch_rows: int
                      ) -> tuple[pa.ChunkedArray, np.ndarray, bool]:
    """Buckets and byte spans (:func:`spans`) of every sample, and whether the keys are in order,
    from one pass over those columns (keys are looked at batch by batch, never held; sizes are
    summed into one span per sample as they come, 8 bytes a sample whatever the modalities)."""
    size_cols = [f"size.{m}" for m in sorted(mods)]
    buckets = []
    sample_spans = np.empty(pf.metadata.num_rows, dtype=np.int64)
    at = 0
    in_order, last = True, None
    for batch in _batches(pf, batch_rows, ["key", "bucket", *size_cols]):
        keys = batch.column(0)
        if in_order and len(keys):
            in_order = (last is None or pc.less(last, keys[0]).as_py()) and ascending(keys)
            last = keys[len(keys) - 1]
        buckets.append(pc.dictionary_encode(batch.column(1)))
        sample_spans[at : at + batch.num_rows] = spans([batch.column(c).to_numpy() for c in size_cols])
        at += batch.num_rows
    bucket_type = pa.dictionary(pa.int32(), pa.string())
    chunked = pa.chunked_array(buckets, type=bucket_type) if buckets else pa.chunked_array([], pa.string())
    return chunked, sample_spans[:at], in_order


def write_plan_file(samples_path: str | os.PathLike[str], plan_path: str | os.PathLike[str],
                    config: ShardingConfig, *, row_group_rows: int | None = None, batch_rows: int = BATCH_ROWS,
                    shards_path: str | os.PathLike[str] | None = None) -> ShardLayout:
    """Plan the samples of ``samples_path`` (samples.parquet) and write ``plan_path`` (plan.parquet).

    Memory stays bounded at any source size: the plan itself needs each sample's bucket and
    sizes only; the rows are then scattered, batch by batch, into one temporary Arrow file per
    output row group (beside ``plan_path``) and each row group is put in
    plan order and written from its file alone. The content is that of :func:`plan_table`.

    ``shards_path``: also write shards.parquet there (:func:`write_shards_file`), one row per shard
    with its count, tar sizes and plan digest, computed from each row group as it is written, so
    the commit reads a row per shard instead of every sample again.
    """
    # Read when called, not when defined: a test scales a big source's row groups down.
    row_group_rows = row_group_rows or ROW_GROUP_ROWS
    pf = pq.ParquetFile(samples_path)
    schema_in = pf.schema_arrow.remove_metadata()
    mods = table_modalities(schema_in)
    buckets, sample_spans, in_order = _read_plan_inputs(pf, mods, batch_rows)
    keys = None if in_order else pq.read_table(samples_path, columns=["key"]).column("key")
    layout = layout_shards(buckets, sample_spans, config, modalities=len(mods), keys=keys)
    del buckets, sample_spans, keys
    # Arrow's allocator keeps freed pages for reuse; the scatter below allocates differently
    # (whole batches), so hand those back rather than hold both high-water marks.
    pa.default_memory_pool().release_unused()
    schema = plan_schema(schema_in)
    digests = _ShardDigests(tuple(sorted(mods)), config.part_size) if shards_path is not None else None
    refs: list[ShardRef] = []
    n = len(layout.order)
    if n <= row_group_rows:  # one row group: no scatter needed
        table = _with_shard_columns(pq.read_table(samples_path).take(pa.array(layout.order)), layout, 0, schema)
        write_plan_table(plan_path, table, row_group_rows)
        if digests is not None:
            refs = [*digests.feed(table), *digests.finish()]
            write_shards_file(shards_path, refs, config.part_size, n)
        return layout
    pos = np.empty(n, dtype=np.int64)
    pos[layout.order] = np.arange(n, dtype=np.int64)
    groups = -(-n // row_group_rows)
    scatter_schema = schema_in.append(pa.field(_POS, pa.int64()))
    Path(plan_path).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".plan-scatter-", dir=Path(plan_path).parent) as tmp:
        paths = [Path(tmp) / f"{g:06d}.arrow" for g in range(groups)]
        writers = [ipc.new_file(p, scatter_schema) for p in paths]
        try:
            start = 0
            for batch in _batches(pf, batch_rows):
                p = pos[start : start + batch.num_rows]
                start += batch.num_rows
                batch = pa.RecordBatch.from_arrays([*batch.columns, pa.array(p)], schema=scatter_schema)
                g = p // row_group_rows
                if g.min() == g.max():
                    writers[int(g[0])].write_batch(batch)
                    continue
                by_group = np.argsort(g, kind="stable")
                batch = batch.take(pa.array(by_group))
                g = g[by_group]
                cuts = np.flatnonzero(np.diff(g)) + 1
                for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(g)], strict=True):
                    writers[int(g[a])].write_batch(batch.slice(int(a), int(b - a)))
        finally:
            for w in writers:
                w.close()
        del pos
        with atomic_writer(plan_path) as fh, plan_writer(fh, schema) as out:
            for g, path in enumerate(paths):
                with pa.memory_map(str(path)) as src:
                    rows = ipc.open_file(src).read_all()
                    first = g * row_group_rows
                    local = rows.column(_POS).to_numpy() - first
                    # Without a shuffle a row group is a run of one or two buckets in key order,
                    # which is the order its rows were scattered in: nothing to move.
                    if len(local) > 1 and not bool(np.all(local[1:] > local[:-1])):
                        back = np.empty(len(local), dtype=np.int64)
                        back[local] = np.arange(len(local), dtype=np.int64)
                        rows = rows.take(pa.array(back))
                    rows = _with_shard_columns(rows, layout, first, schema)
                    out.write_table(rows, row_group_size=row_group_rows)
                    if digests is not None:
                        refs += digests.feed(rows)
                    del rows
                path.unlink()
    if digests is not None:
        refs += digests.finish()
        write_shards_file(shards_path, refs, config.part_size, n)
    return layout


# ---------------------------------------------------------------- what the commit reads

@dataclass(frozen=True, slots=True)
class ShardRef:
    """One planned shard as the commit sees it: its place, sample count, tar sizes and plan
    digest, without its samples. Has the attributes ``ShardPlan`` has for the manifests, the
    digest cache and the outputs record (``bucket``, ``index``, ``relpath``, ``modalities``,
    ``tar_bytes``, ``digest``, ``count``)."""

    bucket: str
    index: int
    relpath: str
    modalities: tuple[str, ...]
    count: int
    sizes: tuple[int, ...]  # tar bytes, aligned with modalities
    plan_digest: str

    def tar_bytes(self, modality: str) -> int:
        return self.sizes[self.modalities.index(modality)]

    def restricted(self, modalities: tuple[str, ...]) -> ShardRef:
        """This shard as a plan of ``modalities`` only (``ShardPlan.restricted``; its digest stays)."""
        keep = tuple(sorted(m for m in self.modalities if m in modalities))
        return ShardRef(self.bucket, self.index, self.relpath, keep, self.count,
                        tuple(self.tar_bytes(m) for m in keep), self.plan_digest)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def digest(self) -> str:
        return self.plan_digest


# A planned shard as the manifests, the checks and the outputs record take it: ``ShardPlan`` (its
# samples in memory) or ``ShardRef`` (a row of shards.parquet); none of them reads the samples.
Shard = ShardPlan | ShardRef


def _sample_records(batch: pa.RecordBatch, mods: Sequence[str]) -> pa.Array:
    """Per sample, the bytes ``ShardPlan.digest`` feeds its hash: the key, then per modality
    ``|m|name|size|fingerprint``; one string array, so a shard's bytes are one slice of it."""
    parts: list[pa.Array | str] = [batch.column("key")]
    for m in mods:
        parts += [f"|{m}|", batch.column(f"name.{m}"), "|", pc.cast(batch.column(f"size.{m}"), pa.string()), "|",
                  batch.column(f"fingerprint.{m}")]
    # Fingerprints are never null; were one, Python's f-string would say "None": so does this.
    parts = [p if isinstance(p, str) else p.fill_null("None") for p in parts]
    return pc.binary_join_element_wise(*parts, "")


class _OpenShard:
    __slots__ = ("bucket", "index", "count", "spans", "hash")

    def __init__(self, bucket: str, index: int, mods: tuple[str, ...], part_size: int) -> None:
        self.bucket, self.index, self.count = bucket, index, 0
        self.spans = [0] * len(mods)
        head = f"{PLAN_VERSION}|{bucket}|{shard_relpath(index, part_size)}|{','.join(mods)}"
        self.hash = hashlib.sha256(head.encode())


class _ShardDigests:
    """Shards of plan rows fed in plan order, batch by batch (a shard may span batches): each
    one's count, tar sizes and plan digest, with one Python object per shard, none per sample."""

    def __init__(self, mods: tuple[str, ...], part_size: int) -> None:
        self.mods, self.part_size = mods, part_size
        self.cur: _OpenShard | None = None

    def _done(self, s: _OpenShard) -> ShardRef:
        sizes = tuple(-(-(span + END_OF_ARCHIVE) // RECORD) * RECORD for span in s.spans)
        return ShardRef(s.bucket, s.index, shard_relpath(s.index, self.part_size), self.mods, s.count, sizes,
                        s.hash.hexdigest())

    def feed(self, batch: pa.RecordBatch | pa.Table) -> list[ShardRef]:
        """The shards that end before the last row of ``batch`` (the last one may go on)."""
        n = batch.num_rows
        if n == 0:
            return []
        if isinstance(batch, pa.Table):
            batch = batch.combine_chunks().to_batches()[0]
        mods = self.mods
        index = batch.column(SHARD_INDEX).to_numpy()
        codes = pc.dictionary_encode(batch.column(SHARD_BUCKET))
        bcode = codes.indices.to_numpy()
        bnames = codes.dictionary.to_pylist()
        change = np.flatnonzero((index[1:] != index[:-1]) | (bcode[1:] != bcode[:-1])) + 1
        starts = np.r_[0, change]
        ends = np.r_[change, n]
        recs = _sample_records(batch, mods)
        roff = np.frombuffer(recs.buffers()[1], dtype=np.int32)[recs.offset : recs.offset + n + 1]
        data = memoryview(recs.buffers()[2])
        seg_spans = []
        for m in mods:
            member = spans([batch.column(f"size.{m}").to_numpy()])
            seg_spans.append(np.add.reduceat(member, starts).tolist())
        finished = []
        cur = self.cur
        for k, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            name, idx = bnames[bcode[a]], int(index[a])
            if cur is None or (cur.bucket, cur.index) != (name, idx):
                if cur is not None:
                    finished.append(self._done(cur))
                cur = _OpenShard(name, idx, mods, self.part_size)
            cur.count += b - a
            for i in range(len(mods)):
                cur.spans[i] += seg_spans[i][k]
            cur.hash.update(data[roff[a] : roff[b]])
        self.cur = cur
        return finished

    def finish(self) -> list[ShardRef]:
        cur, self.cur = self.cur, None
        return [] if cur is None else [self._done(cur)]


def read_shard_refs(plan_path: str | os.PathLike[str] | BinaryIO, part_size: int, *,
                    batch_rows: int = BATCH_ROWS) -> list[ShardRef]:
    """Every shard of plan.parquet, in plan order, from one pass in batches (memory: one batch)."""
    pf = pq.ParquetFile(plan_path)
    mods = tuple(sorted(table_modalities(pf.schema_arrow)))
    columns = [SHARD_BUCKET, SHARD_INDEX, "key"]
    for m in mods:
        columns += [f"name.{m}", f"size.{m}", f"fingerprint.{m}"]
    digests = _ShardDigests(mods, part_size)
    refs = [ref for batch in _batches(pf, batch_rows, columns) for ref in digests.feed(batch)]
    return refs + digests.finish()


# ---------------------------------------------------------------- shards.parquet

_SHARDS_META = b"pid.shards"


def write_shards_file(path: str | os.PathLike[str], refs: Sequence[ShardRef], part_size: int,
                      plan_rows: int) -> Path:
    """shards.parquet: one row per shard of a plan (bucket, index, count, tar bytes per modality,
    plan digest), with the part size and the plan's row count it was made for."""
    mods = refs[0].modalities if refs else ()
    cols: dict[str, pa.Array] = {
        SHARD_BUCKET: pa.array([r.bucket for r in refs], pa.string()),
        SHARD_INDEX: pa.array([r.index for r in refs], pa.int32()),
        "count": pa.array([r.count for r in refs], pa.int64()),
    }
    for i, m in enumerate(mods):
        cols[f"tar_bytes.{m}"] = pa.array([r.sizes[i] for r in refs], pa.int64())
    cols["digest"] = pa.array([r.plan_digest for r in refs], pa.string())
    meta = {"version": SHARDS_VERSION, "part_size": part_size, "plan_rows": plan_rows}
    table = pa.table(cols).replace_schema_metadata({_SHARDS_META: json.dumps(meta).encode()})
    with atomic_writer(path) as fh:
        pq.write_table(table, fh, compression="zstd")
    return Path(path)


def read_shards_file(path: str | os.PathLike[str], plan_path: str | os.PathLike[str] | BinaryIO,
                     part_size: int) -> list[ShardRef]:
    """The shards of ``plan_path`` from the shards.parquet written with it (:func:`write_plan_file`).

    Refused, naming both files, when it was made for another part size or a plan of another
    number of rows (a plan written again without it): :func:`read_shard_refs` reads the plan itself.
    """
    table = pq.read_table(path)
    try:
        meta = json.loads((table.schema.metadata or {})[_SHARDS_META])
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not a shards.parquet (no {_SHARDS_META.decode()} metadata); "
                         f"delete it and plan again") from exc
    rows = pq.ParquetFile(plan_path).metadata.num_rows
    if (meta.get("version"), meta.get("part_size"), meta.get("plan_rows")) != (SHARDS_VERSION, part_size, rows):
        raise ValueError(f"{path} was written for another plan than {plan_path} (version {meta.get('version')}, "
                         f"part_size {meta.get('part_size')}, {meta.get('plan_rows')} rows; the plan has {rows} "
                         f"rows, part_size {part_size}); delete it and plan again")
    mods = tuple(c.split(".", 1)[1] for c in table.column_names if c.startswith("tar_bytes."))
    d = table.to_pydict()
    sizes = list(zip(*(d[f"tar_bytes.{m}"] for m in mods), strict=True)) if mods else [()] * table.num_rows
    return [ShardRef(b, i, shard_relpath(i, part_size), mods, c, tuple(sz), dg)
            for b, i, c, sz, dg in zip(d[SHARD_BUCKET], d[SHARD_INDEX], d["count"], sizes, d["digest"], strict=True)]
