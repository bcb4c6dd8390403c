"""Parquet key index: one file per tar, one row per sample in member order.

Columns: ``key``, ``basename`` (original, before sanitising), ``bucket``, ``width``, ``height``
and per modality ``member.<m>`` (member name), ``offset.<m>`` (byte offset of the member's
header in its tar; data starts 512 bytes later) and ``size.<m>`` (data size). A reader can seek
straight to any sample, or split a shard into byte ranges.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from loader.formats.atomic import atomic_writer


@dataclass(frozen=True)
class KeyIndexRow:
    key: str
    basename: str
    bucket: str | None
    width: int | None
    height: int | None
    members: dict[str, tuple[str, int, int]]  # modality -> (member name, header offset, size)


def key_index_table(rows: Sequence[KeyIndexRow], modalities: Sequence[str]) -> pa.Table:
    cols: dict[str, pa.Array] = {
        "key": pa.array([r.key for r in rows], pa.string()),
        "basename": pa.array([r.basename for r in rows], pa.string()),
        "bucket": pa.array([r.bucket for r in rows], pa.string()),
        "width": pa.array([r.width for r in rows], pa.int32()),
        "height": pa.array([r.height for r in rows], pa.int32()),
    }
    for m in modalities:
        cols[f"member.{m}"] = pa.array([r.members[m][0] for r in rows], pa.string())
        cols[f"offset.{m}"] = pa.array([r.members[m][1] for r in rows], pa.int64())
        cols[f"size.{m}"] = pa.array([r.members[m][2] for r in rows], pa.int64())
    return pa.table(cols)


def write_key_index(path: str | os.PathLike[str], table: pa.Table) -> None:
    # No created_by / statistics drift: the same rows always give the same bytes.
    with atomic_writer(path) as fh:
        pq.write_table(table, fh, compression="zstd", write_statistics=False, store_schema=False)


def read_key_index(path: str | os.PathLike[str], columns: list[str] | None = None) -> pa.Table:
    return pq.read_table(path, columns=columns)


def index_modalities(table: pa.Table) -> list[str]:
    return [c.split(".", 1)[1] for c in table.column_names if c.startswith("member.")]
