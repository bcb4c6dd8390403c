"""``raw_source``: each source's raw files as an observable source asset, where lineage starts.

Its data version is the source's fingerprint (a listing: names, sizes, mtimes or ETags, no reads;
``automation/fingerprint.py``). ``raw_sources_sensor`` records it when it changes, so a file
added, removed or rewritten in one source shows exactly that source's assets stale in the UI.
"Observe" in the UI records every source's current version at once.
"""

from __future__ import annotations

import dagster as dg

from pid_platform.defs.automation.fingerprint import source_fingerprint
from pid_platform.defs.groups import BUILD_GROUP
from pid_platform.defs.observations import changed_only, versioned_observation
from pid_platform.defs.ownership import domain_tags
from pid_platform.defs.partitions import SOURCES, sources_partitions
from pid_platform.defs.resources import SourceStoreResource
from pid_platform.sharding.errors import BuildError

RAW_SOURCE_ASSET = "raw_source"


def raw_source_observations(instance: dg.DagsterInstance, source: str, fingerprint: str, files: int,
                            location: str) -> list[dg.AssetObservation]:
    """The observation of ``source``'s raw files, or none when its fingerprint is the one recorded."""
    return changed_only(instance, [versioned_observation(
        RAW_SOURCE_ASSET, source, fingerprint, files=files, raw_source=location)])


@dg.observable_source_asset(
    name=RAW_SOURCE_ASSET,
    partitions_def=sources_partitions,
    group_name=BUILD_GROUP,
    tags=domain_tags(BUILD_GROUP),
    description=(
        "The raw modality folders of each source (image/, caption/, embedding folders) under the raw root. "
        "Its data version is a fingerprint of the listing (names, sizes, mtimes or ETags); raw_sources_sensor "
        "records it when it changes, so a changed source shows its assets stale."
    ),
)
def raw_source(context: dg.AssetExecutionContext, source_store: SourceStoreResource) -> dg.DataVersionsByPartition:
    store = source_store.open()
    versions = {}
    for source in sorted(context.instance.get_dynamic_partitions(SOURCES)):
        try:
            versions[source] = source_fingerprint(store, source)[0]
        except (BuildError, OSError) as exc:  # one unreadable source must not hide the others
            context.log.warning(f"source {source!r} not observed: {exc}")
    return dg.DataVersionsByPartition(versions)
