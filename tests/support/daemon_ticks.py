"""The daemon's own work, one iteration at a time, against a real instance (this module holds no
tests): the workspace loaded from ``workspace.yaml`` as ``dagster dev`` loads it, and the sensors
as the daemon sees them (their default status, their stored state)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
from dagster._core.remote_origin import InProcessCodeLocationOrigin
from dagster._core.remote_representation.external import RemoteSensor
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load import location_origins_from_yaml_paths
from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget
from dagster._daemon.asset_daemon import AssetDaemon

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def workspace_context(instance: dg.DagsterInstance) -> Iterator[WorkspaceProcessContext]:
    """The code location of ``workspace.yaml``, loaded in this process."""
    (origin,) = location_origins_from_yaml_paths([str(REPO / "workspace.yaml")])
    local = InProcessCodeLocationOrigin(origin.loadable_target_origin, location_name=origin.location_name)
    with WorkspaceProcessContext(instance, InProcessWorkspaceLoadTarget(local)) as context:
        yield context


def remote_sensors(context: WorkspaceProcessContext) -> dict[str, RemoteSensor]:
    with context.create_request_context() as request:
        (entry,) = request.get_code_location_entries().values()
        (repo,) = entry.code_location.get_repositories().values()
        return {s.name: s for s in repo.get_sensors()}


def remote_schedules(context: WorkspaceProcessContext) -> list:
    with context.create_request_context() as request:
        (entry,) = request.get_code_location_entries().values()
        (repo,) = entry.code_location.get_repositories().values()
        return list(repo.get_schedules())


def sensor_is_running(context: WorkspaceProcessContext, name: str) -> bool:
    """What the UI's Automation page shows for ``name`` (its stored state, else its default)."""
    sensor = remote_sensors(context)[name]
    stored = context.instance.get_instigator_state(sensor.get_remote_origin_id(), sensor.selector_id)
    return sensor.get_current_instigator_state(stored).is_running


def tick_automation(context: WorkspaceProcessContext) -> None:
    """One iteration of the daemon's automation loop (``dagster-daemon``'s AssetDaemon): every
    running automation-condition sensor due for a tick evaluates and submits its runs."""
    instance = context.instance
    daemon = AssetDaemon(settings=instance.get_auto_materialize_settings(), pre_sensor_interval_seconds=30)
    daemon._run_iteration_impl(context, threadpool_executor=None, amp_tick_futures={}, debug_crash_flags={})


def run_queued(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """What the run queue and a run worker do with every queued run, in this process: the run is
    marked starting (as ``DagsterInstance.launch_run`` marks it) and executed from its code
    origin, so its steps, checks and events are the real ones. Returns the runs, finished."""
    from dagster._core.definitions.reconstruct import ReconstructableJob
    from dagster._core.events import DagsterEvent, DagsterEventType
    from dagster._core.execution.api import execute_run
    from dagster._utils.hosted_user_process import recon_job_from_origin

    done = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.QUEUED])):
        instance.report_dagster_event(DagsterEvent(event_type_value=DagsterEventType.PIPELINE_STARTING.value,
                                                   job_name=run.job_name), run_id=run.run_id)
        # A run worker loads the code location anew (see pid_platform/demo/workspace_runs.py).
        ReconstructableJob.get_definition.cache_clear()
        ReconstructableJob.get_repository_definition.cache_clear()
        execute_run(recon_job_from_origin(run.job_code_origin), instance.get_run_by_id(run.run_id), instance)
        done.append(instance.get_run_by_id(run.run_id))
    return done
