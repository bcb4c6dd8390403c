"""A build run holds its source's output from its first build step to its end, not per step.

Each build step runs inside ``holding_output``: the run's hold on the output is taken (first
step) or renewed (later steps), renewed in the background while the step runs, and this process
acts for the run, so its own steps pass the build lock and lease while a ``pid-shard`` of the
same output is refused, naming the run (``sharding/run_hold.py``). The hold is released by the
run's last step, by a step that fails for good, and by ``run_holds_sensor`` once the run has
ended, however it ended (canceled, failed, or succeeded without its last step).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

from pid_platform.defs.automation.alerts import job_label
from pid_platform.defs.automation.builds import builds_source
from pid_platform.defs.automation.source_holder import HOLDING, oldest_builds, refuse_unless_holding
from pid_platform.defs.resources import SourceStoreResource
from pid_platform.defs.retries import is_transient
from pid_platform.sharding.run_hold import (
    RunHoldForStep,
    acting_for,
    release_hold,
    renew_hold,
    ttl_from_env,
)

ENDED = [dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]


def _ended(instance: dg.DagsterInstance, run_id: str) -> bool:
    run = instance.get_run_by_id(run_id)
    return run is not None and run.status in ENDED


@contextmanager
def holding_output(context: dg.OpExecutionContext | dg.AssetExecutionContext, source: str,
                   source_store: SourceStoreResource) -> Iterator[RunHoldForStep]:
    """A build step of ``source``: refused at once when another run holds the source, else the
    run's hold on its output for the block. ``hold.release()`` inside the block: the run's build
    ends with this step. An error that fails the step for good releases the hold (a transient
    one is retried by the step's retry policy, which keeps it)."""
    refuse_unless_holding(context, source)  # another run of this instance: named (source_holder.py)
    run = context.run
    output = source_store.source_output(source)
    instance = context.instance
    hold = RunHoldForStep(output, run.run_id, job_label(run), source,
                          may_take_over=lambda other: _ended(instance, other))
    with hold, acting_for(run.run_id):
        if hold.took_over is not None:
            context.log.warning(f"{source}: took over the hold of run {hold.took_over.run_id}, which has ended "
                                "without releasing it")
        try:
            yield hold
        except GeneratorExit:  # a step's generator closed early: not a failure
            raise
        except BaseException as exc:
            if not _retried(context, exc):
                hold.release()
            raise


def _retried(context: dg.OpExecutionContext | dg.AssetExecutionContext, exc: BaseException) -> bool:
    """Whether the step will run again after ``exc`` (its run keeps the hold meanwhile)."""
    if isinstance(exc, dg.RetryRequested):
        return context.retry_number < exc.max_retries
    policy = context.op_def.retry_policy
    return is_transient(exc) and policy is not None and context.retry_number < policy.max_retries


@dg.sensor(
    minimum_interval_seconds=15,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Every 15 s: releases the hold a build run has on its source's output once the run has ended "
                "(succeeded, failed or canceled), and renews the hold of a build run still running (between two "
                "of its steps nothing else does). While a build run holds an output, a pid-shard build of it is "
                "refused, naming the run; a hold nobody releases expires after PID_RUN_HOLD_TTL_S (an hour).",
)
def run_holds_sensor(context: dg.SensorEvaluationContext, source_store: SourceStoreResource) -> dg.SkipReason:
    # Only runs that ended since the last tick, and never further back than a hold lives.
    since = max(float(context.cursor or 0), time.time() - ttl_from_env())
    records = context.instance.get_run_records(
        dg.RunsFilter(statuses=ENDED, updated_after=dt.datetime.fromtimestamp(since, dt.UTC)))
    released = []
    for r in sorted(records, key=lambda r: r.storage_id):
        run, source = r.dagster_run, r.dagster_run.tags.get("dagster/partition")
        if source is None or not builds_source(run):
            continue
        output = source_store.source_output(source)
        if release_hold(output, run.run_id):
            released.append(f"{source} ({run.run_id[:8]}, {run.status.value.lower()})")
    if records:
        context.update_cursor(str(max(r.update_timestamp.timestamp() for r in records)))
    # A run between two steps (waiting for pool slots, say) has no step renewing its hold: keep
    # the hold of each source's holding run alive while that run has not ended.
    kept = []
    for source, run in sorted(oldest_builds(context.instance.get_run_records(dg.RunsFilter(statuses=HOLDING))).items()):
        if renew_hold(source_store.source_output(source), run.run_id):
            kept.append(f"{source} ({run.run_id[:8]})")
    said = [f"released the holds of ended runs: {', '.join(released)}" if released
            else "no ended run still held its output"]
    if kept:
        said.append(f"renewed the holds of running runs: {', '.join(kept)}")
    return dg.SkipReason("; ".join(said))
