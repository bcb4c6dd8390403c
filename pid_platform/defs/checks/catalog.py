"""Blocking check on ``dataset_catalog``: every source with a committed build is listed in the
catalog, under its current manifests, so a training job that names ``all`` gets every source."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from loader.formats.catalog import CATALOG_NAME, SourceEntry, parse_catalog
from loader.formats.errors import FormatError
from pid_platform.defs.checks.common import result
from pid_platform.defs.resources import SourceStoreResource
from pid_platform.sharding.catalog import scan_s3_sources, scan_sources
from pid_platform.sharding.commit.s3_output import get_bytes


def built_and_catalog(source_store: SourceStoreResource) -> tuple[dict[str, SourceEntry], bytes | None, str]:
    """The sources with committed manifests under the output root, the bytes of its
    ``catalog.json`` (None: none yet) and where that is."""
    root = source_store.root_target()
    if root is not None:
        return scan_s3_sources(root), get_bytes(root, CATALOG_NAME), f"{root}/{CATALOG_NAME}"
    out = Path(source_store.output_root)
    path = out / CATALOG_NAME
    return scan_sources(out), path.read_bytes() if path.is_file() else None, str(path)


@dg.asset_check(
    asset="dataset_catalog",
    blocking=True,
    description="catalog.json lists every source that has committed manifests under the output root, each "
                "with exactly those manifests, and dataset 'all' names them all.",
)
def catalog_lists_every_built_source(source_store: SourceStoreResource) -> dg.AssetCheckResult:
    built, data, where = built_and_catalog(source_store)
    if data is None:
        return result([f"{where}: missing"], sources_built=len(built))
    try:
        catalog = parse_catalog(data, where)
    except FormatError as exc:
        return result([str(exc)], sources_built=len(built))
    listed = catalog.sources
    problems = [f"{name}: built but not in {where}" for name in sorted(set(built) - set(listed))]
    problems += [f"{name}: in {where} but has no committed manifests" for name in sorted(set(listed) - set(built))]
    problems += [f"{name}: {where} lists other manifests than the committed ones"
                 for name in sorted(set(built) & set(listed))
                 if sorted(listed[name].manifests) != sorted(built[name].manifests)]
    if sorted(catalog.datasets.get("all") or []) != sorted(built):
        problems.append(f"{where}: dataset 'all' is not every built source")
    return result(problems, sources_built=len(built), sources_listed=len(listed))
