"""The daily rebuild of every registered source.

``build_schedule_from_partitioned_job`` rejects dynamic partitions, so this schedule lists them
itself. Unchanged shards are reused, so a rebuild of an unchanged source costs a listing and a
few hashes; what it catches is a config change or a change the sensor was off for.

Each source is rebuilt with its own settings (``sharding.yaml`` in its raw folder, read by the
run itself; a launchpad re-shard is written there), so a nightly run never cuts a source back to
the defaults. It is on by default; the run key carries the day and the settings' version.
"""

import dagster as dg

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
    """Requests a ``source_build`` run for every partition of ``sources``, once a day, each
    with the source's own sharding settings."""
    sources = sorted(context.instance.get_dynamic_partitions(SOURCES))
    if not sources:
        return dg.SkipReason("no sources registered yet; turn on raw_sources_sensor or run pid-demo")
    day = context.scheduled_execution_time.strftime("%Y-%m-%d")
    store, defaults = source_store.open(), sharding.config()
    requests = []
    for s in sources:
        try:
            version = source_settings(store, s, defaults).version
        except (BuildError, OSError) as exc:
            # Requested all the same: the run fails with this error in the UI, where it is seen.
            context.log.warning(f"source {s!r}: {exc}")
            version = "unreadable"
        requests.append(dg.RunRequest(
            run_key=f"daily:{day}:{s}:{version}", partition_key=s,
            tags={"pid/source": s, "pid/config_version": version,
                  "pid/settings_file": store.source_file_uri(s, SETTINGS_NAME)},
        ))
    return requests
