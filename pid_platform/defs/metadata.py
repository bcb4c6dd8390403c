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


def table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[object]]) -> dict[str, dg.MetadataValue]:
    """A table the UI sorts and types (``MetadataValue.table`` with a ``TableSchema``), with its
    row count under ``dagster/row_count``; ``columns``: (name, type), type one of string, int,
    float, bool. Spread it into an asset's metadata under a key of its own:
    ``{**{"files": t["table"]}, "dagster/row_count": t["dagster/row_count"]}``."""
    casts = {"string": str, "int": int, "float": float, "bool": bool}
    records = [dg.TableRecord({name: casts[kind](value) for (name, kind), value in zip(columns, row, strict=True)})
               for row in rows]
    schema = dg.TableSchema(columns=[dg.TableColumn(name, kind) for name, kind in columns])
    return {"table": dg.MetadataValue.table(records, schema=schema),
            "dagster/row_count": dg.MetadataValue.int(len(records))}
