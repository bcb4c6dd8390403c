"""One build of a source at a time, whoever starts it, and which run holds it.

The run queue holds a second run of a source's partition while one runs (``dagster.yaml``:
``tag_concurrency_limits`` on ``dagster/partition``). A run can still get past the queue: an
instance whose ``dagster.yaml`` lacks the limit, a run launched without the queue, a limit raised
by hand. Such a run must not share the source's staging folder with the running build. So the
run that holds a source is its oldest build run that has started and not ended (starting,
started or canceling), in the order the instance stored the runs. The instance is the one record
every step of every run reports to, on whichever machine it runs.

* Every build step of a run checks this first (``refuse_unless_holding``). The run's first step
  finds itself the holder, and so does each later step of the same run. A step of any other run
  fails at once, naming the holder: its run id and its job. It touches nothing.
* ``queued_builds_sensor`` names the holder on a run the queue holds back: a tag
  ``pid/queued_behind`` (shown in the Runs list) and a line in the queued run's log.

A ``pid-shard`` build of the same output holds the output's lock for its whole build; a step
that meets it fails at once, naming its process (``sharding/output_lock.py``). The other way
round, a run holds its source's output from its first build step to its end, so a ``pid-shard``
started between two of its steps is refused, naming the run (``run_holds.py``).
"""

from __future__ import annotations

import dagster as dg

from pid_platform.defs.automation.alerts import job_label
from pid_platform.defs.automation.builds import builds_source
from pid_platform.defs.step_errors import step_failure

# A run in these states is past the queue and may be writing the source's staging folder.
HOLDING = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
QUEUED_BEHIND_TAG = "pid/queued_behind"


class SourceHeldError(Exception):
    """Another run is building the source (the name the run view shows for the refusal)."""


def source_holder(instance: dg.DagsterInstance, source: str) -> dg.DagsterRun | None:
    """The run that holds ``source``: the oldest run building any of its assets that has started
    and not ended (``None``: no run holds it)."""
    records = instance.get_run_records(dg.RunsFilter(statuses=HOLDING, tags={"dagster/partition": source}))
    return oldest_builds(records).get(source)


def oldest_builds(records) -> dict[str, dg.DagsterRun]:
    """Per source, the oldest of ``records`` (run records past the queue) that builds it."""
    holders: dict[str, dg.DagsterRun] = {}
    for r in sorted(records, key=lambda r: r.storage_id, reverse=True):  # the oldest written last
        source = r.dagster_run.tags.get("dagster/partition")
        if source is not None and builds_source(r.dagster_run):
            holders[source] = r.dagster_run
    return holders


def holder_named(holder: dg.DagsterRun) -> str:
    return f"run {holder.run_id} ({job_label(holder)}, {holder.status.value.lower()})"


def refuse_unless_holding(context: dg.OpExecutionContext | dg.AssetExecutionContext, source: str) -> None:
    """In a build step of ``source``: fail at once, touching nothing, when another run holds it."""
    holder = source_holder(context.instance, source)
    if holder is None or holder.run_id == context.run.run_id:
        return
    message = (f"{source} is being built by {holder_named(holder)}; one build of a source runs at a time, so this "
               "run stopped before touching it. Wait for that run to end, then launch this build again")
    raise step_failure(message, SourceHeldError(message))


@dg.sensor(
    minimum_interval_seconds=15,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Every 15 s: names, on each build run the run queue holds back, the run that is building its "
                "source (tag pid/queued_behind, and a line in the queued run's log). One build of a source runs "
                "at a time; the queued run starts when that run ends.",
)
def queued_builds_sensor(context: dg.SensorEvaluationContext) -> dg.SkipReason:
    instance = context.instance
    queued = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.QUEUED]))
    # One query for every source's holder, not one per queued run (a queue of 40 new sources).
    holders = oldest_builds(instance.get_run_records(dg.RunsFilter(statuses=HOLDING))) if queued else {}
    named = []
    for run in sorted(queued, key=lambda r: r.run_id):
        source = run.tags.get("dagster/partition")
        if source is None or not builds_source(run):
            continue
        holder = holders.get(source)
        if holder is None or run.tags.get(QUEUED_BEHIND_TAG) == holder.run_id:
            continue
        instance.add_run_tags(run.run_id, {QUEUED_BEHIND_TAG: holder.run_id})
        instance.report_engine_event(
            f"queued behind {holder_named(holder)}, which is building {source}: one build of a source runs at a "
            "time, so this run starts when that one ends", run)
        named.append(f"{run.run_id[:8]} behind {holder.run_id[:8]}")
    return dg.SkipReason(f"queued builds named with their holder: {', '.join(named)}" if named
                         else "no queued build waits on a new holder")

