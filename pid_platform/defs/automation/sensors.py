"""The discovery sensor: find sources under the raw root and build each new or changed one.

It is on by default: it only reads listings, and what it starts is safe to leave running (a
build stages its output and commits it atomically, at most ``max_concurrent_runs`` runs and two
``pid_build`` steps at once). The catalog follows the builds through its automation condition
(``automation/conditions.py``), run failures raise an alert (``automation/alerts.py``)."""

import hashlib
import json

import dagster as dg

from pid_platform.defs.automation.builds import (
    CommittedBuild,
    build_in_progress,
    build_run_key,
    is_current,
    last_committed_build,
)
from pid_platform.defs.automation.fingerprint import source_fingerprint
from pid_platform.defs.automation.jobs import source_build_job
from pid_platform.defs.partitions import SOURCES, sources_partitions
from pid_platform.defs.raw_sources import raw_source_observations
from pid_platform.defs.resources import ShardingResource, SourceStoreResource
from pid_platform.defs.settings import settings_observation_if_new
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.settings import SETTINGS_NAME, source_settings
from pid_platform.sharding.storage import SourceStore


def _unusable_as_partition(name: str) -> bool:
    # Dagster refuses partition keys holding "..." or control characters; one such folder must
    # not fail the whole tick for every other source.
    return "..." in name or any(ord(c) < 32 for c in name)


def _bad_settings_key(store: SourceStore, source: str, committed: CommittedBuild | None) -> str:
    # A file that does not parse still gets a key that moves with its bytes: each broken edit is
    # requested once and fails where the operator sees it (the run, on the asset).
    try:
        data = store.read_source_file(source, SETTINGS_NAME) or b""
    except OSError:
        data = b""
    return f"{source}:bad-settings:{hashlib.sha256(data).hexdigest()[:12]}:after-{committed.event_id if committed else 0}"


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
    requests a ``source_build`` run for every source whose files or sharding settings (its
    ``sharding.yaml`` over the code defaults) differ from those of its last committed build. A
    source with a queued or running build is left for a later tick. A ``sharding.yaml`` that
    does not parse is requested too: the run fails with the file's error on the asset. A
    source's settings version is recorded as an observation of ``sharding_settings`` when it
    changes. The cursor holds each source's last run key."""
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
        except (BuildError, OSError) as exc:
            context.log.warning(f"source {source!r} skipped: its files could not be listed: {exc}")
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
        running = build_in_progress(context.instance, source) if source in known else None
        if running is not None:
            context.log.info(f"source {source!r}: run {running.run_id} is building it; checked again next tick")
            continue
        committed = last_committed_build(context.instance, source) if source in known else None
        try:
            settings = source_settings(store, source, defaults)
        except BuildError as exc:
            context.log.error(f"source {source!r}: {exc}; a build is requested so the error shows on its assets")
            run_key, tags = _bad_settings_key(store, source, committed), {"pid/settings_error": str(exc)[:200]}
            config_version = "unreadable"
        else:
            if source in known:  # a partition the daemon has not added yet cannot carry an observation
                observation = settings_observation_if_new(context.instance, settings)
                if observation is not None:
                    observations.append(observation)
            config_version = settings.version
            if is_current(committed, config_version, fingerprint):
                continue
            run_key, tags = build_run_key(source, config_version, fingerprint, committed), {}
        if seen.get(source) != run_key:
            seen[source] = run_key
            requests.append(
                dg.RunRequest(
                    run_key=run_key, partition_key=source,
                    tags={"pid/source": source, "pid/config_version": config_version,
                          "pid/settings_file": store.source_file_uri(source, SETTINGS_NAME), **tags},
                )
            )
    return dg.SensorResult(
        run_requests=requests,
        asset_events=observations,
        dynamic_partitions_requests=[sources_partitions.build_add_request(new_partitions)] if new_partitions else [],
        cursor=json.dumps(seen, sort_keys=True),
    )
