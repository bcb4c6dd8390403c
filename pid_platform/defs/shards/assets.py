"""``twin_tar_shards``: the size-bounded twin tars of one source."""

import hashlib
import shutil
from dataclasses import asdict
from pathlib import Path

import dagster as dg

from pid_platform.defs.automation.fingerprint import FINGERPRINT_NAME
from pid_platform.defs.groups import BUILD_GROUP, BUILD_POOL
from pid_platform.defs.intake.assets import ratio_label
from pid_platform.defs.metadata import bucket_label, human_bytes, row_count, table
from pid_platform.defs.partitions import sources_partitions
from pid_platform.defs.plots import png_markdown, shard_sizes_png
from pid_platform.defs.resources import SHARDING_CODE_VERSION, ShardingResource, SourceStoreResource
from pid_platform.defs.retries import IO_RETRY, retry_only_transient
from pid_platform.defs.settings import SETTINGS_ASSET, settings_for_run, settings_metadata
from pid_platform.sharding.commit import versions
from pid_platform.sharding.commit.state import INTAKE_SETTINGS, REPORT, SAMPLES, state_dir
from pid_platform.sharding.intake.cache import CACHE_NAME
from pid_platform.sharding.layout import final_dir
from pid_platform.sharding.output_lock import build_lock
from pid_platform.sharding.pipeline import run_sharding, summarize
from pid_platform.sharding.plan.shard_plan import ShardPlan

# What intake leaves beside a build, and a re-shard of the committed samples carries over.
INTAKE_STATE = (SAMPLES, REPORT, INTAKE_SETTINGS, CACHE_NAME, FINGERPRINT_NAME)


def sample_set_to_cut(out: Path, source: str) -> str:
    """Where this step's samples come from: ``staged`` (this build's intake), or ``committed``
    (nothing staged: the committed build's sample set is copied into a new staging folder and
    re-sharded with the source's current settings). Refuses at once when there is neither."""
    if (state_dir(versions.staging_dir(out)) / SAMPLES).is_file():
        return "staged"
    committed = state_dir(final_dir(out))
    if not (committed / SAMPLES).is_file():
        raise dg.Failure(
            description=(
                f"twin_tar_shards of {source} has no sample set to cut: no build of it is staged or committed. "
                "Select sample_set with it (sample_set, twin_tar_shards and what follows them), or launch the "
                f"source_build job for partition {source!r}"
            ),
            allow_retries=False,
        )
    with build_lock(out):
        staged = state_dir(versions.begin(out))
        staged.mkdir(exist_ok=True)
        for name in INTAKE_STATE:
            if (committed / name).is_file():
                shutil.copy2(committed / name, staged / name)
    return "committed"


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

    Materialized without `sample_set` when no intake is staged, it re-shards the committed sample
    set with the source's current settings (`sample_set: committed` in the metadata); with
    neither staged nor committed samples it fails at once, saying to select `sample_set` too.
    """
    source = context.partition_key
    out = source_store.source_out(source)
    with retry_only_transient():
        run_settings = settings_for_run(context, source_store, sharding, source)
        samples_from = sample_set_to_cut(out, source)
    if samples_from == "committed":
        context.log.info(f"{source}: no intake staged; re-sharding the committed sample set of {source} (key "
                         "indexes and manifests follow once materialized; the published version stays until then)")
    config = run_settings.config

    def progress(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            context.log.info(f"{source}: {done}/{total} shards")

    with retry_only_transient():
        plans, results = run_sharding(
            source_store.open(), source, out, config, num_workers=sharding.num_workers, progress=progress
        )
    buckets = summarize(results)
    written = sum(int(r.written) for r in results)
    by_bucket = table(
        (("bucket", "string"), ("shards", "int"), ("samples", "int"), ("bytes", "int"), ("size", "string"),
         ("written", "int"), ("reused", "int")),
        [(bucket_label(b.bucket), b.shards, b.samples, b.bytes, human_bytes(b.bytes), b.written, b.shards - b.written)
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
            "sample_set": samples_from,
            **settings_metadata(run_settings),
            "shards_by_bucket": by_bucket,
            **row_count(sum(b.samples for b in buckets.values())),
            "shard_sizes_plot": png_markdown(plot, f"shard sizes of {source} against the bound"),
            # Staged until wdinfo_manifests commits them; this is where they are from then on.
            "output": dg.MetadataValue.path(source_store.output_location(source)),
        },
        tags=run_settings.tags,
        data_version=dg.DataVersion(_plans_digest(config.version(), plans)),
    )
