"""The daily rebuild of every registered source.

``build_schedule_from_partitioned_job`` rejects dynamic partitions, so this schedule lists them
itself. Unchanged shards are reused, so a rebuild of an unchanged source costs a listing and a
few hashes; what it catches is a config change or a change the sensor was off for.

Each source is rebuilt with its own settings (``sharding.yaml`` in its raw folder, read by the
run itself; a launchpad re-shard is written there), so a nightly run never cuts a source back to
the defaults. A source that is being built (a queued or running run) is left out. It is on by
default; the run key carries the day, the settings' version, the files' fingerprint and the
event id of the source's last committed build.
"""

import dagster as dg

from pid_platform.defs.automation.builds import (
    build_in_progress,
    build_run_key,
    is_current,
    last_committed_build,
)
from pid_platform.defs.automation.fingerprint import source_fingerprint
from pid_platform.defs.automation.jobs import source_build_job
from pid_platform.defs.partitions import SOURCES
from pid_platform.defs.resources import ShardingResource, SourceStoreResource
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.settings import SETTINGS_NAME, source_settings


@dg.schedule(
    cron_schedule="0 3 * * *",
    execution_timezone="UTC",
    job=source_build_job,
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="03:00 UTC: a source_build run for every registered source, each with its own sharding.yaml; "
                "an unchanged source costs a listing and re-asserts its checks on the committed version.",
)
def daily_source_rebuild(
    context: dg.ScheduleEvaluationContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> list[dg.RunRequest] | dg.SkipReason:
    """Once a day, requests a ``source_build`` run for every partition of ``sources``, each with
    the source's own sharding settings, except a source with a queued or running build. A
    source whose files and settings are those of its last committed build gets a no-op rebuild
    that verifies the committed output; one that differs (a change the sensor was off for) is
    rebuilt."""
    sources = sorted(context.instance.get_dynamic_partitions(SOURCES))
    if not sources:
        return dg.SkipReason("no sources registered yet; turn on raw_sources_sensor or run pid-demo")
    day = context.scheduled_execution_time.strftime("%Y-%m-%d")
    store, defaults = source_store.open(), sharding.config()
    requests, busy = [], []
    for s in sources:
        running = build_in_progress(context.instance, s)
        if running is not None:
            busy.append(f"{s} (run {running.run_id})")
            continue
        committed = last_committed_build(context.instance, s)
        try:
            version = source_settings(store, s, defaults).version
            fingerprint, _ = source_fingerprint(store, s)
        except (BuildError, OSError) as exc:
            # Requested all the same: the run fails with this error in the UI, where it is seen.
            context.log.warning(f"source {s!r}: {exc}")
            version, fingerprint = "unreadable", "unreadable"
        changed = not is_current(committed, version, fingerprint)
        context.log.info(f"source {s!r}: " + ("changed since its last committed build" if changed
                                               else "as committed; a no-op rebuild verifies it"))
        requests.append(dg.RunRequest(
            run_key=f"daily:{day}:{build_run_key(s, version, fingerprint, committed)}", partition_key=s,
            tags={"pid/source": s, "pid/config_version": version, "pid/changed_since_commit": str(changed).lower(),
                  "pid/settings_file": store.source_file_uri(s, SETTINGS_NAME)},
        ))
    if not requests:
        return dg.SkipReason(f"every source is being built: {', '.join(busy)}")
    return requests
