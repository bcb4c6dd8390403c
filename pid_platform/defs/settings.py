"""Per-source sharding settings on the Dagster side: the ``sharding_settings`` observation the
source's assets depend on, and the settings a run builds with.

The settings live in ``<raw_root>/<source>/sharding.yaml`` (``pid_platform/sharding/settings.py``).
A run reads them there. A sharding setting given in the launchpad for a run is written into
that file first (so the sensor and the daily schedule keep it, and the next run does not cut the
source back), or, if the file cannot be written, the run fails and says to edit the file.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import dagster as dg

from pid_platform.defs.groups import BUILD_GROUP
from pid_platform.defs.partitions import SOURCES, sources_partitions
from pid_platform.defs.resources import ShardingResource, SourceStoreResource
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.settings import (
    SETTING_KEYS,
    SETTINGS_NAME,
    SourceSettings,
    persist_settings,
    source_settings,
)
from pid_platform.sharding.shard_plan import ShardingConfig

SETTINGS_ASSET = "sharding_settings"


def code_defaults(sharding: ShardingResource, overridden: dict[str, Any]) -> ShardingConfig:
    """The code location's defaults: the resource's values, except that a launchpad override is
    not a default (it goes to the source's file)."""
    values = asdict(sharding.config())
    for key in overridden:
        values[key] = ShardingResource.model_fields[key].default
    return ShardingConfig(**values)


def launchpad_overrides(run_config: dict[str, Any]) -> dict[str, Any]:
    """The sharding settings a run's config sets explicitly (the launchpad's ``sharding``)."""
    given = ((run_config.get("resources") or {}).get("sharding") or {}).get("config") or {}
    return {k: v for k, v in given.items() if k in SETTING_KEYS}


def settings_for_run(context: dg.AssetExecutionContext, source_store: SourceStoreResource,
                     sharding: ShardingResource, source: str) -> SourceSettings:
    """The settings this run builds ``source`` with, a launchpad override persisted first."""
    overrides = launchpad_overrides(context.run.run_config)
    defaults = code_defaults(sharding, overrides)
    store = source_store.open()
    current = source_settings(store, source, defaults)
    changed = {k: v for k, v in overrides.items() if getattr(current.config, k) != v}
    if not changed:
        return current
    try:
        settings = persist_settings(store, current, changed, defaults)
    except (BuildError, OSError) as exc:
        raise dg.Failure(
            description=(
                f"sharding of source {source!r} set in the launchpad ({changed}) was not applied: it could not be "
                f"written to {current.location} ({exc}). A source's sharding lives in that file, where the sensor "
                f"and the daily schedule read it: edit {SETTINGS_NAME} there and run again without the override"
            ),
            allow_retries=False,
        ) from exc
    context.log.info(f"{source}: launchpad sharding {changed} written to {settings.location} (version {settings.version})")
    return settings


def settings_metadata(settings: SourceSettings) -> dict[str, Any]:
    return {
        "settings_version": settings.version,
        # A path only where there is a file: metadata paths point at something that exists.
        "settings_file": (dg.MetadataValue.path(settings.location) if settings.exists
                          else dg.MetadataValue.text(f"none ({settings.location} absent: the defaults)")),
        "settings_from_file": dg.MetadataValue.json(dict(sorted(settings.from_file.items()))),
    }


def settings_observation(settings: SourceSettings) -> dg.AssetObservation:
    """What the sensor records per source: the settings' version as the data version of
    ``sharding_settings``, so a change shows the source's assets stale in the UI."""
    return dg.AssetObservation(
        asset_key=SETTINGS_ASSET, partition=settings.source,
        tags={"dagster/data_version": settings.version},
        metadata={"settings_file": settings.location, "settings": dg.MetadataValue.json(asdict(settings.config))},
    )


@dg.observable_source_asset(
    name=SETTINGS_ASSET,
    partitions_def=sources_partitions,
    group_name=BUILD_GROUP,
    description=(
        f"The sharding settings of each source: the code location's defaults (the `sharding` resource) "
        f"overridden by `{SETTINGS_NAME}` in the source's raw folder. Its data version is the settings' "
        "version; the sensor observes it on every tick, so an edited file shows the source's assets stale."
    ),
)
def sharding_settings(
    context: dg.AssetExecutionContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> dg.DataVersionsByPartition:
    store = source_store.open()
    defaults = sharding.config()
    versions = {}
    for source in sorted(context.instance.get_dynamic_partitions(SOURCES)):
        versions[source] = source_settings(store, source, defaults).version
    return dg.DataVersionsByPartition(versions)
