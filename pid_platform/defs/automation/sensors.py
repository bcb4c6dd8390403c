"""The discovery sensor: find sources under the raw root and build each new or changed one.

It is on by default: it only reads listings, and what it starts is safe to leave running (a
build stages its output and commits it atomically, at most ``max_concurrent_runs`` runs and two
``pid_build`` steps at once). The catalog follows the builds through its automation condition
(``automation/conditions.py``), run failures raise an alert (``automation/alerts.py``)."""

import json

import dagster as dg

from pid_platform.defs.automation.fingerprint import source_fingerprint
from pid_platform.defs.automation.jobs import source_build_job
from pid_platform.defs.partitions import SOURCES, sources_partitions
from pid_platform.defs.raw_sources import raw_source_observations
from pid_platform.defs.resources import ShardingResource, SourceStoreResource
from pid_platform.defs.settings import settings_observation
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.settings import source_settings


def _unusable_as_partition(name: str) -> bool:
    # Dagster refuses partition keys holding "..." or control characters; one such folder must
    # not fail the whole tick for every other source.
    return "..." in name or any(ord(c) < 32 for c in name)


def build_run_key(source: str, config_version: str, fingerprint: str) -> str:
    # The daemon drops a run request whose run_key it has seen before, forever: the key must
    # change whenever the bytes a build would write can change (the input files or the config).
    return f"{source}:{config_version}:{fingerprint}"


@dg.sensor(
    job=source_build_job,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Every 60 s: lists the sources under the raw root, adds new ones as partitions, records changed "
                "raw files and settings on raw_source and sharding_settings, and requests a source_build run "
                "for every source that is new or whose files or sharding.yaml changed.",
)
def raw_sources_sensor(
    context: dg.SensorEvaluationContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> dg.SensorResult:
    """Lists the sources under the raw root, adds each new one as a partition of ``sources``, and
    requests a ``source_build`` run for every source that is new or whose files or sharding
    settings (its ``sharding.yaml`` over the code location's defaults) changed since the last
    request. Each tick records every source's settings version as an observation of
    ``sharding_settings``. The cursor holds each source's last run key."""
    store = source_store.open()
    defaults = sharding.config()
    observations: list[dg.AssetObservation] = []
    seen: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
    known = set(context.instance.get_dynamic_partitions(SOURCES))
    new_partitions: list[str] = []
    requests: list[dg.RunRequest] = []
    for source in store.list_sources():
        if _unusable_as_partition(source):
            context.log.warning(f"source folder {source!r} skipped: rename it (no '...', no control characters)")
            continue
        try:
            fingerprint, files = source_fingerprint(store, source)
            settings = source_settings(store, source, defaults)
        except (BuildError, OSError) as exc:
            context.log.warning(f"source {source!r} skipped: {exc}")
            continue
        if files == 0:
            context.log.info(f"source {source!r} has no files yet; waiting")
            continue
        # Also for a new source (the daemon records it before adding the partition; Dagster takes it):
        # a source's first observation after its build would show it stale.
        observations += raw_source_observations(context.instance, source, fingerprint, files,
                                                f"{store.uri.rstrip('/')}/{source}")
        if source not in known:
            new_partitions.append(source)
        else:  # a partition the daemon has not added yet cannot carry an observation
            observations.append(settings_observation(settings))
        config_version = settings.version
        run_key = build_run_key(source, config_version, fingerprint)
        if seen.get(source) != run_key:
            seen[source] = run_key
            requests.append(
                dg.RunRequest(
                    run_key=run_key, partition_key=source,
                    tags={"pid/source": source, "pid/config_version": config_version,
                          "pid/settings_file": settings.location},
                )
            )
    return dg.SensorResult(
        run_requests=requests,
        asset_events=observations,
        dynamic_partitions_requests=[sources_partitions.build_add_request(new_partitions)] if new_partitions else [],
        cursor=json.dumps(seen, sort_keys=True),
    )

