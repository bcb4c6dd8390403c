"""Stale status as the UI reads it (this module holds no tests)."""

from __future__ import annotations

import dagster as dg
from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._time import get_current_datetime


def stale_partitions(defs: dg.Definitions, instance: dg.DagsterInstance, assets: list[str],
                     partitions: list[str]) -> set[tuple[str, str]]:
    """(asset, partition) pairs the UI shows stale: the resolver behind its stale markers, over the
    instance's event log."""
    graph = defs.resolve_asset_graph()
    view = AssetGraphView(temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
                          instance=instance, asset_graph=graph)
    resolver = CachingStaleStatusResolver(instance, graph, view)
    return {(a, p) for a in assets for p in partitions
            if resolver.get_status(dg.AssetKey(a), p) == StaleStatus.STALE}
