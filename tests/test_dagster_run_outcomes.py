"""Issue 34: runs started from the UI end as the operator expects, driven as the UI drives them
(GraphQL launches with the launchpad's config, "Re-execute" and "Terminate" from the run page,
the daemon's run queue, run workers): a re-execution that finds its source rebuilt since has
nothing to finish (part 2); a verified no-op after a failed build clears the red
state (part 3); a launchpad re-shard reaches ``sharding.yaml`` only when its build
commits (part 5); a small source builds in one process, a big one fans out (part 7)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from pid_platform.defs.executors import pid_executor
from pid_platform.defs.latest import latest_materialization
from pid_platform.defs.small_sources import (
    IN_PROCESS_BELOW_ENV,
    SmallSourceSettingError,
    in_process_below_bytes,
)
from pid_platform.demo import pid_demo as demo
from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.pause_points import PAUSE_AT_ENV, PAUSE_DIR_ENV, PAUSE_TIMEOUT_ENV
from pid_platform.sharding.settings import SETTINGS_NAME
from pid_platform.sharding.tasks.commit import staged_shards
from pid_platform.sharding.tasks.outcomes import shard_done_point
from pid_platform.sharding.tasks.records import WRITE, record_path
from tests.support.procs import descendants, kill_all, parent_map, wait_gone
from tests.support.ui_launch import (
    REPO,
    dequeue,
    graphql,
    launch,
    launchpad_params,
    partition_status,
    reexecute,
    run_messages,
    step_keys,
    terminate,
    ui_workspace,
    wait_done,
)

SOURCE = "photos"
STALE_STATUS = """query($key: AssetKeyInput!, $partition: String) { assetNodeOrError(assetKey: $key) {
  __typename ... on AssetNode { staleStatus(partition: $partition) } } }"""
SUCCESS, FAILURE, CANCELED = dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED


@pytest.fixture
def ui_home(tmp_path: Path, out_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A prepared instance (``pid-demo --prepare-instance``) whose code server and run workers
    import this tree."""
    home = demo.prepare_home(tmp_path / "home")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return home


def _hide_a_file(raw_root: Path) -> tuple[Path, Path]:
    """One image gone without touching any other file's identity (the image folder becomes links
    to the other files of the real one, moved aside): a write task holding it fails for good."""
    image = raw_root / SOURCE / "image"
    victim = sorted(image.iterdir())[0]
    real = image.rename(image.with_name("_image"))
    image.mkdir()
    for f in sorted(real.iterdir()):
        if f.name != victim.name:
            (image / f.name).symlink_to(f)
    return image, real


@pytest.mark.slow
def test_reexecute_from_failure_after_a_rebuild_has_nothing_to_finish(
    ui_home: Path, raw_root: Path, out_root: Path,
) -> None:
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        # The samples staged; then a file goes missing and a write task of the tars fails.
        staged = launch(context, launchpad_params("source_build", SOURCE, ["sample_set"], write_tasks=3))
        assert wait_done(instance, staged, 300, context) == SUCCESS
        image, real = _hide_a_file(raw_root)
        # A re-shard typed in the launchpad, which fails: sharding.yaml is left as it was.
        failed = launch(context, launchpad_params("source_build", SOURCE,
                                                  ["twin_tar_shards", "key_indexes", "wdinfo_manifests"],
                                                  write_tasks=3, max_shard_size_mb=0.25))
        assert wait_done(instance, failed, 300, context) == FAILURE
        assert not (raw_root / SOURCE / SETTINGS_NAME).exists()
        assert any("written to" in m and "only when this build commits" in m for m in run_messages(instance, failed))
        failed_steps = step_keys(instance, failed, dg.DagsterEventType.STEP_FAILURE)
        assert len(failed_steps) == 1 and failed_steps[0].startswith("twin_tar_shards.write_task"), failed_steps

        # The file is back, and the source is rebuilt and committed by another run (the sensor's).
        shutil.rmtree(image)
        real.rename(image)
        rebuilt = launch(context, launchpad_params("source_build", SOURCE))
        assert wait_done(instance, rebuilt, 300, context) == SUCCESS
        committed = latest_materialization(instance, "wdinfo_manifests", SOURCE)

        # Re-execute -> From failure on the failed run: nothing is staged any more.
        again = reexecute(context, failed)
        dequeue(context)
        assert wait_done(instance, again, 300, context) == SUCCESS
        said = [m for m in run_messages(instance, again) if "nothing to finish" in m]
        assert said and all(f"nothing to finish: {SOURCE} was rebuilt by run {rebuilt}" in m for m in said), said
        assert not any("already done" in m for m in run_messages(instance, again))
        assert step_keys(instance, again, dg.DagsterEventType.STEP_FAILURE) == []
        # The committed build's state stands: no new materialization, no asset red.
        latest = latest_materialization(instance, "wdinfo_manifests", SOURCE)
        assert latest.storage_id == committed.storage_id
        for asset in ("twin_tar_shards", "key_indexes", "wdinfo_manifests"):
            assert partition_status(context, asset) == {"materialized": [SOURCE], "failed": []}, asset
    assert (out_root / SOURCE / ".pid-build" / "sharding.json").is_file()
    assert not (raw_root / SOURCE / SETTINGS_NAME).exists()


@pytest.mark.slow
def test_a_verified_noop_after_a_failed_build_clears_the_red_state(
    ui_home: Path, raw_root: Path, out_root: Path,
) -> None:
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        built = launch(context, launchpad_params("source_build", SOURCE))
        assert wait_done(instance, built, 300, context) == SUCCESS
        manifests = dg.AssetKey("wdinfo_manifests")
        committed = latest_materialization(instance, manifests, SOURCE)
        # A typo in the source's sharding.yaml fails the next build: the source turns red.
        settings = raw_root / SOURCE / SETTINGS_NAME
        settings.write_text("max_shard_size_mb: lots\n")
        failed = launch(context, launchpad_params("source_build", SOURCE))
        assert wait_done(instance, failed, 300, context) == FAILURE
        assert partition_status(context, "sample_set")["failed"] == [SOURCE]
        # The cause fixed, a plain rebuild finds the source as committed and verifies it.
        settings.unlink()
        noop = launch(context, launchpad_params("source_build", SOURCE))
        assert wait_done(instance, noop, 300, context) == SUCCESS
        said = run_messages(instance, noop)
        assert any("up to date" in m for m in said) and any("all passed" in m for m in said), said
        for asset in ("sample_set", "twin_tar_shards", "key_indexes", "wdinfo_manifests"):
            assert partition_status(context, asset) == {"materialized": [SOURCE], "failed": []}, asset
        # The committed version restated: the same data version, so nothing downstream is stale.
        latest = latest_materialization(instance, manifests, SOURCE)
        assert latest.storage_id != committed.storage_id
        assert latest.asset_materialization.tags.get("dagster/data_version") == \
            committed.asset_materialization.tags.get("dagster/data_version")
        # The re-asserted checks are on the restated materialization, the one the asset page shows.
        check = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(manifests, "manifest_counts_match_tars"), limit=1)[0]
        assert check.run_id == noop and check.status.value == "SUCCEEDED", check
        assert check.event.dagster_event.asset_check_evaluation_data.target_materialization_data.storage_id == \
            latest.storage_id
        for asset in ("twin_tar_shards", "key_indexes", "wdinfo_manifests"):
            node = graphql(context, STALE_STATUS, {"key": {"path": [asset]}, "partition": SOURCE})["assetNodeOrError"]
            assert node["staleStatus"] == "FRESH", (asset, node)
        # A second no-op restates nothing more: a source that is green gets no new event.
        again = launch(context, launchpad_params("source_build", SOURCE))
        assert wait_done(instance, again, 300, context) == SUCCESS
        assert latest_materialization(instance, manifests, SOURCE).storage_id == latest.storage_id


def _wait_for(path: Path, context, run_id: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout_s} s"
        status = context.instance.get_run_by_id(run_id).status
        assert status not in (SUCCESS, FAILURE, CANCELED), f"run {run_id} ended ({status}) before {path.name}"
        dequeue(context)
        time.sleep(0.2)


@pytest.mark.slow
def test_a_cancelled_launchpad_reshard_leaves_sharding_yaml_and_a_committed_one_writes_it(
    ui_home: Path, raw_root: Path, out_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings_file = raw_root / SOURCE / SETTINGS_NAME
    settings_file.write_text("seed: 7\n")
    before = settings_file.read_bytes()
    # The write task holds after its first shard, so the operator can cancel a run in flight.
    pause = tmp_path / "pause"
    pause.mkdir()
    point = shard_done_point(0, 1)
    monkeypatch.setenv(PAUSE_AT_ENV, point)
    monkeypatch.setenv(PAUSE_DIR_ENV, str(pause))
    monkeypatch.setenv(PAUSE_TIMEOUT_ENV, "20")
    reshard = launchpad_params("source_build", SOURCE, write_tasks=1, max_shard_size_mb=0.25)
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        cancelled = launch(context, reshard)
        _wait_for(pause / f"{point.replace(':', '-')}.reached", context, cancelled, timeout_s=120)
        assert settings_file.read_bytes() == before  # planned and writing: not in the file yet
        terminate(context, cancelled)
        # The step is interrupted at once; its writer thread, held at the point, gives up after
        # PID_PAUSE_TIMEOUT_S, and the run ends Canceled.
        assert wait_done(instance, cancelled, 120) == CANCELED
        assert settings_file.read_bytes() == before
        said = [m for m in run_messages(instance, cancelled) if "launchpad sharding" in m]
        assert said and all("max_shard_size_mb: 500.0 -> 0.25" in m and "the file stays as it is" in m
                            for m in said), said

        # The same re-shard, committed: now the file holds it, its other keys kept.
        (pause / f"{point.replace(':', '-')}.go").write_text("")
        committed = launch(context, reshard)
        assert wait_done(instance, committed, 300, context) == SUCCESS
        assert yaml.safe_load(settings_file.read_text()) == {"seed": 7, "max_shard_size_mb": 0.25}
        assert any("the build committed; launchpad sharding written" in m for m in run_messages(instance, committed))


def _hold_first_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A build's single write task holds after its first shard: the marker it leaves on reaching
    the point, and the file that lets it go on."""
    pause = tmp_path / "pause"
    pause.mkdir()
    point = shard_done_point(0, 1)
    monkeypatch.setenv(PAUSE_AT_ENV, point)
    monkeypatch.setenv(PAUSE_DIR_ENV, str(pause))
    stem = point.replace(":", "-")
    return pause / f"{stem}.reached", pause / f"{stem}.go"


def _without_the_queue_limit(home: Path) -> None:
    """An instance whose dagster.yaml lacks the run queue's one-run-per-partition limit (an older
    deployment's, or a limit raised by hand): a second run of a source gets past the queue."""
    config = yaml.safe_load((home / "dagster.yaml").read_text())
    del config["concurrency"]["runs"]["tag_concurrency_limits"]
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.slow
def test_a_second_build_past_the_queue_stops_at_once_naming_the_run_that_holds_the_source(
    ui_home: Path, raw_root: Path, out_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found on the second day: two launchpad runs of one source both started, their steps
    interleaved in one staging folder, and the first failed late with pid-shard advice naming no
    other run. A run that gets past the queue now stops in its first step, touching nothing, and
    says which run holds the source; the holder builds on undisturbed."""
    _without_the_queue_limit(ui_home)
    reached, go = _hold_first_shard(tmp_path, monkeypatch)
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        first = launch(context, launchpad_params("source_build", SOURCE, write_tasks=1, max_shard_size_mb=0.25))
        _wait_for(reached, context, first, timeout_s=180)
        second = launch(context, launchpad_params("source_build", SOURCE))
        assert wait_done(instance, second, 300, context) == FAILURE
        assert step_keys(instance, second, dg.DagsterEventType.STEP_START) == ["sample_set"]
        failures = [r.dagster_event.step_failure_data.error.message
                    for r in instance.all_logs(second, of_type=dg.DagsterEventType.STEP_FAILURE)]
        assert len(failures) == 1, failures
        assert failures[0].startswith(f"SourceHeldError: {SOURCE} is being built by run {first} (source_build, "
                                      "started); one build of a source runs at a time"), failures
        go.write_text("")
        assert wait_done(instance, first, 300, context) == SUCCESS
    built = yaml.safe_load((out_root / SOURCE / ".pid-build" / "sharding.json").read_text())
    assert built["max_shard_size_mb"] == 0.25  # the holder's build, whole


@pytest.mark.slow
def test_a_queued_build_names_the_run_that_holds_its_source(
    ui_home: Path, raw_root: Path, out_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run queue holds a second run of a source back; the queued run's tag and log name the
    run it waits for (the sensor's tick, as the daemon runs it), once; then it builds."""
    from pid_platform.defs.automation.source_holder import QUEUED_BEHIND_TAG, queued_builds_sensor

    reached, go = _hold_first_shard(tmp_path, monkeypatch)
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        first = launch(context, launchpad_params("source_build", SOURCE, write_tasks=1))
        _wait_for(reached, context, first, timeout_s=180)
        second = launch(context, launchpad_params("source_build", SOURCE, assets=["sample_set"]))
        dequeue(context)
        assert instance.get_run_by_id(second).status == dg.DagsterRunStatus.QUEUED
        for _ in range(2):  # a second tick adds nothing
            with dg.build_sensor_context(instance=instance) as tick:
                queued_builds_sensor(tick)
        assert instance.get_run_by_id(second).tags[QUEUED_BEHIND_TAG] == first
        said = [r.message for r in instance.all_logs(second, of_type=dg.DagsterEventType.ENGINE_EVENT)
                if "queued behind" in r.message]  # the run's log in the UI shows an engine event's message
        assert said == [f"queued behind run {first} (source_build, started), which is building {SOURCE}: one build "
                        "of a source runs at a time, so this run starts when that one ends"], said
        go.write_text("")
        assert wait_done(instance, first, 300, context) == SUCCESS
        assert wait_done(instance, second, 300, context) == SUCCESS


@pytest.mark.slow
def test_a_step_error_gives_the_ui_advice_not_a_pid_shard_command(
    ui_home: Path, raw_root: Path, out_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Write task 1 of 2 holds after its first shard; meanwhile task 0's completion record is lost.
    pause = tmp_path / "pause"
    pause.mkdir()
    point = shard_done_point(1, 2)
    monkeypatch.setenv(PAUSE_AT_ENV, point)
    monkeypatch.setenv(PAUSE_DIR_ENV, str(pause))
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        run = launch(context, launchpad_params("source_build", SOURCE, write_tasks=2, max_shard_size_mb=0.25))
        stem = point.replace(":", "-")
        _wait_for(pause / f"{stem}.reached", context, run, timeout_s=180)
        record = record_path(staging_dir(out_root / SOURCE), WRITE, 0, 2)
        assert record.is_file(), sorted(record.parent.iterdir())
        record.unlink()
        (pause / f"{stem}.go").write_text("")
        assert wait_done(instance, run, 300, context) == FAILURE
        failures = [r.dagster_event.step_failure_data.error.message
                    for r in instance.all_logs(run, of_type=dg.DagsterEventType.STEP_FAILURE)]
        assert len(failures) == 1 and "write task 0 of 2 has not finished" in failures[0], failures
        assert "pid-shard" not in failures[0] and "Re-execute -> All steps" in failures[0], failures
    # The CLI's commit of the same staged build still names the command its user runs.
    assert "run `pid-shard task --index I --of 2` for each" in str(staged_shards(out_root / SOURCE, None, "commit").unfinished())


TERMINATE_RUN = """mutation($runId: String!) { terminateRun(runId: $runId, terminatePolicy: SAFE_TERMINATE) {
  __typename ... on PythonError { message } ... on TerminateRunFailure { message } } }"""
FORCE_TERMINATE = """mutation($runId: String!) { terminateRun(runId: $runId, terminatePolicy: MARK_AS_CANCELED_IMMEDIATELY) {
  __typename ... on PythonError { message } } }"""


def _run_worker_pid(instance: dg.DagsterInstance, run_id: str) -> int:
    """The run worker's pid, from its "Started process for run (pid: N)" event."""
    for record in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        data = record.dagster_event.engine_event_data
        if data is not None and "pid" in data.metadata:
            return int(data.metadata["pid"].value)
    raise AssertionError(f"run {run_id} logged no run worker pid")


@pytest.mark.slow
def test_a_run_whose_worker_no_longer_answers_ends_with_force_termination_and_frees_its_slot(
    ui_home: Path, raw_root: Path, out_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the README says of Terminate and Force termination, from the UI: a run whose worker
    hangs stays Canceling after Terminate; Force termination marks it Canceled at once; the
    pid_build slot its write task held is freed by the daemon's run monitoring once the run has
    been over for free_slots_after_run_end_seconds (10 s), not minutes later."""
    import datetime as dt
    import logging
    import os
    import signal

    from dagster._core.test_utils import freeze_time
    from dagster._daemon.monitoring.concurrency import execute_concurrency_slots_iteration

    reached, _go = _hold_first_shard(tmp_path, monkeypatch)
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        run_id = launch(context, launchpad_params("source_build", SOURCE, write_tasks=1))
        _wait_for(reached, context, run_id, timeout_s=180)
        storage = instance.event_log_storage

        def holders() -> list[str]:
            return [s.run_id for s in storage.get_concurrency_info("pid_build").claimed_slots]

        assert holders() == [run_id]  # its write task holds a pid_build slot
        worker = _run_worker_pid(instance, run_id)
        code_server = parent_map()[worker]  # started by ui_workspace; the run worker is its child
        # Hung, not killed: the code server polls its workers every 0.5 s and marks a dead one's
        # run Failure, so a killed worker raced the Terminate below (CI saw Failure). A stopped one
        # is alive to that poll and answers nothing.
        os.kill(worker, signal.SIGSTOP)
        # Terminate marks the run Canceling, then asks the worker to stop through the code server,
        # which sets the run's termination event: a multiprocessing Event whose set() waits for its
        # waiter (the worker's termination thread) to wake. A hung worker never does, so the UI
        # reports "User code server request timed out" after 60 s and the run stays Canceling,
        # which is what the README tells its user to end with Force termination.
        said = graphql(context, TERMINATE_RUN, {"runId": run_id})["terminateRun"]
        assert said["__typename"] == "PythonError" and "timed out" in said["message"], said
        assert instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.CANCELING
        done = graphql(context, FORCE_TERMINATE, {"runId": run_id})["terminateRun"]
        assert done["__typename"] == "TerminateRunSuccess", done
        assert instance.get_run_by_id(run_id).status == CANCELED
        assert holders() == [run_id]  # the dead step never gave its slot back

        def monitor(after_s: float) -> None:  # one run-monitoring tick of the daemon, after_s past the end
            ended = instance.get_run_record_by_id(run_id).end_time
            with freeze_time(dt.datetime.fromtimestamp(ended + after_s, dt.UTC)):
                list(execute_concurrency_slots_iteration(context, logging.getLogger("monitor")))

        monitor(5)
        assert holders() == [run_id]
        monitor(11)
        assert holders() == []
    # That code server keeps the stuck request and does not exit on its own: end it and the
    # stopped worker (SIGKILL ends a stopped process), by their pids.
    left = {code_server} | descendants(code_server)
    kill_all(left)
    assert wait_gone(left, 10) == set()


@pytest.mark.slow
def test_a_run_whose_worker_is_killed_fails_within_seconds(
    ui_home: Path, raw_root: Path, out_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the README says of a killed worker: its code server sees it gone (it polls its workers
    every 0.5 s) and marks the run Failure, saying so in the run's log; no Terminate is needed."""
    import os
    import signal

    reached, _go = _hold_first_shard(tmp_path, monkeypatch)
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        run_id = launch(context, launchpad_params("source_build", SOURCE, write_tasks=1))
        _wait_for(reached, context, run_id, timeout_s=180)
        os.kill(_run_worker_pid(instance, run_id), signal.SIGKILL)
        assert wait_done(instance, run_id, 30, context) == FAILURE
        said = [r.dagster_event.message for r in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)]
        assert any("Run execution process" in (m or "") for m in said), said


RUN_LOG = """query($runId: ID!) { logsForRun(runId: $runId) { __typename ... on EventConnection { events {
  __typename ... on MessageEvent { stepKey } ... on ExecutionStepFailureEvent { error { message } } } } } }"""


@pytest.mark.slow
def test_a_failed_step_and_its_alert_read_without_class_paths(ui_home: Path, raw_root: Path, out_root: Path) -> None:
    """A Materialize click of a source's assets with a typo in its sharding.yaml: the run view's
    error (what GraphQL gives the UI) and the alert's text start with the cause's own class name,
    with no Dagster or pid_platform class path, and the alert names the job short."""
    from pid_platform.defs.automation.alerts import run_failure_alert, step_errors

    (raw_root / SOURCE / SETTINGS_NAME).write_text("max_shard_size_mb: lots\n")
    assets = ["sample_set", "twin_tar_shards", "key_indexes", "wdinfo_manifests"]
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        run_id = launch(context, launchpad_params("__ASSET_JOB", SOURCE, assets))
        assert wait_done(instance, run_id, 300, context) == FAILURE
        events = graphql(context, RUN_LOG, {"runId": run_id})["logsForRun"]["events"]
        shown = [e["error"]["message"] for e in events if e["__typename"] == "ExecutionStepFailureEvent"]
        assert len(shown) == 1, shown
        first_line = shown[0].splitlines()[0]
        assert first_line.startswith(f"ShardingConfigError: {raw_root / SOURCE / SETTINGS_NAME}: sharding setting "
                                     "max_shard_size_mb='lots' is invalid"), first_line
        assert "dagster." not in first_line and "pid_platform." not in first_line
        errors = step_errors(instance, run_id)
        alert = run_failure_alert(instance.get_run_by_id(run_id), None, sorted(errors), errors)
    assert alert["text"] == (f"Dagster run {run_id[:8]} of materialize key_indexes, sample_set and 2 more failed "
                             f"(partition {SOURCE}): sample_set: {first_line}")
    assert alert["title"] == f"materialize key_indexes, sample_set and 2 more failed for {SOURCE} in sample_set"


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _worker_processes(instance: dg.DagsterInstance, run_id: str) -> int:
    """Steps the run started as processes of their own (the multiprocess executor's workers)."""
    return len(instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_WORKER_STARTING))


@pytest.mark.slow
def test_a_small_source_builds_in_one_process_and_a_big_one_fans_out(
    ui_home: Path, raw_root: Path, out_root: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "tiny": four samples of photos; the threshold lies between it and photos.
    photos = raw_root / SOURCE
    for modality in sorted(p for p in photos.iterdir() if p.is_dir()):
        (raw_root / "tiny" / modality.name).mkdir(parents=True)
        for f in sorted(modality.iterdir())[:4]:
            shutil.copy2(f, raw_root / "tiny" / modality.name / f.name)
    threshold = _folder_bytes(photos) // 2
    assert _folder_bytes(raw_root / "tiny") < threshold
    monkeypatch.setenv(IN_PROCESS_BELOW_ENV, str(threshold / 2**20))
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE, "tiny"])
        small = launch(context, launchpad_params("source_build", "tiny", write_tasks=2))
        big = launch(context, launchpad_params("source_build", SOURCE, write_tasks=2, max_shard_size_mb=0.25))
        assert wait_done(instance, small, 300, context) == SUCCESS
        assert wait_done(instance, big, 300, context) == SUCCESS
        # The small one: every step, the two write tasks included, in the run's own process.
        engine = [r.user_message for r in instance.all_logs(small, of_type=dg.DagsterEventType.ENGINE_EVENT)]
        assert any("tiny: a small source" in m and "its steps run in this process" in m for m in engine), engine
        assert _worker_processes(instance, small) == 0
        assert len([s for s in step_keys(instance, small, dg.DagsterEventType.STEP_SUCCESS)
                    if s.startswith("twin_tar_shards.write_task")]) == 2
        # The big one fans out: a process per step.
        assert _worker_processes(instance, big) >= 4
    assert (out_root / "tiny" / ".pid-build" / "sharding.json").is_file()


def test_the_small_source_threshold_is_a_checked_setting() -> None:
    assert in_process_below_bytes({}) == 256 * 2**20
    assert in_process_below_bytes({IN_PROCESS_BELOW_ENV: "0"}) == 0
    assert in_process_below_bytes({IN_PROCESS_BELOW_ENV: "1.5"}) == int(1.5 * 2**20)
    for bad in ("-1", "lots", "nan"):
        with pytest.raises(SmallSourceSettingError, match=rf"{IN_PROCESS_BELOW_ENV}='{bad}': expected a size in MiB"):
            in_process_below_bytes({IN_PROCESS_BELOW_ENV: bad})
        # A typo fails the code location's load, not the first run of a small source.
        with pytest.raises(SmallSourceSettingError, match=IN_PROCESS_BELOW_ENV):
            pid_executor({IN_PROCESS_BELOW_ENV: bad})
