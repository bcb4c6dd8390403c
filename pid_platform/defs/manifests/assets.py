"""Key indexes and ``wdinfo.json`` manifests of one source, and the catalog of all sources."""

from pathlib import Path

import dagster as dg

from pid_platform.build.catalog import build_catalog
from pid_platform.build.pipeline import run_key_indexes, run_manifests
from pid_platform.defs.automation.conditions import FOLLOW_UPSTREAM
from pid_platform.defs.groups import BUILD_GROUP, CATALOG_GROUP
from pid_platform.defs.metadata import bucket_label, first, markdown_table
from pid_platform.defs.partitions import sources_partitions
from pid_platform.defs.resources import SHARDING_CODE_VERSION, ShardingResource, SourceStoreResource
from pid_platform.defs.retries import IO_RETRY, fail_without_retry_on


@dg.asset(
    partitions_def=sources_partitions,
    deps=["twin_tar_shards"],
    group_name=BUILD_GROUP,
    kinds={"python", "parquet"},
    code_version=SHARDING_CODE_VERSION,
    automation_condition=FOLLOW_UPSTREAM,
    retry_policy=IO_RETRY,
)
def key_indexes(
    context: dg.AssetExecutionContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> dg.MaterializeResult:
    """One parquet key index per twin-tar shard: the sample keys in member order, the original
    basenames, and each member's offset and size per modality (the loader's index mode reads
    these instead of scanning tars). Written into the staging folder beside the staged tars.
    """
    source = context.partition_key
    out = source_store.source_out(source)
    # The staged tars were cut with the config recorded beside them, whatever a later run asks for.
    with fail_without_retry_on():
        config, plans, written = run_key_indexes(out, num_workers=sharding.num_workers)
    per_bucket: dict[str, int] = {}
    for p in plans:
        per_bucket[p.bucket] = per_bucket.get(p.bucket, 0) + 1
    return dg.MaterializeResult(
        metadata={
            "key_indexes": len(written),
            "rows": sum(len(p.samples) for p in plans),
            "config_version": config.version(),
            "indexes_by_bucket": dg.MetadataValue.md(
                markdown_table(("bucket", "key indexes"), [(bucket_label(b), n) for b, n in sorted(per_bucket.items())])
            ),
        }
    )


@dg.asset(
    partitions_def=sources_partitions,
    deps=["key_indexes"],
    group_name=BUILD_GROUP,
    kinds={"python", "json"},
    code_version=SHARDING_CODE_VERSION,
    automation_condition=FOLLOW_UPSTREAM,
    retry_policy=IO_RETRY,
)
def wdinfo_manifests(
    context: dg.AssetExecutionContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> dg.MaterializeResult:
    """One ``wdinfo.json`` per bucket: the tars, their key counts, byte sizes and checksums.

    This is the commit point of a source's build: the manifests are written last, into the
    staging folder, after every tar and key index they list; then the staging folder replaces
    the source's output folder in one swap of folders. ``removed`` lists the files of the
    previous version that the new one no longer has.
    """
    source = context.partition_key
    out = source_store.source_out(source)
    with fail_without_retry_on():
        config, manifests, removed = run_manifests(out, source, num_workers=sharding.num_workers)
    rows = [
        (bucket_label(m.bucket), len(m.manifest.tars), m.manifest.total_key_count, m.manifest.chunk_size,
         str(m.path.relative_to(out)))
        for m in manifests
    ]
    if removed:
        context.log.info(f"{source}: the new version dropped {len(removed)} files of the previous one")
    return dg.MaterializeResult(
        metadata={
            "manifests": dg.MetadataValue.json([str(m.path) for m in manifests]),
            "buckets": len(manifests),
            "tars": sum(len(m.manifest.tars) for m in manifests),
            "samples": sum(m.manifest.total_key_count for m in manifests),
            "config_version": config.version(),
            "manifests_by_bucket": dg.MetadataValue.md(
                markdown_table(("bucket", "tars", "samples", "chunk_size", "manifest"), rows)
            ),
            "removed_count": len(removed),
            "removed": dg.MetadataValue.json(first([str(p.relative_to(out)) for p in removed])),
            "output": dg.MetadataValue.path(str(out)),
        }
    )


@dg.asset(
    deps=["wdinfo_manifests"],
    group_name=CATALOG_GROUP,
    kinds={"python", "json"},
    automation_condition=FOLLOW_UPSTREAM,
    retry_policy=IO_RETRY,
)
def dataset_catalog(source_store: SourceStoreResource, sharding: ShardingResource) -> dg.MaterializeResult:
    """``catalog.json`` at the output root: every source with a manifest, and the logical datasets
    (``sharding.datasets``, plus ``all``) that group them; the loader resolves a dataset name
    to its manifests through it.
    """
    with fail_without_retry_on():
        path, catalog = build_catalog(Path(source_store.output_root), sharding.datasets)
    rows = [(s.name, len(s.buckets), s.total_key_count, ", ".join(s.data_keys)) for s in catalog.sources.values()]
    return dg.MaterializeResult(
        metadata={
            "sources": dg.MetadataValue.json(sorted(catalog.sources)),
            "datasets": dg.MetadataValue.json(catalog.datasets),
            "total_key_count": sum(s.total_key_count for s in catalog.sources.values()),
            "sources_table": dg.MetadataValue.md(
                markdown_table(("source", "buckets", "samples", "modalities"), rows)
            ),
            "catalog": dg.MetadataValue.path(str(path)),
        }
    )
