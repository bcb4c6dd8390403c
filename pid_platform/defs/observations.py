"""Observations of source assets, recorded only when a version moves.

A sensor that lists its inputs every minute would otherwise write one observation per source per
tick (thousands a day) that says nothing new; staleness only needs the versions that changed.
"""

from __future__ import annotations

from collections.abc import Iterable

import dagster as dg

DATA_VERSION_TAG = "dagster/data_version"


def latest_observed_version(instance: dg.DagsterInstance, asset: str, partition: str) -> str | None:
    records = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1).records
    if not records or records[0].asset_observation is None:
        return None
    return records[0].asset_observation.tags.get(DATA_VERSION_TAG)


def versioned_observation(asset: str, partition: str, version: str, **metadata: object) -> dg.AssetObservation:
    """An observation of ``asset``'s ``partition`` carrying ``version`` as its data version."""
    return dg.AssetObservation(asset_key=asset, partition=partition, tags={DATA_VERSION_TAG: version},
                               metadata=metadata)


def changed_only(instance: dg.DagsterInstance, observations: Iterable[dg.AssetObservation]) -> list[dg.AssetObservation]:
    """The observations whose data version differs from the latest recorded for their partition."""
    return [o for o in observations
            if latest_observed_version(instance, o.asset_key.to_user_string(), o.partition) != o.tags.get(DATA_VERSION_TAG)]
