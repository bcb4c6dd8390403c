"""Blocking check on ``wdinfo_manifests``: what a published manifest says matches the tars it
lists (it runs after the commit, on the source's output folder)."""

from pathlib import Path

import dagster as dg

from pid_platform.defs.checks.common import blocking_source_check, built_plans, result
from pid_platform.defs.resources import SourceStoreResource
from pid_platform.sharding.commit.verify_output import manifest_mismatches
from pid_platform.sharding.tasks.published import published_problems


def manifest_counts_result(out: Path) -> dg.AssetCheckResult:
    _, plans = built_plans(out)
    buckets = sorted({p.bucket for p in plans})
    return result(manifest_mismatches(out, buckets), manifests_checked=len(buckets))


@blocking_source_check(
    "wdinfo_manifests",
    "Each bucket's wdinfo.json exists, and its per-tar key counts and byte sizes equal the tars on disk.",
)
def manifest_counts_match_tars(
    context: dg.AssetCheckExecutionContext, source_store: SourceStoreResource
) -> dg.AssetCheckResult:
    source = context.partition_key
    target = source_store.source_target(source)
    if target is not None:  # after the commit: the published version's objects against its manifests
        return result(published_problems(target), checked=dg.MetadataValue.text(f"{target} (its pointer's version)"))
    return manifest_counts_result(source_store.source_out(source))
