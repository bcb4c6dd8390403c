"""Build ``catalog.json`` from the manifests present under an output root."""

from __future__ import annotations

from pathlib import Path

from loader.formats.catalog import Catalog, SourceEntry, write_catalog
from loader.formats.wdinfo import WDINFO_NAME, read_wdinfo
from pid_platform.build.layout import STATE_DIR

ALL_DATASET = "all"


def scan_sources(output_root: Path) -> dict[str, SourceEntry]:
    sources: dict[str, SourceEntry] = {}
    if not output_root.is_dir():
        return sources
    # Dot-folders are never sources: a build's staging (.<source>.pid-staging) and replaced
    # (.<source>.pid-old) versions live beside its output until the commit finishes.
    for src in sorted(p for p in output_root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        manifests = sorted(
            m for m in src.rglob(WDINFO_NAME) if STATE_DIR not in m.parts
        )
        if not manifests:
            continue
        parsed = [read_wdinfo(m) for m in manifests]
        sources[src.name] = SourceEntry(
            name=src.name,
            manifests=[str(m.relative_to(output_root)) for m in manifests],
            buckets=sorted(w.bucket or "" for w in parsed),
            total_key_count=sum(w.total_key_count for w in parsed),
            data_keys=sorted({k for w in parsed for k in w.data_keys}),
        )
    return sources


def build_catalog(output_root: Path, datasets: dict[str, list[str]] | None = None) -> tuple[Path, Catalog]:
    """Every built source, plus the logical datasets given (and ``all``)."""
    sources = scan_sources(output_root)
    defined = {ALL_DATASET: sorted(sources)}
    for name, members in (datasets or {}).items():
        missing = [s for s in members if s not in sources]
        if missing:
            raise ValueError(
                f"dataset {name!r} names sources {missing} that have no manifest under {output_root}; "
                f"built sources: {sorted(sources)}"
            )
        defined[name] = sorted(members)
    catalog = Catalog(sources, defined, str(output_root))
    return write_catalog(output_root, catalog), catalog
