"""Runs started as the Dagster UI starts them, against a real instance (this module holds no
tests): the workspace of ``workspace.yaml`` served by a code server, launches through the
webserver's GraphQL mutations with the launchpad's run config (``launchRun``, and "Re-execute"
as ``launchPipelineReexecution``), and the daemon's run queue (``QueuedRunCoordinatorDaemon``)
dequeuing them into run workers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg

REPO = Path(__file__).resolve().parents[2]
SELECTOR = {"repositoryLocationName": "pid_platform", "repositoryName": "__repository__"}
DONE = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)

LAUNCH = """mutation($params: ExecutionParams!) { launchRun(executionParams: $params) {
  __typename ... on LaunchRunSuccess { run { runId status } } ... on PythonError { message } } }"""
REEXECUTE = """mutation($params: ReexecutionParams!) { launchPipelineReexecution(reexecutionParams: $params) {
  __typename ... on LaunchRunSuccess { run { runId status } } ... on PythonError { message } } }"""
PARTITION_STATUS = """query($key: AssetKeyInput!) { assetNodeOrError(assetKey: $key) { __typename ... on AssetNode {
  assetPartitionStatuses { __typename ... on DefaultPartitionStatuses { materializedPartitions failedPartitions } } } } }"""


@contextmanager
def ui_workspace(instance: dg.DagsterInstance) -> Iterator[Any]:
    """The code location of ``workspace.yaml`` as ``dagster dev`` serves it (a code server process)."""
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import WorkspaceFileTarget

    with WorkspaceProcessContext(instance, WorkspaceFileTarget(paths=[str(REPO / "workspace.yaml")])) as context:
        yield context


def graphql(context: Any, query: str, variables: dict) -> dict:
    from dagster_graphql.test.utils import execute_dagster_graphql

    result = execute_dagster_graphql(context.create_request_context(), query, variables)
    assert not result.errors, result.errors
    return result.data


def launchpad_params(job: str, partition: str, assets: list[str] | None = None, **sharding: object) -> dict:
    """What the launchpad sends for ``job`` of ``partition`` with ``sharding`` typed into its
    config (``assets``: the asset selection the Materialize button sends)."""
    config = {"resources": {"sharding": {"config": {"num_workers": 1, **sharding}}}}
    selector: dict[str, Any] = {**SELECTOR, "jobName": job}
    if assets is not None:
        selector["assetSelection"] = [{"path": [a]} for a in assets]
    return {"params": {"selector": selector, "runConfigData": config,
                       "executionMetadata": {"tags": [{"key": "dagster/partition", "value": partition}]}}}


def launch(context: Any, params: dict) -> str:
    """``launchRun`` as the launchpad calls it; the run id (queued)."""
    launched = graphql(context, LAUNCH, params)["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    return launched["run"]["runId"]


def reexecute(context: Any, parent_run_id: str, strategy: str = "FROM_FAILURE") -> str:
    """The run page's "Re-execute" menu (``FROM_FAILURE``, ``ALL_STEPS``); the new run's id."""
    launched = graphql(context, REEXECUTE, {"params": {"parentRunId": parent_run_id, "strategy": strategy}})
    launched = launched["launchPipelineReexecution"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    return launched["run"]["runId"]


def dequeue(context: Any) -> None:
    """One iteration of the daemon's run queue (``dagster-daemon``'s QueuedRunCoordinatorDaemon)."""
    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import (
        QueuedRunCoordinatorDaemon,
    )

    daemon = QueuedRunCoordinatorDaemon(interval_seconds=1)
    list(daemon.run_iteration(context))


def wait_done(instance: dg.DagsterInstance, run_id: str, timeout_s: float,
              context: Any | None = None) -> dg.DagsterRunStatus:
    """The run's final status; with ``context``, the run queue is ticked meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if context is not None:
            dequeue(context)
        status = instance.get_run_by_id(run_id).status
        if status in DONE:
            return status
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} still {instance.get_run_by_id(run_id).status} after {timeout_s} s")


def run_messages(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    return [r.user_message for r in instance.all_logs(run_id)]


def step_keys(instance: dg.DagsterInstance, run_id: str, kind: dg.DagsterEventType) -> list[str]:
    return sorted(r.step_key for r in instance.all_logs(run_id, of_type=kind) if r.step_key)


def partition_status(context: Any, asset: str) -> dict[str, list[str]]:
    """What the UI's partition bar shows of ``asset``: its materialized and failed partitions."""
    node = graphql(context, PARTITION_STATUS, {"key": {"path": [asset]}})["assetNodeOrError"]
    status = node["assetPartitionStatuses"]
    return {"materialized": sorted(status["materializedPartitions"]), "failed": sorted(status["failedPartitions"])}


TERMINATE = """mutation($runId: String!) { terminateRun(runId: $runId, terminatePolicy: SAFE_TERMINATE) {
  __typename ... on PythonError { message } } }"""


def terminate(context: Any, run_id: str) -> None:
    """The run page's "Terminate" button."""
    done = graphql(context, TERMINATE, {"runId": run_id})["terminateRun"]
    assert done["__typename"] == "TerminateRunSuccess", done
