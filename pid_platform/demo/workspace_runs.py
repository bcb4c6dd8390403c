"""Run a job of the workspace's code location in this process, recorded as the UI records its own.

``JobDefinition.execute_in_process`` records a run without a code-location origin: the UI cannot
tie it to a job (it is missing from the Jobs and Overview pages) and cannot re-execute it from
the code location. Here the job comes from the code location that ``workspace.yaml`` names, the
run is created with that location's origin (the same ``remote_job_origin`` a run launched from
the UI, a sensor or a schedule gets), and then executed in this process against the instance,
so its steps, pools, checks and events are the real ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
from dagster._core.definitions.reconstruct import ReconstructableJob
from dagster._core.definitions.selector import JobSubsetSelector
from dagster._core.execution.api import execute_run
from dagster._core.origin import JobPythonOrigin
from dagster._core.remote_origin import (
    InProcessCodeLocationOrigin,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
)
from dagster._core.remote_representation.code_location import InProcessCodeLocation
from dagster._core.workspace.load import location_origins_from_yaml_paths
from dagster._utils.hosted_user_process import recon_job_from_origin


class WorkspaceRuns:
    """Creates and executes runs of ``location_name``'s jobs; use ``open_workspace_runs``."""

    def __init__(self, instance: dg.DagsterInstance, location: InProcessCodeLocation, workspace_origin) -> None:
        self.instance = instance
        self._location = location
        self._origin = workspace_origin  # as `dagster dev -w workspace.yaml` names this location
        (self._repo,) = location.get_repositories().values()

    def run(self, job_name: str, *, partition_key: str | None = None, run_config: Mapping | None = None,
            tags: Mapping[str, str] | None = None) -> dg.ExecutionResult:
        """Create a run of ``job_name`` with the workspace origin and execute it here."""
        selector = JobSubsetSelector(location_name=self._location.name, repository_name=self._repo.name,
                                     job_name=job_name, op_selection=None)
        remote_job = self._location.get_job(selector)
        run_config = dict(run_config or {})
        all_tags = {**remote_job.tags, **(tags or {})}
        if partition_key is not None:
            all_tags["dagster/partition"] = partition_key
        plan = self._location.get_execution_plan(remote_job, run_config, step_keys_to_execute=None,
                                                 known_state=None, instance=self.instance)
        python_origin: JobPythonOrigin = remote_job.get_python_origin()
        run = self.instance.create_run(
            job_name=job_name, run_id=None, run_config=run_config,
            resolved_op_selection=None, step_keys_to_execute=None, op_selection=None, status=None,
            root_run_id=None, parent_run_id=None, tags=all_tags,
            job_snapshot=remote_job.job_snapshot, execution_plan_snapshot=plan.execution_plan_snapshot,
            parent_job_snapshot=remote_job.parent_job_snapshot,
            remote_job_origin=RemoteJobOrigin(RemoteRepositoryOrigin(self._origin, self._repo.name), job_name),
            job_code_origin=python_origin, asset_selection=None, asset_check_selection=None,
            asset_graph=self._repo.asset_graph,
        )
        # A run worker is a fresh process that loads the code location anew. In this process
        # Dagster keeps the last loaded job definition (lru_cache on ReconstructableJob), whose
        # resources were bound from the environment of an earlier load: drop it.
        ReconstructableJob.get_definition.cache_clear()
        ReconstructableJob.get_repository_definition.cache_clear()
        return execute_run(recon_job_from_origin(python_origin), run, self.instance)


@contextmanager
def open_workspace_runs(instance: dg.DagsterInstance, workspace_file: Path,
                        location_name: str | None = None) -> Iterator[WorkspaceRuns]:
    """The code location ``location_name`` (the only one when None) of ``workspace_file``, loaded
    in this process."""
    origins = {o.location_name: o for o in location_origins_from_yaml_paths([str(workspace_file)])}
    if location_name is None:
        if len(origins) != 1:
            raise ValueError(f"{workspace_file} names {len(origins)} code locations; say which one")
        (location_name,) = origins
    origin = origins[location_name]
    local = InProcessCodeLocationOrigin(origin.loadable_target_origin, location_name=location_name)
    with InProcessCodeLocation(local, instance=instance) as location:
        yield WorkspaceRuns(instance, location, origin)
