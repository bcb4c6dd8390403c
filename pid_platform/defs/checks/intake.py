"""A warning on ``sample_set``: too large a share of a source's samples was dropped.

A few bad files in a drop are normal and are counted, not fatal; a third of the samples gone
usually means a wrong folder, a broken export or a new caption format. The check warns (yellow in
the UI, severity WARN) and does not block: the kept samples are still good.
"""


import warnings

import dagster as dg

from pid_platform.defs.latest import latest_materialization
from pid_platform.defs.partitions import sources_partitions

# Above this share of dropped samples (of kept + dropped), the source's intake is flagged.
MAX_DROPPED_FRACTION = 0.10


def latest_metadata(instance: dg.DagsterInstance, asset: str, partition: str) -> dict[str, object] | None:
    """The metadata of ``asset``'s latest materialization of ``partition``, as plain values."""
    record = latest_materialization(instance, asset, partition)
    if record is None or record.asset_materialization is None:
        return None
    return {k: getattr(v, "value", v) for k, v in record.asset_materialization.metadata.items()}


def dropped_fraction_result(metadata: dict[str, object] | None) -> dg.AssetCheckResult:
    if metadata is None:
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN,
                                   metadata={"note": "sample_set has no materialization for this source yet"})
    kept, dropped = int(metadata.get("samples", 0)), int(metadata.get("dropped_total", 0))
    fraction = dropped / (kept + dropped) if kept + dropped else 0.0
    return dg.AssetCheckResult(
        passed=fraction <= MAX_DROPPED_FRACTION,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={"dropped_fraction": round(fraction, 4), "max_dropped_fraction": MAX_DROPPED_FRACTION,
                  "samples": kept, "dropped_total": dropped,
                  "dropped_by_reason": dg.MetadataValue.json(metadata.get("dropped_by_reason") or {})},
    )


# Partitioned checks are marked preview in 1.13.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", dg.PreviewWarning)

    @dg.asset_check(
        asset="sample_set",
        blocking=False,
        partitions_def=sources_partitions,
        description=f"Warns when more than {MAX_DROPPED_FRACTION:.0%} of a source's samples (kept + dropped) were "
                    "dropped by intake; the reasons are in its metadata and in sample_set's report.",
    )
    def dropped_fraction_within_bound(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        return dropped_fraction_result(latest_metadata(context.instance, "sample_set", context.partition_key))
