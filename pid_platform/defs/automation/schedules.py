"""The daily rebuild of every registered source.

``build_schedule_from_partitioned_job`` rejects dynamic partitions, so this schedule lists them
itself. Unchanged shards are reused, so a rebuild of an unchanged source costs a listing and a
few hashes; what it catches is a config change or a change the sensor was off for.

It is off by default: it rebuilds every source with the code location's one ``sharding``
configuration, so a source someone re-sharded from the launchpad would be cut back to the
defaults every night. Turn it on (UI: Automation) once sharding settings are kept per source.
"""

import dagster as dg

from pid_platform.defs.automation.jobs import source_build_job
from pid_platform.defs.partitions import SOURCES


@dg.schedule(
    cron_schedule="0 3 * * *",
    execution_timezone="UTC",
    job=source_build_job,
    default_status=dg.DefaultScheduleStatus.STOPPED,
)
def daily_source_rebuild(context: dg.ScheduleEvaluationContext) -> list[dg.RunRequest] | dg.SkipReason:
    """Requests a ``source_build`` run for every partition of ``sources``, once a day."""
    sources = sorted(context.instance.get_dynamic_partitions(SOURCES))
    if not sources:
        return dg.SkipReason("no sources registered yet; turn on raw_sources_sensor or run pid-demo")
    day = context.scheduled_execution_time.strftime("%Y-%m-%d")
    return [
        dg.RunRequest(run_key=f"daily:{day}:{s}", partition_key=s, tags={"pid/source": s}) for s in sources
    ]
