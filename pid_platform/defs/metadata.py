"""Small helpers that turn build results into readable asset metadata."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import dagster as dg

MAX_LISTED = 50  # metadata is for people; long lists are cut and say so


def bucket_label(bucket: str | None) -> str:
    return bucket or "(flat)"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def first(items: Sequence[str], n: int = MAX_LISTED) -> list[str]:
    return list(items[:n]) + ([f"... and {len(items) - n} more"] if len(items) > n else [])


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[object]]) -> dg.TableMetadataValue:
    """A table the UI sorts and types (``MetadataValue.table`` with a ``TableSchema``);
    ``columns``: (name, type), type one of string, int, float, bool. An asset states its own
    ``dagster/row_count`` beside it (``row_count``): what the asset holds, not this table's rows."""
    casts = {"string": str, "int": int, "float": float, "bool": bool}
    records = [dg.TableRecord({name: casts[kind](value) for (name, kind), value in zip(columns, row, strict=True)})
               for row in rows]
    schema = dg.TableSchema(columns=[dg.TableColumn(name, kind) for name, kind in columns])
    return dg.MetadataValue.table(records, schema=schema)


def row_count(n: int) -> dict[str, dg.MetadataValue]:
    """``dagster/row_count``: the number of rows (samples, files) an asset holds, which the UI
    shows on the asset and plots across materializations."""
    return {"dagster/row_count": dg.MetadataValue.int(int(n))}
