"""Blocking checks on ``twin_tar_shards``: the twin-tar contract, read back from the staged tars.

They read the staging folder, before anything is published: a failure stops the run while the
source's output folder still holds the previous good version, untouched.
"""

import dagster as dg

from pid_platform.defs.checks.common import blocking_source_check, built_plans, result
from pid_platform.defs.resources import SourceStoreResource
from pid_platform.sharding.shard_plan import is_oversize_singleton
from pid_platform.sharding.verify_output import size_bound_violations, twin_key_mismatches
from pid_platform.sharding.versions import staging_dir


@blocking_source_check(
    "twin_tar_shards",
    "Every modality tar of a shard holds the same sample keys in the same order.",
)
def twin_tar_keys_match(context: dg.AssetCheckExecutionContext, source_store: SourceStoreResource) -> dg.AssetCheckResult:
    staged = staging_dir(source_store.source_out(context.partition_key))
    _, plans = built_plans(staged)
    return result(twin_key_mismatches(staged, plans), shards_checked=len(plans))


@blocking_source_check(
    "twin_tar_shards",
    "Every shard's tars together stay within max_shard_size_mb, except a shard of one sample "
    "that is larger than the bound on its own.",
)
def shards_within_size_bound(context: dg.AssetCheckExecutionContext, source_store: SourceStoreResource) -> dg.AssetCheckResult:
    staged = staging_dir(source_store.source_out(context.partition_key))
    config, plans = built_plans(staged)
    return result(
        size_bound_violations(staged, plans, config),
        shards_checked=len(plans),
        bound_bytes=config.max_shard_bytes,
        oversize_single_sample_shards=sum(is_oversize_singleton(p, config) for p in plans),
    )
