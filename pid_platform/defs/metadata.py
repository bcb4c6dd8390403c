"""Small helpers that turn build results into readable asset metadata."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
