"""The checked-in instance configuration as ``./dev ui`` and ``./dev main`` set it up, the pool
limits in force right after start-up, runs recorded with the code location's origin, and the
run-failure alert (a log line and a webhook POST to a real local HTTP server)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from pid_platform.defs.pools import POOL_LIMITS_ENV, configured_pool_limits
from pid_platform.demo import pid_demo as demo
from pid_platform.demo.workspace_runs import open_workspace_runs
from tests.support.dagster_runs import load_defs, use_roots
from tests.support.ui_launch import dequeue, launch, launchpad_params, ui_workspace, wait_done
from tests.support.webhook import WebhookRecorder

REPO = Path(__file__).resolve().parents[1]


def _prepare(home: Path, **env: str) -> subprocess.CompletedProcess:
    """What ``./dev ui`` runs before ``dagster dev``: ``pid-demo --prepare-instance HOME``."""
    return subprocess.run(
        [sys.executable, "-m", "pid_platform.demo.pid_demo", "--prepare-instance", str(home)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env}, capture_output=True, text=True, timeout=120,
    )


def test_start_up_puts_the_checked_in_config_and_pool_limits_in_force(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = _prepare(home)
    assert proc.returncode == 0, proc.stderr
    assert (home / "dagster.yaml").read_text() == (REPO / "dagster.yaml").read_text()
    # Read back by a fresh instance, as the webserver and the daemon would: no sensor has ticked.
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        config = instance.get_concurrency_config()
        assert config.run_queue_config.max_concurrent_runs == 4
        # One run of a source at a time, whoever starts it; slots of a terminated run come back soon.
        (limit,) = config.run_queue_config.tag_concurrency_limits
        assert limit == {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1}
        assert instance.run_monitoring_settings["free_slots_after_run_end_seconds"] == 10
        # Checked every 15 s; a run stuck Canceling (its worker gone) is canceled after a minute.
        assert instance.run_monitoring_poll_interval_seconds == 15
        assert instance.run_monitoring_cancel_timeout_seconds == 60
        # Job pages do not say "Auto-materialize off" while the automation sensor runs.
        from dagster._daemon.asset_daemon import get_auto_materialize_paused
        assert not get_auto_materialize_paused(instance)
        assert (config.pool_config.default_pool_limit, config.pool_config.pool_granularity.value) == (1, "op")
        assert (instance.run_retries_enabled, instance.run_retries_max_retries) == (True, 2)
        assert instance.run_monitoring_enabled
        assert type(instance.event_log_storage).__name__ == "SqliteEventLogStorage"
        limits = {p.name: (p.limit, p.from_default) for p in instance.event_log_storage.get_pool_limits()}
        assert limits == {"pid_build": (2, False), "lerobot_publish": (1, False)}

    # The configuration wins at the next start-up, over a hand-set limit and with an override.
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.event_log_storage.set_concurrency_slots("lerobot_publish", 5)
    assert _prepare(home, **{POOL_LIMITS_ENV: "pid_build=3"}).returncode == 0
    with dg.DagsterInstance.from_config(str(home)) as instance:
        limits = {p.name: p.limit for p in instance.event_log_storage.get_pool_limits()}
        assert limits == {"pid_build": 3, "lerobot_publish": 1}


def test_a_home_with_its_own_config_is_left_alone(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    own = "# a team's own instance\ntelemetry:\n  enabled: false\n"
    (home / "dagster.yaml").write_text(own)
    assert _prepare(home).returncode == 0
    assert (home / "dagster.yaml").read_text() == own
    # An older copy this project wrote is replaced by the checked-in one.
    (home / "dagster.yaml").write_text("# Instance of pid-demo and `dagster dev`: old\n")
    assert _prepare(home).returncode == 0
    assert (home / "dagster.yaml").read_text() == (REPO / "dagster.yaml").read_text()


def test_an_alert_names_a_ui_materialization_by_its_assets() -> None:
    """A Materialize click (or an automation run) runs Dagster's hidden __ASSET_JOB."""
    from pid_platform.defs.automation.alerts import job_label, run_failure_alert

    run = dg.DagsterRun(job_name="__ASSET_JOB", run_id="0123456789abcdef",
                        asset_selection={dg.AssetKey("twin_tar_shards"), dg.AssetKey("sample_set")},
                        tags={"dagster/partition": "photos"})
    assert job_label(run) == "materialize sample_set, twin_tar_shards"
    alert = run_failure_alert(run, "Execution of run failed.", ["twin_tar_shards"], {"twin_tar_shards": "disk full"})
    assert alert["text"] == ("Dagster run 01234567 of materialize sample_set, twin_tar_shards failed "
                             "(partition photos): twin_tar_shards: disk full")
    assert (alert["job"], alert["job_name"]) == ("materialize sample_set, twin_tar_shards", "__ASSET_JOB")
    assert alert["title"] == "materialize sample_set, twin_tar_shards failed for photos in twin_tar_shards"
    assert job_label(dg.DagsterRun(job_name="source_build", run_id="x")) == "source_build"
    # An automation run of four assets and their checks: two named, the rest counted.
    many = dg.DagsterRun(job_name="__ASSET_JOB", run_id="x", asset_selection={
        dg.AssetKey(a) for a in ("twin_tar_shards", "key_indexes", "wdinfo_manifests", "sample_set")},
        asset_check_selection={dg.AssetCheckKey(dg.AssetKey("key_indexes"), "twin_tar_keys_match")})
    assert job_label(many) == "materialize key_indexes, sample_set and 2 more"


def test_step_errors_carry_no_module_paths() -> None:
    """What the run view and the alert say of a failed step: the error's own class name and
    message, not ``dagster._core...Failure: pid_platform.sharding.errors.X: ...``."""
    from pid_platform.defs.automation.alerts import step_errors
    from pid_platform.defs.retries import fail_without_retry_on
    from pid_platform.sharding.errors import BuildError

    @dg.asset
    def broken() -> None:
        with fail_without_retry_on():
            raise BuildError("photos: image/a.jpg is not a JPEG; remove it or fix it")

    with dg.instance_for_test() as instance:
        result = dg.materialize([broken], instance=instance, raise_on_error=False)
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        shown = failure.event_specific_data.error.message
        # The line the run view shows first: the cause's class and message, no Dagster class path.
        assert shown.startswith("BuildError: photos: image/a.jpg is not a JPEG"), shown
        assert "pid_platform." not in shown and "dagster." not in shown.splitlines()[0]
        assert step_errors(instance, result.run_id) == {
            "broken": "BuildError: photos: image/a.jpg is not a JPEG; remove it or fix it"}


def test_a_staged_state_error_in_a_step_advises_no_pid_shard_command() -> None:
    """The sharding layer's s3 staging errors advise `pid-shard plan` (their CLI users type it); in
    a Dagster step the run view and the alert say what an operator in the UI does."""
    from pid_platform.defs.retries import retry_only_transient
    from pid_platform.sharding.tasks.staging import StagedStateError, parse_staged

    where = "s3://bucket/photos/.pid-build/staged/staged.json"
    with pytest.raises(StagedStateError, match="pid-shard plan"):
        parse_staged(b'{"format": "other"}', where)  # what a pid-shard user reads
    with pytest.raises(dg.Failure) as failure, retry_only_transient():
        parse_staged(b'{"format": "other"}', where)
    shown = failure.value.description
    assert where in shown and "pid-shard plan" not in shown and "--input-dir" not in shown, shown
    assert shown.endswith("launch the source_build job for this partition again"), shown
    assert type(failure.value).__name__ == "StagedStateError" and failure.value.allow_retries is False


def test_bad_pool_limits_say_what_to_write() -> None:
    assert configured_pool_limits({POOL_LIMITS_ENV: " pid_build=4 , lerobot_publish=1"}) == {
        "pid_build": 4, "lerobot_publish": 1}
    with pytest.raises(ValueError, match=r"'pid_build:4' is not pool=limit .* e\.g\. pid_build=4"):
        configured_pool_limits({POOL_LIMITS_ENV: "pid_build:4"})


@pytest.fixture
def sqlite_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = demo.prepare_home(tmp_path / "home")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


def test_failed_run_has_its_origin_and_raises_the_alert(
    tmp_path: Path, sqlite_home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    raw = tmp_path / "raw"
    (raw / "empty-drop" / "image").mkdir(parents=True)  # a source without files: intake fails
    use_roots(monkeypatch, raw, tmp_path / "out")
    with dg.DagsterInstance.get() as instance, open_workspace_runs(instance, REPO / "workspace.yaml") as runs:
        instance.add_dynamic_partitions("sources", ["empty-drop"])
        result = runs.run("source_build", partition_key="empty-drop", run_config=demo.QUIET)
        assert not result.success
        run = instance.get_run_by_id(result.run_id)
        # What the UI keys its Jobs and Overview pages and re-execution on.
        origin = run.remote_job_origin
        assert origin is not None and origin.job_name == "source_build"
        assert (origin.location_name, origin.repository_origin.repository_name) == ("pid_platform", "__repository__")
        assert run.tags["dagster/partition"] == "empty-drop"
        # The failure was final at once: a source without files does not heal on a retry.
        retried = instance.get_records_for_run(result.run_id, of_type=dg.DagsterEventType.STEP_UP_FOR_RETRY).records
        assert retried == []

        sensor = load_defs().resolve_sensor_def("run_failure_alert_sensor")
        context = dg.build_run_status_sensor_context(
            sensor_name=sensor.name, dagster_event=result.get_run_failure_event(), dagster_instance=instance,
            dagster_run=run,
        ).for_run_failure()
        with WebhookRecorder() as hook:
            monkeypatch.setenv("PID_ALERT_WEBHOOK_URL", hook.url)
            with caplog.at_level(logging.ERROR, logger="pid_platform.alerts"):
                sensor(context)
            assert len(hook.posts) == 1
        post = hook.posts[0]
        assert post["content_type"] == "application/json" and post["path"] == "/alerts"
        body = post["body"]
        assert (body["run_id"], body["job"], body["partition"]) == (run.run_id, "source_build", "empty-drop")
        assert body["code_location"] == "pid_platform" and body["failed_steps"] == ["sample_set"]
        # The failed step's own error, not only its name: what to fix, in the alert.
        error = body["step_errors"]["sample_set"]
        assert "empty-drop" in error and not error.startswith("dagster")
        assert body["text"].endswith(f"(partition empty-drop): sample_set: {error}")
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("ALERT"))
        assert line.startswith(f"ALERT Dagster run {run.run_id[:8]} of source_build failed") and error in line

        # A webhook that does not answer fails the tick with its URL (it is tried again next tick).
        monkeypatch.setenv("PID_ALERT_WEBHOOK_URL", "http://127.0.0.1:9/alerts")
        with pytest.raises(Exception, match=r"127\.0\.0\.1:9/alerts .*PID_ALERT_WEBHOOK_URL"):
            sensor(context)


@pytest.mark.slow
def test_two_launchpad_builds_of_one_source_run_one_at_a_time(
    sqlite_home: Path, out_root: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two launchpad runs of one source, as the UI sends them (GraphQL ``launchRun`` with the
    partition tag), through the checked-in run queue: the daemon starts one; the other waits,
    queued, until the first has ended, then builds. A run of another source is not held back."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the code server and run workers import this tree
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", ["photos", "other"])
        runs = [launch(context, launchpad_params("source_build", partition, **sharding))
                for partition, sharding in (("photos", {}), ("photos", {"shard_size": 2}), ("other", {}))]
        assert all(instance.get_run_by_id(r).status == dg.DagsterRunStatus.QUEUED for r in runs)
        first, second, other = runs

        dequeue(context)
        status = {r: instance.get_run_by_id(r).status for r in runs}
        assert status[first] != dg.DagsterRunStatus.QUEUED
        assert status[second] == dg.DagsterRunStatus.QUEUED, status
        assert status[other] != dg.DagsterRunStatus.QUEUED  # another source is not held back
        # While the first build of photos works, the second stays in the queue.
        while instance.get_run_by_id(first).status not in (
                dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE):
            dequeue(context)
            assert instance.get_run_by_id(second).status == dg.DagsterRunStatus.QUEUED
            time.sleep(0.5)
        assert instance.get_run_by_id(first).status == dg.DagsterRunStatus.SUCCESS
        # The queue, ticked as the daemon ticks it, now starts the second.
        assert wait_done(instance, second, 300, context) == dg.DagsterRunStatus.SUCCESS
        # "other" has no files: it fails on its own, whatever photos does.
        assert wait_done(instance, other, 300) == dg.DagsterRunStatus.FAILURE
    # The second build ran after the first, whole: its setting is the committed one.
    built = json.loads((out_root / "photos" / ".pid-build" / "sharding.json").read_bytes())
    assert built["shard_size"] == 2
