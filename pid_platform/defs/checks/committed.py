"""The checks of a source, re-asserted on its committed version when a build finds nothing to do.

A no-op build (the sensor's first tick, every nightly rebuild of an unchanged source) skips the
steps the checks hang on; left so, the UI would show the source's blocking checks as skipped
("0 / 2 Passed") although the output they vouch for is unchanged and still verified. So the
intake step, when it finds the source up to date, runs the same checks on the committed version
and records each result for the materialization it checked, in the same run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import dagster as dg
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)

from pid_platform.defs.checks.common import result
from pid_platform.defs.checks.intake import dropped_fraction_result, latest_metadata
from pid_platform.defs.checks.key_indexes import key_indexes_result
from pid_platform.defs.checks.manifests import manifest_counts_result
from pid_platform.defs.checks.twin_tars import size_bound_result, twin_keys_result
from pid_platform.defs.latest import latest_materialization
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.tasks.published import published_problems

# (asset, check, result on the committed output folder); sample_set's warning is read from the
# instance instead (the drop counts of the build that made the committed version).
FOLDER_CHECKS: tuple[tuple[str, str, Callable[[Path], dg.AssetCheckResult]], ...] = (
    ("twin_tar_shards", "twin_tar_keys_match", twin_keys_result),
    ("twin_tar_shards", "shards_within_size_bound", size_bound_result),
    ("key_indexes", "key_indexes_match_tars", key_indexes_result),
    ("wdinfo_manifests", "manifest_counts_match_tars", manifest_counts_result),
)


def _target(instance: dg.DagsterInstance, asset: str, partition: str) -> AssetCheckEvaluationTargetMaterializationData | None:
    r = latest_materialization(instance, asset, partition)
    if r is None:
        return None
    return AssetCheckEvaluationTargetMaterializationData(storage_id=r.storage_id, run_id=r.run_id, timestamp=r.timestamp)


def committed_check_evaluations(instance: dg.DagsterInstance, source: str, out: Path,
                                target: S3Output | None = None) -> list[dg.AssetCheckEvaluation]:
    """Every check of ``source``'s assets, evaluated on its committed version ``out``, or, given
    ``target``, on the version its pointer names (its objects against its manifests)."""
    if target is not None:
        published = result(published_problems(target), checked=dg.MetadataValue.text(f"{target} (its pointer's version)"))
    found: list[tuple[str, str, dg.AssetCheckResult, bool]] = [
        (asset, name, published if target is not None else fn(out), True) for asset, name, fn in FOLDER_CHECKS]
    found.append(("sample_set", "dropped_fraction_within_bound",
                  dropped_fraction_result(latest_metadata(instance, "sample_set", source)), False))
    return [
        dg.AssetCheckEvaluation(
            asset_key=dg.AssetKey(asset), check_name=name, passed=r.passed, severity=r.severity,
            metadata={**r.metadata, "checked": dg.MetadataValue.text("the committed version (no-op build)")},
            target_materialization_data=_target(instance, asset, source), blocking=blocking, partition=source,
        )
        for asset, name, r, blocking in found
    ]


def reassert_committed_checks(context: dg.AssetExecutionContext, source: str, out: Path,
                              target: S3Output | None = None) -> None:
    """Record the checks of ``source`` on its committed version (``out``, or ``target``'s) in this run."""
    evaluations = committed_check_evaluations(context.instance, source, out, target)
    for evaluation in evaluations:
        context.log_event(evaluation)
    failed = [e.check_name for e in evaluations if not e.passed]
    context.log.info(f"{source}: checks re-asserted on the committed version"
                     + (f"; failing: {', '.join(failed)}" if failed else ": all passed"))
