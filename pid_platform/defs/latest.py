"""The newest materialization of one asset partition, as the instance records it."""

from __future__ import annotations

import dagster as dg


def latest_materialization(instance: dg.DagsterInstance, asset: str | dg.AssetKey,
                           partition: str) -> dg.EventLogRecord | None:
    """The newest materialization record of ``asset`` for ``partition`` (``None``: none yet)."""
    key = asset if isinstance(asset, dg.AssetKey) else dg.AssetKey(asset)
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=1).records
    return records[0] if records else None
