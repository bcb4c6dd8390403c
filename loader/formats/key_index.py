"""Parquet key index: one file per tar, one row per sample in member order.

Columns: ``key``, ``basename`` (original, before sanitising), ``bucket``, ``width``, ``height``
and per modality ``member.<m>`` (member name), ``offset.<m>`` (byte offset of the member's
header in its tar; data starts 512 bytes later) and ``size.<m>`` (data size). A reader can seek
straight to any sample, or split a shard into byte ranges.

The one reader and writer of the format: the build writes it (:func:`key_index_table`,
:func:`write_key_index`), the build's verification and the training loader's index mode read it
(:func:`read_key_columns`); nothing else spells a column name.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa
from pyarrow._parquet import ParquetReader

from loader.formats.atomic import atomic_writer
from loader.formats.errors import FormatError

KEY = "key"
BASENAME = "basename"
BUCKET = "bucket"
WIDTH = "width"
HEIGHT = "height"
_MEMBER, _OFFSET, _SIZE = "member.", "offset.", "size."


def member_column(modality: str) -> str:
    return f"{_MEMBER}{modality}"


def offset_column(modality: str) -> str:
    return f"{_OFFSET}{modality}"


def size_column(modality: str) -> str:
    return f"{_SIZE}{modality}"


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
        KEY: pa.array([r.key for r in rows], pa.string()),
        BASENAME: pa.array([r.basename for r in rows], pa.string()),
        BUCKET: pa.array([r.bucket for r in rows], pa.string()),
        WIDTH: pa.array([r.width for r in rows], pa.int32()),
        HEIGHT: pa.array([r.height for r in rows], pa.int32()),
    }
    for m in modalities:
        cols[member_column(m)] = pa.array([r.members[m][0] for r in rows], pa.string())
        cols[offset_column(m)] = pa.array([r.members[m][1] for r in rows], pa.int64())
        cols[size_column(m)] = pa.array([r.members[m][2] for r in rows], pa.int64())
    return pa.table(cols)


def write_key_index(path: str | os.PathLike[str], table: pa.Table) -> None:
    # No created_by / statistics drift: the same rows always give the same bytes.
    import pyarrow.parquet as pq  # here: importing it loads pyarrow.fs and its cloud filesystems' libraries

    with atomic_writer(path) as fh:
        pq.write_table(table, fh, compression="zstd", write_statistics=False, store_schema=False)


def read_key_index(path: str | os.PathLike[str], columns: list[str] | None = None) -> pa.Table:
    """The whole table (or ``columns``), for inspection and tests; readers that serve samples
    use :func:`read_key_columns`."""
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=columns)


def _parquet_reader(source: bytes | memoryview | str | os.PathLike[str]) -> ParquetReader:
    """The reader under ``pq.ParquetFile``, opened on the system allocator. Measured at 0
    workers over a bucket, where key indexes are read on the read-ahead's threads: arrow's
    default pool (mimalloc, a heap per thread) held ~10 MB more at the end than malloc, and
    ``pyarrow.parquet`` (which ``ParquetFile`` needs) loads ``pyarrow.fs``, whose S3 library's
    start-up alone touched 2.7 MB."""
    reader = ParquetReader(memory_pool=pa.system_memory_pool())
    reader.open(pa.BufferReader(source) if isinstance(source, (bytes, memoryview)) else os.fspath(source))
    return reader


def index_modalities(table: pa.Table | pa.Schema) -> list[str]:
    names = table.names if isinstance(table, pa.Schema) else table.column_names
    return [c[len(_MEMBER):] for c in names if c.startswith(_MEMBER)]


@dataclass(frozen=True)
class KeyColumns:
    """The columns of one key index a reader asked for, as Python lists in member order.

    ``offsets`` (and ``members``, ``sizes`` when asked for) hold only the modalities the index
    has a column for: a caller decides what a missing one means.
    """

    keys: list[str]
    offsets: dict[str, list[int]] = field(default_factory=dict)  # modality -> header offsets
    members: dict[str, list[str]] = field(default_factory=dict)  # modality -> member names
    sizes: dict[str, list[int]] = field(default_factory=dict)  # modality -> data sizes


def read_key_columns(
    source: bytes | memoryview | str | os.PathLike[str], modalities: Sequence[str] | None = None, *,
    offsets: bool = True, members: bool = False, sizes: bool = False, origin: str | None = None,
) -> KeyColumns:
    """Keys, and per modality the header offsets (and member names, sizes), of one key index.

    ``source`` is a local path or the file's bytes (a remote index is fetched whole: parquet
    wants to seek, and the file is small). ``modalities=None`` reads every modality the index
    lists. ``FormatError`` names ``origin`` (default: the path) when the file is not a key index.

    This is the training loader's hot path (one call per shard a worker opens): a
    ``ParquetFile.read`` of only the columns asked for, on one thread, costs about a quarter of
    ``read_table`` (whose dataset layer and thread pool cost more than decoding a few hundred rows).
    """
    where = origin or (str(source) if isinstance(source, (str, os.PathLike)) else "key index")
    try:
        pf = _parquet_reader(source)
        have = set(pf.schema_arrow.names)
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise FormatError(f"{where}: not a readable key index ({exc}); rebuild it (pid-shard)") from None
    if KEY not in have:
        raise FormatError(f"{where}: a key index needs a {KEY!r} column, it has {sorted(have)}; rebuild it")
    mods = index_modalities(pf.schema_arrow) if modalities is None else list(modalities)
    wanted = {
        "offsets": [m for m in mods if offsets and offset_column(m) in have],
        "members": [m for m in mods if members and member_column(m) in have],
        "sizes": [m for m in mods if sizes and size_column(m) in have],
    }
    columns = [KEY, *(offset_column(m) for m in wanted["offsets"]),
               *(member_column(m) for m in wanted["members"]), *(size_column(m) for m in wanted["sizes"])]
    try:
        table = pf.read_all(column_indices=[pf.column_name_idx(c) for c in columns], use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise FormatError(f"{where}: not a readable key index ({exc}); rebuild it (pid-shard)") from None
    return KeyColumns(
        keys=table.column(KEY).to_pylist(),
        offsets={m: table.column(offset_column(m)).to_pylist() for m in wanted["offsets"]},
        members={m: table.column(member_column(m)).to_pylist() for m in wanted["members"]},
        sizes={m: table.column(size_column(m)).to_pylist() for m in wanted["sizes"]},
    )
