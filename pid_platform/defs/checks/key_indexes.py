"""Blocking check on ``key_indexes``: each shard's parquet key index names the members of its
tars in order, with their exact offsets and sizes, so the loader's index mode reads what is there.

It reads the staged version when a build is staged (before the manifests commit it), else the
committed one (``key_indexes`` materialized alone verifies the committed version).
"""

from pathlib import Path

import dagster as dg

from pid_platform.defs.checks.common import (
    blocking_source_check,
    built_plans,
    result,
    s3_result,
    staged_or_committed,
)
from pid_platform.defs.resources import SourceStoreResource
from pid_platform.sharding.commit.verify_output import planned_key_index_mismatches
from pid_platform.sharding.tasks.write import KEY_INDEX


def key_indexes_result(folder: Path) -> dg.AssetCheckResult:
    _, plans = built_plans(folder)
    return result(planned_key_index_mismatches(folder, plans), key_indexes_checked=len(plans))


@blocking_source_check(
    "key_indexes",
    "Every shard's key index lists each modality tar's members in order with their exact byte offsets "
    "and sizes, and its key column matches the member names.",
)
def key_indexes_match_tars(context: dg.AssetCheckExecutionContext,
                           source_store: SourceStoreResource) -> dg.AssetCheckResult:
    source = context.partition_key
    found = s3_result(source_store, source, KEY_INDEX)
    return found if found is not None else key_indexes_result(staged_or_committed(source_store.source_out(source)))
