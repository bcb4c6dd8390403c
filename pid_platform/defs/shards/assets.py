"""``twin_tar_shards``: the size-bounded twin tars of one source."""

import hashlib
from dataclasses import asdict

import dagster as dg

from pid_platform.defs.groups import BUILD_GROUP, BUILD_POOL
from pid_platform.defs.intake.assets import ratio_label
from pid_platform.defs.metadata import bucket_label, human_bytes, markdown_table
from pid_platform.defs.partitions import sources_partitions
from pid_platform.defs.plots import png_markdown, shard_sizes_png
from pid_platform.defs.resources import SHARDING_CODE_VERSION, ShardingResource, SourceStoreResource
from pid_platform.defs.retries import IO_RETRY, fail_without_retry_on
from pid_platform.defs.settings import SETTINGS_ASSET, settings_for_run, settings_metadata
from pid_platform.sharding.pipeline import run_sharding, summarize
from pid_platform.sharding.shard_plan import ShardPlan


def _plans_digest(config_version: str, plans: list[ShardPlan]) -> str:
    # A plan's digest covers its keys, files and place; together they name the bytes on disk.
    h = hashlib.sha256(config_version.encode())
    for p in plans:
        h.update(p.digest().encode())
    return h.hexdigest()[:16]


@dg.asset(
    partitions_def=sources_partitions,
    deps=["sample_set", SETTINGS_ASSET],  # the tars are cut with the source's settings
    group_name=BUILD_GROUP,
    kinds={"python", "webdataset"},
    code_version=SHARDING_CODE_VERSION,
    pool=BUILD_POOL,
    retry_policy=IO_RETRY,
)
def twin_tar_shards(
    context: dg.AssetExecutionContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> dg.MaterializeResult:
    """Twin tars of a source: `<bucket>/<modality>/part_<NNNNNN>/<NNNNNN>.tar`, one tar per
    modality per shard, all holding the same keys in the same order, each shard within
    `max_shard_size_mb` (or `shard_size` samples).

    The tars are written into the source's staging folder (`.<source>.pid-staging` beside its
    output); shards whose inputs and plan are unchanged since the last build are hard-linked
    from the published output, not rewritten. The published output does not change until
    `wdinfo_manifests` commits the new version.
    """
    source = context.partition_key
    out = source_store.source_out(source)
    with fail_without_retry_on():
        settings = settings_for_run(context, source_store, sharding, source)
    config = settings.config

    def progress(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            context.log.info(f"{source}: {done}/{total} shards")

    with fail_without_retry_on():
        plans, results = run_sharding(
            source_store.open(), source, out, config, num_workers=sharding.num_workers, progress=progress
        )
    buckets = summarize(results)
    written = sum(int(r.written) for r in results)
    table = markdown_table(
        ("bucket", "shards", "samples", "bytes", "written", "reused"),
        [(bucket_label(b.bucket), b.shards, b.samples, human_bytes(b.bytes), b.written, b.shards - b.written)
         for b in buckets.values()],
    )
    # MB as the bound counts them (max_shard_size_mb), so the line and the bars share one unit.
    mb = config.max_shard_bytes / config.max_shard_size_mb
    ordered = sorted(results, key=lambda r: (r.bucket, r.index))
    plot = shard_sizes_png(
        [sum(r.bytes.values()) / mb for r in ordered], [ratio_label(r.bucket) for r in ordered],
        None if config.shard_size > 0 else config.max_shard_size_mb,
        title=f"{source}: shard sizes" + (f" ({config.shard_size} samples each)" if config.shard_size > 0 else ""),
    )
    return dg.MaterializeResult(
        metadata={
            "shards": len(plans),
            "samples": sum(b.samples for b in buckets.values()),
            "bytes": sum(b.bytes for b in buckets.values()),
            "size": human_bytes(sum(b.bytes for b in buckets.values())),
            "buckets": len(buckets),
            "written": written,
            "reused": len(results) - written,
            "config_version": config.version(),
            "sharding": dg.MetadataValue.json(asdict(config)),
            **settings_metadata(settings),
            "shards_by_bucket": dg.MetadataValue.md(table),
            "shard_sizes_plot": png_markdown(plot, f"shard sizes of {source} against the bound"),
            # Staged until wdinfo_manifests commits them; this is where they are from then on.
            "output": dg.MetadataValue.path(source_store.output_location(source)),
        },
        data_version=dg.DataVersion(_plans_digest(config.version(), plans)),
    )
