"""What the checks share: the decorator for a blocking, per-source check, and the result shape."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import dagster as dg

from pid_platform.defs.metadata import first
from pid_platform.defs.partitions import sources_partitions
from pid_platform.defs.resources import SourceStoreResource
from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.pipeline import load_sharding_config, state_dir
from pid_platform.sharding.plan.columnar import ShardRef
from pid_platform.sharding.plan.plan_files import load_shards
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.tasks.commit import staged_shards
from pid_platform.sharding.tasks.published import published_problems


def blocking_source_check(asset: str, description: str) -> Callable[[Callable], dg.AssetChecksDefinition]:
    """A blocking check with one result per source: a failure stops the assets downstream of
    ``asset`` in the same run, and the UI shows each source's own pass/fail."""

    def decorate(fn: Callable) -> dg.AssetChecksDefinition:
        # Partitioned checks are marked preview in 1.13; without the partition, one source's
        # failure would be shown as the whole asset's latest state.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dg.PreviewWarning)
            return dg.asset_check(
                asset=asset, blocking=True, partitions_def=sources_partitions, description=description
            )(fn)

    return decorate


def staged_or_committed(out: Path) -> Path:
    """The staging folder of ``out`` when a build is staged there, else ``out`` (the committed version)."""
    staged = staging_dir(out)
    return staged if (state_dir(staged) / "sharding.json").is_file() else out


def built_plans(out: Path) -> tuple[ShardingConfig, list[ShardRef]]:
    """The settings and shards of the build in ``out``, a row per shard: what the checks need to
    find each shard's files (they read the tars and key indexes, not the plan's samples)."""
    config = load_sharding_config(out)
    return config, load_shards(out, config)


def result(problems: list[str], **metadata: object) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={"problems_count": len(problems), "problems": dg.MetadataValue.json(first(problems)), **metadata},
    )


def s3_result(source_store: SourceStoreResource, source: str, check: str,
              **metadata: Callable[[ShardingConfig, list[ShardRef]], object]) -> dg.AssetCheckResult | None:
    """``check`` of an ``s3://`` output's build (None for a local output): on the staged build,
    what each write task's check found in its shards' tars before sending them (``tasks/write.py``)
    and every shard object the bucket does not hold as sent; with nothing staged, the published
    version's objects against its manifests. ``metadata``: more of it, from the staged plan."""
    target = source_store.source_target(source)
    if target is None:
        return None
    shards = staged_shards(target, source_store.work_root or None, f"check {check}")
    if shards is None:
        problems = published_problems(target)
        return result(problems, checked=dg.MetadataValue.text("the published version (nothing is staged)"))
    try:
        problems = shards.problems(target, check)
    finally:
        shutil.rmtree(shards.folder, ignore_errors=True)
    return result(problems, shards_checked=len(shards.plans),
                  checked=dg.MetadataValue.text("each shard's tars by its write task, then the bucket's objects"),
                  **{k: fn(shards.config, shards.plans) for k, fn in metadata.items()})
