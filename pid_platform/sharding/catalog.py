"""Build ``catalog.json`` from the manifests present under an output root."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loader.formats.catalog import (
    ALL_DATASET,
    CATALOG_NAME,
    Catalog,
    SourceEntry,
    check_datasets,
    write_catalog,
)
from loader.formats.errors import FormatError
from loader.formats.wdinfo import WDINFO_NAME, WdinfoManifest, parse_wdinfo, read_wdinfo
from loader.mixture.definition import MixtureError
from pid_platform.sharding.commit.s3_output import S3Output, get_bytes, published_sources
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.layout import STATE_DIR
from pid_platform.sharding.state_doc import load_state_doc


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
        sources[src.name] = _entry(src.name, [str(m.relative_to(output_root)) for m in manifests],
                                   [read_wdinfo(m) for m in manifests])
    return sources


def scan_s3_sources(output_root: S3Output) -> dict[str, SourceEntry]:
    """Every source under an S3 output root with a current version; its entries name the
    manifests of that version, so the catalog pins versions (old ones stay readable until the
    cleanup job removes them, after their grace period)."""
    sources: dict[str, SourceEntry] = {}
    for name, pointer in published_sources(output_root).items():
        out = output_root.child(name)
        parsed = []
        for rel in pointer.manifest_paths():
            data = get_bytes(out, rel)
            if data is None:
                raise BuildError(f"{out}/{rel}: the current version's manifest is missing; rebuild source {name!r}")
            try:
                parsed.append(parse_wdinfo(load_state_doc(data, f"{out}/{rel}"), None, f"{out}/{rel}"))
            except (FormatError, ValueError) as exc:
                raise BuildError(f"{out}/{rel}: {exc}; rebuild source {name!r}") from None
        sources[name] = _entry(name, [f"{name}/{rel}" for rel in pointer.manifest_paths()], parsed)
    return sources


def _entry(name: str, manifests: list[str], parsed: list[WdinfoManifest]) -> SourceEntry:
    """A built source's catalog entry: its manifests (relative to the output root), parsed."""
    return SourceEntry(
        name=name,
        manifests=manifests,
        buckets=sorted(w.bucket or "" for w in parsed),
        total_key_count=sum(w.total_key_count for w in parsed),
        data_keys=sorted({k for w in parsed for k in w.data_keys}),
    )


def build_s3_catalog(output_root: S3Output, datasets: dict[str, Any] | None = None) -> tuple[str, Catalog]:
    """``catalog.json`` at an S3 output root, written after every version it names."""
    catalog = _catalog(scan_s3_sources(output_root), datasets, str(output_root))
    key = output_root.key(CATALOG_NAME)
    body = json.dumps(catalog.to_json(), indent=1).encode() + b"\n"
    output_root.store().put(key, body, content_type="application/json")
    return f"s3://{output_root.bucket}/{key}", catalog


def _catalog(sources: dict[str, SourceEntry], datasets: dict[str, Any] | None, where: str) -> Catalog:
    """The catalog of these built sources; each logical dataset (a list of sources, or a weighted
    mixture) is checked by the catalog's one reader of ``datasets`` (``MixtureError``, a
    ``ValueError``, naming the dataset, the source and the fix)."""
    if ALL_DATASET in sources:
        raise MixtureError(f"source {ALL_DATASET!r} under {where}: {ALL_DATASET!r} is the catalog's dataset of every "
                           "built source; rename the source's folder")
    try:
        defined = check_datasets(dict(datasets or {}), sources)
    except ValueError as exc:
        raise type(exc)(f"{exc} (built sources under {where}: {sorted(sources)})") from None
    return Catalog(sources, {ALL_DATASET: sorted(sources), **defined}, where)


def build_catalog(output_root: Path, datasets: dict[str, Any] | None = None) -> tuple[Path, Catalog]:
    """Every built source, plus the logical datasets given (and ``all``)."""
    catalog = _catalog(scan_sources(output_root), datasets, str(output_root))
    return write_catalog(output_root, catalog), catalog
