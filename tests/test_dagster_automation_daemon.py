"""Declarative automation as the daemon runs it: on a fresh instance (the checked-in
``dagster.yaml``, sqlite) the automation sensor is on without anyone starting it, and the
daemon's tick submits a catalog run after a source build."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.test_utils import freeze_time
from dagster._time import get_current_datetime

from pid_platform.defs.automation.automation_sensor import AUTOMATION_SENSOR
from pid_platform.demo import pid_demo as demo
from pid_platform.demo.workspace_runs import open_workspace_runs
from tests.support.daemon_ticks import REPO, sensor_is_running, tick_automation, workspace_context

CATALOG = dg.AssetKey("dataset_catalog")


@pytest.fixture
def fresh_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = demo.prepare_home(tmp_path / "home")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


def _catalog_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    return [r for r in instance.get_runs() if r.asset_selection == {CATALOG}]


def test_automation_is_on_in_a_fresh_instance_and_the_catalog_follows_a_build(
    fresh_home: Path, raw_root: Path, out_root: Path,
) -> None:
    with dg.DagsterInstance.get() as instance, workspace_context(instance) as context:
        # Nobody turned anything on: the default status is what the daemon and the UI go by.
        assert sensor_is_running(context, AUTOMATION_SENSOR)
        assert "default_automation_condition_sensor" not in {
            s.name for s in context.create_request_context().get_code_location_entries()["pid_platform"]
            .code_location.get_repositories()["__repository__"].get_sensors()}
        now = get_current_datetime()
        with freeze_time(now):
            tick_automation(context)  # nothing built yet: nothing to follow
        assert _catalog_runs(instance) == []

        with open_workspace_runs(instance, REPO / "workspace.yaml") as runs:
            instance.add_dynamic_partitions("sources", ["photos"])
            built = runs.run("source_build", partition_key="photos", run_config=demo.QUIET)
            assert built.success
        assert not (out_root / "catalog.json").exists()

        with freeze_time(now + dt.timedelta(seconds=31)):  # the sensor's next tick is due
            tick_automation(context)
        [run] = _catalog_runs(instance)
        assert run.tags["pid/launched_by"] == "automation"
        assert run.tags["dagster/sensor_name"] == AUTOMATION_SENSOR
        assert run.status == dg.DagsterRunStatus.QUEUED  # handed to the run queue, as the daemon does

        with freeze_time(now + dt.timedelta(seconds=62)):  # requested once, not on every tick
            tick_automation(context)
        assert len(_catalog_runs(instance)) == 1


def test_a_catalog_not_rewritten_for_a_day_reads_failing_freshness(fresh_home: Path, raw_root: Path, out_root: Path) -> None:
    """The daemon's freshness evaluation: fresh after the night's catalog, failing once a night was missed."""
    from dagster._core.definitions.freshness import FreshnessState
    from dagster._daemon.freshness import FreshnessDaemon

    def state(context) -> FreshnessState:
        list(FreshnessDaemon().run_iteration(context))
        return context.instance.get_freshness_state_records([CATALOG])[CATALOG].freshness_state

    with dg.DagsterInstance.get() as instance, workspace_context(instance) as context:
        with open_workspace_runs(instance, REPO / "workspace.yaml") as runs:
            instance.add_dynamic_partitions("sources", ["photos"])
            assert runs.run("source_build", partition_key="photos", run_config=demo.QUIET).success
            assert runs.run("catalog_build", run_config=demo.QUIET).success
        now = get_current_datetime()
        with freeze_time(now + dt.timedelta(hours=1)):
            assert state(context) == FreshnessState.PASS
        with freeze_time(now + dt.timedelta(hours=25, minutes=30)):
            assert state(context) == FreshnessState.WARN
        with freeze_time(now + dt.timedelta(hours=27)):  # no nightly rebuild and catalog: the daemon is down
            assert state(context) == FreshnessState.FAIL
