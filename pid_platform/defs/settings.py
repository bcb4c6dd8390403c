"""Per-source sharding settings on the Dagster side: the ``sharding_settings`` observation the
source's assets depend on, and the settings a run builds with.

The settings live in ``<raw_root>/<source>/sharding.yaml`` (``pid_platform/sharding/settings.py``).
A run reads them there. A sharding setting given in the launchpad for a run builds that run,
and is written into that file when the build commits (``wdinfo_manifests``), so the sensor and
the daily schedule keep it and the next run does not cut the source back. A run that fails or
is cancelled before its commit leaves the file as it was, and its log says so at the start: an
operator who cancels a typo does not get it built a minute later by the sensor. The setting to
write is the one the committed plan was cut with (``twin_tar_shards``' ``settings_diff`` of that
plan), so a re-shard staged by one run and committed by another (Materialize on
``twin_tar_shards``, then on ``wdinfo_manifests``) still lands in the file. Only settings the
operator typed count: the resource's settings are unset unless given a value, so the
launchpad's pre-filled defaults never reach the file. What a run changes is logged and
recorded as ``settings_diff`` (against the file as it was).

The version a build used is recorded as the build's input data version of ``sharding_settings``
(Dagster itself reads a partitioned dependency's version from materializations only, and a
settings file is observed, never materialized); the observation is recorded only when the
version differs from the last one recorded for that source.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import dagster as dg
from dagster._core.definitions.data_version import (
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)

from pid_platform.defs.groups import BUILD_GROUP
from pid_platform.defs.latest import latest_materialization
from pid_platform.defs.partitions import SOURCES, sources_partitions
from pid_platform.defs.resources import ShardingResource, SourceStoreResource
from pid_platform.defs.step_errors import step_failure
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.settings import (
    SETTING_KEYS,
    SETTINGS_NAME,
    SourceSettings,
    persist_settings,
    source_settings,
)

SETTINGS_ASSET = "sharding_settings"
SETTINGS_KEY = dg.AssetKey(SETTINGS_ASSET)


@dataclass(frozen=True)
class RunSettings:
    """The settings a run builds one source with, and what it changed in the source's file."""

    settings: SourceSettings
    # setting -> {"was": value in force before, "in_file": whether the file set it, "now": the run's value}
    applied: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The build's provenance of sharding_settings (its version and the observation recording it).
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def config(self) -> ShardingConfig:
        return self.settings.config


def code_defaults(sharding: ShardingResource, overridden: dict[str, Any]) -> ShardingConfig:
    """The code location's defaults: the code defaults and the settings bound with the resource,
    except that a launchpad override is not a default (it goes to the source's file)."""
    return sharding.config(without=overridden)


def launchpad_overrides(run_config: dict[str, Any]) -> dict[str, Any]:
    """The sharding settings a run's config sets explicitly (the launchpad's ``sharding``); a
    setting left empty (``null``) is not set."""
    given = ((run_config.get("resources") or {}).get("sharding") or {}).get("config") or {}
    return {k: v for k, v in given.items() if k in SETTING_KEYS and v is not None}


def settings_diff(before: SourceSettings, changes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: {"was": getattr(before.config, k), "in_file": k in before.from_file, "now": v}
            for k, v in sorted(changes.items())}


def settings_for_run(context: dg.AssetExecutionContext, source_store: SourceStoreResource,
                     sharding: ShardingResource, source: str) -> RunSettings:
    """The settings this run builds ``source`` with (a launchpad override over the file, not
    written yet: ``commit_launchpad_settings`` does at the commit), and the version recorded as
    an observation of ``sharding_settings`` when it is a new one."""
    overrides = launchpad_overrides(context.run.run_config)
    defaults = code_defaults(sharding, overrides)
    store = source_store.open()
    current = source_settings(store, source, defaults)
    changed = {k: v for k, v in overrides.items() if getattr(current.config, k) != v}
    settings, applied = current, {}
    if changed:
        # A bad value typed in the launchpad is refused as such (named), before anything is built.
        wanted = {**current.from_file, **changed}
        settings = SourceSettings(source, ShardingConfig(**{**asdict(defaults), **wanted}), current.location,
                                  wanted, current.exists)
        applied = settings_diff(current, changed)
        context.log.info(f"{source}: launchpad sharding for this run ({_shown(applied)}; version {current.version} "
                         f"-> {settings.version}); written to {current.location} only when this build commits: "
                         "if the run fails or is cancelled before, the file stays as it is")
    # A launchpad version is not the file's yet: it is observed once written, at the commit.
    return RunSettings(settings, applied, provenance_tags(context, settings, observe=not changed))


def _shown(applied: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{k}: {d['was']!r} -> {d['now']!r}" for k, d in applied.items())


def _pending_launchpad_settings(instance: dg.DagsterInstance, source: str, committed: ShardingConfig,
                                ) -> dict[str, dict[str, Any]]:
    """The launchpad settings the committed plan was cut with: the ``settings_diff`` of the
    newest ``twin_tar_shards`` materialization of ``source`` whose config is ``committed``."""
    record = latest_materialization(instance, "twin_tar_shards", source)
    if record is None:
        return {}
    metadata = record.asset_materialization.metadata
    version, diff = metadata.get("config_version"), metadata.get("settings_diff")
    if version is None or diff is None or version.value != committed.version():
        return {}
    return dict(diff.value) if isinstance(diff.value, dict) else {}


def commit_launchpad_settings(context: dg.AssetExecutionContext, source_store: SourceStoreResource,
                              sharding: ShardingResource, source: str, committed: ShardingConfig) -> None:
    """Once a build of ``source`` has committed: the launchpad settings its plan was cut with,
    written into the source's ``sharding.yaml`` (other keys kept), and logged. A value the
    file already holds is not written again."""
    pending = _pending_launchpad_settings(context.instance, source, committed)
    if not pending:
        return
    changes = {k: d["now"] for k, d in pending.items()}
    defaults = code_defaults(sharding, changes)
    store = source_store.open()
    current = source_settings(store, source, defaults)
    if all(current.from_file.get(k) == v for k, v in changes.items()):
        return
    try:
        written = persist_settings(store, current, changes, defaults)
    except (BuildError, OSError) as exc:
        raise step_failure(
            f"the build of {source!r} committed with the launchpad's sharding ({_shown(pending)}), but it could "
            f"not be written to {current.location} ({exc}). Until it is, the sensor and the daily schedule "
            f"build the file's settings: edit {SETTINGS_NAME} there", exc) from exc
    context.log.info(f"{source}: the build committed; launchpad sharding written to {written.location} "
                     f"({_shown(pending)}); version {current.version} -> {written.version}")
    # The file's new version, observed now that the file holds it (the run's steps built with it
    # before; the sensor's next tick then finds nothing new).
    observation = settings_observation_if_new(context.instance, written)
    if observation is not None:
        context.log_event(observation)


def latest_settings_record(instance: dg.DagsterInstance, source: str) -> dg.EventLogRecord | None:
    records = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=SETTINGS_KEY, asset_partitions=[source]), limit=1).records
    return records[0] if records else None


def observed_version(record: dg.EventLogRecord | None) -> str | None:
    observation = record.asset_observation if record is not None else None
    return (observation.tags or {}).get("dagster/data_version") if observation is not None else None


def settings_observation_if_new(instance: dg.DagsterInstance, settings: SourceSettings) -> dg.AssetObservation | None:
    """The observation of ``settings``, or ``None`` when its version is the last one recorded."""
    if observed_version(latest_settings_record(instance, settings.source)) == settings.version:
        return None
    return settings_observation(settings)


def provenance_tags(context: dg.AssetExecutionContext, settings: SourceSettings, *,
                    observe: bool = True) -> dict[str, str]:
    """The tags that record ``settings``' version as this build's input data version of
    ``sharding_settings``, the observation that names it recorded first where it is new
    (``observe``: the settings are the file's)."""
    observation = settings_observation_if_new(context.instance, settings) if observe else None
    if observation is not None:
        context.log_event(observation)
    record = latest_settings_record(context.instance, settings.source)
    pointer = str(record.storage_id) if record is not None and observed_version(record) == settings.version else "NULL"
    return {get_input_data_version_tag(SETTINGS_KEY): settings.version, get_input_event_pointer_tag(SETTINGS_KEY): pointer}


def settings_metadata(run: RunSettings) -> dict[str, Any]:
    settings = run.settings
    return {
        "settings_version": settings.version,
        # A path only where there is a file (or will be: a launchpad setting is written at the
        # commit): metadata paths point at something that exists.
        "settings_file": (dg.MetadataValue.path(settings.location) if settings.exists or run.applied
                          else dg.MetadataValue.text(f"none ({settings.location} absent: the defaults)")),
        "settings_from_file": dg.MetadataValue.json(dict(sorted(settings.from_file.items()))),
        # What this run changed in the file (empty: it built with the file as it was).
        "settings_diff": dg.MetadataValue.json(run.applied),
    }


def settings_observation(settings: SourceSettings) -> dg.AssetObservation:
    """The settings' version as the data version of ``sharding_settings`` for the source, so a
    change shows the source's assets stale in the UI."""
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
        f"The sharding settings of each source: `{SETTINGS_NAME}` in the source's raw folder over the code "
        "defaults (and any setting bound with the `sharding` resource). Its data version is the settings' "
        "version; the sensor and every build record it when it changes, so an edited file shows the source's "
        "assets stale."
    ),
)
def sharding_settings(
    context: dg.AssetExecutionContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> dg.DataVersionsByPartition:
    store = source_store.open()
    defaults = sharding.config()
    versions = {}
    for source in sorted(context.instance.get_dynamic_partitions(SOURCES)):
        settings = source_settings(store, source, defaults)
        if settings_observation_if_new(context.instance, settings) is not None:  # only what changed
            versions[source] = settings.version
    return dg.DataVersionsByPartition(versions)
