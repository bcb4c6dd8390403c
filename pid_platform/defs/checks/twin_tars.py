"""Blocking checks on ``twin_tar_shards``: the twin-tar contract, read back from the staged tars.

They read the staging folder, before anything is published: a failure stops the run while the
source's output folder still holds the previous good version, untouched. The same checks re-run
on the committed version when a build finds nothing to do (``checks/committed.py``).
"""

from pathlib import Path

import dagster as dg

from pid_platform.defs.checks.common import blocking_source_check, built_plans, result, s3_result
from pid_platform.defs.resources import SourceStoreResource
from pid_platform.sharding.commit.verify_output import size_bound_violations, twin_key_mismatches
from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.plan.shard_plan import is_oversize_singleton
from pid_platform.sharding.tasks.write import SIZE_BOUND, TWIN_KEYS


def twin_keys_result(folder: Path) -> dg.AssetCheckResult:
    _, plans = built_plans(folder)
    return result(twin_key_mismatches(folder, plans), shards_checked=len(plans))


def size_bound_result(folder: Path) -> dg.AssetCheckResult:
    config, plans = built_plans(folder)
    return result(
        size_bound_violations(folder, plans, config),
        shards_checked=len(plans),
        bound_bytes=config.max_shard_bytes,
        oversize_single_sample_shards=sum(is_oversize_singleton(p, config) for p in plans),
    )


@blocking_source_check(
    "twin_tar_shards",
    "Every modality tar of a shard holds the same sample keys in the same order.",
)
def twin_tar_keys_match(context: dg.AssetCheckExecutionContext, source_store: SourceStoreResource) -> dg.AssetCheckResult:
    source = context.partition_key
    found = s3_result(source_store, source, TWIN_KEYS)
    return found if found is not None else twin_keys_result(staging_dir(source_store.source_out(source)))


@blocking_source_check(
    "twin_tar_shards",
    "Every shard's tars together stay within max_shard_size_mb (MiB), except a shard of one sample "
    "that is larger than the bound on its own.",
)
def shards_within_size_bound(context: dg.AssetCheckExecutionContext, source_store: SourceStoreResource) -> dg.AssetCheckResult:
    source = context.partition_key
    found = s3_result(source_store, source, SIZE_BOUND, bound_bytes=lambda config, _plans: config.max_shard_bytes,
                      oversize_single_sample_shards=lambda config, plans: sum(
                          is_oversize_singleton(p, config) for p in plans))
    return found if found is not None else size_bound_result(staging_dir(source_store.source_out(source)))
