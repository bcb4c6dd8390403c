"""What an operator does in the UI, against a real Dagster instance: runs launched with the config
the launchpad pre-fills (every default of the config schema, as the webserver scaffolds it) plus
the one setting the operator edits, Materialize on one asset, and the discovery sensor ticked
against the same instance while those runs are queued, running and done."""

from __future__ import annotations

import datetime as dt
import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml
from dagster._core.definitions.data_version import get_input_data_version_tag

from pid_platform.defs.partitions import SOURCES
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.settings import SETTINGS_NAME
from tests.support.dagster_runs import (
    apply_partition_requests,
    dagster_instance,
    evaluate_schedule,
    evaluate_sensor,
    launchpad_config,
    load_defs,
    materialized,
    observed,
    run_config,
    step_node,
    tars,
)

FILE_A = "max_shard_size_mb: 1\nseed: 7\n"
FILE_B = "max_shard_size_mb: 0.25\nseed: 7\n"
SETTINGS_INPUT_TAG = get_input_data_version_tag(dg.AssetKey("sharding_settings"))


def built_with(out: Path) -> ShardingConfig:
    """The settings the committed build of ``out`` was cut with."""
    import json

    return ShardingConfig(**json.loads((out / ".pid-build" / "sharding.json").read_bytes()))


def launch(defs: dg.Definitions, instance: dg.DagsterInstance, config: dict, assets: list[str] | None = None,
           tags: dict[str, str] | None = None) -> dg.ExecuteInProcessResult:
    """A run of partition ``photos`` launched from the UI: the launchpad's config, optionally
    only the assets the Materialize button was pressed on."""
    if "photos" not in instance.get_dynamic_partitions(SOURCES):
        instance.add_dynamic_partitions(SOURCES, ["photos"])
    return defs.resolve_job_def("source_build").execute_in_process(
        instance=instance, partition_key="photos", run_config=config, tags=tags, raise_on_error=False,
        asset_selection=[dg.AssetKey(a) for a in assets] if assets else None,
    )


def daemon_run(defs: dg.Definitions, instance: dg.DagsterInstance, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
    """What the daemon launches for a sensor's request: its partition and tags, no sharding config."""
    return defs.resolve_job_def("source_build").execute_in_process(
        instance=instance, partition_key=request.partition_key, run_config=run_config(),
        tags={**request.tags, "dagster/run_key": request.run_key}, raise_on_error=False,
    )


def step_failure(result: dg.ExecuteInProcessResult) -> tuple[str, str]:
    event = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    return event.step_key, event.step_failure_data.error.message


def retried(result: dg.ExecuteInProcessResult) -> list[str]:
    return [e.step_key for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]


def step_seconds(instance: dg.DagsterInstance, result: dg.ExecuteInProcessResult, step: str) -> float:
    """From the step's start to its final event, as the instance recorded them."""
    records = [r for r in instance.all_logs(result.run_id)
               if r.step_key and step_node(r.step_key) == step and r.dagster_event is not None]
    starts = [r.timestamp for r in records if r.dagster_event.event_type == dg.DagsterEventType.STEP_START]
    ends = [r.timestamp for r in records if r.dagster_event.event_type in (
        dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.STEP_SUCCESS)]
    return max(ends) - min(starts)


def log_messages(instance: dg.DagsterInstance, result: dg.ExecuteInProcessResult) -> list[str]:
    return [r.user_message for r in instance.all_logs(result.run_id)]


def source_builds(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    return [r for r in instance.get_runs(dg.RunsFilter(job_name="source_build", tags={"dagster/partition": "photos"}))
            if r.status == dg.DagsterRunStatus.SUCCESS]


def commits(instance: dg.DagsterInstance) -> list[dict[str, Any]]:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("wdinfo_manifests"), asset_partitions=["photos"]), limit=100).records
    return [{k: v.value for k, v in r.asset_materialization.metadata.items()} for r in records]


def test_the_prefilled_launchpad_config_leaves_sharding_yaml_unchanged(raw_root: Path, out_root: Path) -> None:
    settings_file = raw_root / "photos" / SETTINGS_NAME
    settings_file.write_text(FILE_A)
    with dagster_instance() as instance:
        defs = load_defs()
        # The operator opens the launchpad and changes num_workers only.
        result = launch(defs, instance, launchpad_config(defs, num_workers=1))
        assert result.success
        assert settings_file.read_text() == FILE_A
        assert built_with(out_root / "photos") == ShardingConfig(max_shard_size_mb=1, seed=7)
        assert materialized(result)["sample_set"]["settings_diff"] == {}

        # One setting changed in the launchpad: that key is written, every other key of the file kept.
        result = launch(defs, instance, launchpad_config(defs, num_workers=1, max_shard_size_mb=0.5))
        assert result.success
        assert yaml.safe_load(settings_file.read_text()) == {"max_shard_size_mb": 0.5, "seed": 7}
        assert built_with(out_root / "photos") == ShardingConfig(max_shard_size_mb=0.5, seed=7)
        assert materialized(result)["sample_set"]["settings_diff"] == {
            "max_shard_size_mb": {"was": 1, "in_file": True, "now": 0.5}}
        assert any("max_shard_size_mb: 1 -> 0.5" in m for m in log_messages(instance, result))

        # A bad value typed there is refused at once, by name, and the file is left as it is.
        written = settings_file.read_bytes()
        result = launch(defs, instance, launchpad_config(defs, num_workers=1, max_shard_size_mb=-1))
        assert not result.success and retried(result) == []
        assert "sharding setting max_shard_size_mb=-1 is invalid" in step_failure(result)[1]
        assert settings_file.read_bytes() == written


def test_materialize_on_twin_tar_shards_refuses_at_once_or_reshards_the_committed_samples(
        raw_root: Path, out_root: Path) -> None:
    out = out_root / "photos"
    with dagster_instance() as instance:
        defs = load_defs()
        config = launchpad_config(defs, num_workers=1)
        # Nothing built yet: alone, or with what follows it, the button fails at once and says what to select.
        for assets in (["twin_tar_shards"], ["twin_tar_shards", "key_indexes", "wdinfo_manifests"]):
            result = launch(defs, instance, config, assets)
            assert not result.success
            step, message = step_failure(result)
            assert step_node(step) == "twin_tar_shards" and "Select sample_set with it" in message, message
            assert retried(result) == []
            assert step_seconds(instance, result, "twin_tar_shards") < 5
        for asset in ("key_indexes", "wdinfo_manifests"):
            result = launch(defs, instance, config, [asset])
            assert not result.success and "Select sample_set and twin_tar_shards with it" in step_failure(result)[1]
            assert retried(result) == []
        assert not (out_root / ".photos.pid-staging").exists()  # nothing was staged

        assert launch(defs, instance, config).success
        published = tars(out)
        # After a build: twin_tar_shards and what follows re-shard the committed sample set.
        resharded = launch(defs, instance, launchpad_config(defs, num_workers=1, max_shard_size_mb=0.05),
                           ["twin_tar_shards", "key_indexes", "wdinfo_manifests"])
        assert resharded.success, step_failure(resharded)
        shown = materialized(resharded)
        assert shown["twin_tar_shards"]["sample_set"] == "committed"
        assert shown["wdinfo_manifests"]["state"] == "committed now"
        assert built_with(out).max_shard_size_mb == 0.05 and len(tars(out)) > len(published)

        # Alone: the re-shard is staged and checked; the published version stays until the manifests commit.
        alone = launch(defs, instance, launchpad_config(defs, num_workers=1, max_shard_size_mb=0.1), ["twin_tar_shards"])
        assert alone.success and all(e.passed for e in alone.get_asset_check_evaluations())
        assert built_with(out).max_shard_size_mb == 0.05
        assert launch(defs, instance, config, ["key_indexes", "wdinfo_manifests"]).success
        assert built_with(out).max_shard_size_mb == 0.1


def test_a_launchpad_reshard_and_sensor_ticks_make_one_build(raw_root: Path, out_root: Path) -> None:
    settings_file = raw_root / "photos" / SETTINGS_NAME
    with dg.instance_for_test() as instance:  # storage shared with the sensor's thread
        defs = load_defs()
        first = evaluate_sensor(defs, instance, None)
        apply_partition_requests(instance, first)
        [request] = first.run_requests
        assert daemon_run(defs, instance, request).success

        # The launchpad's run, launched and not started yet: a tick leaves the source to it.
        reshard = launchpad_config(defs, num_workers=1, max_shard_size_mb=0.25)
        queued = instance.create_run_for_job(defs.resolve_job_def("source_build"), run_config=reshard,
                                             tags={"dagster/partition": "photos"},
                                             status=dg.DagsterRunStatus.NOT_STARTED)
        assert evaluate_sensor(defs, instance, None).run_requests == []
        nightly = evaluate_schedule(defs, instance, dt.datetime(2026, 3, 2, 3, tzinfo=dt.UTC))
        assert isinstance(nightly, dg.SkipReason) and f"photos (run {queued.run_id})" in nightly.skip_message
        instance.report_run_canceled(queued)

        # The run writes sharding.yaml first; a tick while it still builds must not start a second build.
        ticks: list[tuple[bool, dg.SensorResult]] = []
        errors: list[BaseException] = []

        def tick_once_written() -> None:
            try:
                deadline = time.monotonic() + 300
                while not settings_file.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                running = bool(instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED])))
                ticks.append((running, evaluate_sensor(defs, instance, first.cursor)))
            except BaseException as exc:  # handed to the test's thread
                errors.append(exc)

        ticker = threading.Thread(target=tick_once_written, daemon=True)
        ticker.start()
        result = launch(defs, instance, reshard)
        ticker.join(timeout=300)
        assert result.success and errors == []
        [(running, during)] = ticks
        assert running and during.run_requests == []
        # Done: the committed build has these settings and files; neither the cursor nor a fresh
        # sensor asks for another.
        assert evaluate_sensor(defs, instance, during.cursor).run_requests == []
        assert evaluate_sensor(defs, instance, None).run_requests == []
        assert len(source_builds(instance)) == 2  # the sensor's first build and the re-shard
        assert built_with(out_root / "photos").max_shard_size_mb == 0.25


def test_settings_a_then_b_then_a_again_build_three_times(raw_root: Path, out_root: Path) -> None:
    settings_file = raw_root / "photos" / SETTINGS_NAME
    with dagster_instance() as instance:
        defs = load_defs()
        cursor, keys = None, []
        for content in (FILE_A, FILE_B, FILE_A):
            settings_file.write_text(content)
            tick = evaluate_sensor(defs, instance, cursor)
            apply_partition_requests(instance, tick)
            cursor = tick.cursor
            [request] = tick.run_requests
            # The daemon launches only a run key it has never seen.
            assert instance.get_runs(dg.RunsFilter(tags={"dagster/run_key": request.run_key})) == []
            assert daemon_run(defs, instance, request).success
            keys.append(request.run_key)
            assert evaluate_sensor(defs, instance, cursor).run_requests == []  # built: nothing redundant
        assert len(set(keys)) == 3
        assert [c["state"] for c in commits(instance)] == ["committed now"] * 3
        assert built_with(out_root / "photos") == ShardingConfig(max_shard_size_mb=1, seed=7)


def test_a_bad_settings_file_requests_a_run_that_fails_with_the_error(raw_root: Path, out_root: Path) -> None:
    settings_file = raw_root / "photos" / SETTINGS_NAME
    settings_file.write_text("max_shard_size: 3\n")
    with dagster_instance() as instance:
        defs = load_defs()
        first = evaluate_sensor(defs, instance, None)
        apply_partition_requests(instance, first)
        [request] = first.run_requests
        result = daemon_run(defs, instance, request)
        assert not result.success and retried(result) == []
        step, message = step_failure(result)
        assert step == "sample_set" and str(settings_file) in message and "max_shard_size" in message
        again = evaluate_sensor(defs, instance, first.cursor)
        assert again.run_requests == []  # the same broken file is not requested twice

        settings_file.write_text(FILE_B)
        [fixed] = evaluate_sensor(defs, instance, again.cursor).run_requests
        assert daemon_run(defs, instance, fixed).success


def test_builds_record_the_settings_version_and_observations_only_when_it_changes(
        raw_root: Path, out_root: Path) -> None:
    settings_file = raw_root / "photos" / SETTINGS_NAME
    settings_file.write_text(FILE_A)
    version_a = ShardingConfig(max_shard_size_mb=1, seed=7).version()
    with dagster_instance() as instance:
        defs = load_defs()
        first = evaluate_sensor(defs, instance, None)
        apply_partition_requests(instance, first)
        second = evaluate_sensor(defs, instance, first.cursor)
        settings_events = [e for e in second.asset_events if e.asset_key == dg.AssetKey("sharding_settings")]
        assert [(e.partition, e.tags["dagster/data_version"]) for e in settings_events] == [("photos", version_a)]
        for event in second.asset_events:
            instance.report_runless_asset_event(event)
        assert evaluate_sensor(defs, instance, second.cursor).asset_events == []  # unchanged: nothing recorded

        [request] = first.run_requests
        result = daemon_run(defs, instance, request)
        assert result.success and "sharding_settings" not in observed(result)
        for event in result.get_asset_materialization_events():
            if event.asset_key.to_user_string() in ("sample_set", "twin_tar_shards"):
                recorded = event.materialization.tags[SETTINGS_INPUT_TAG]
                assert recorded == version_a != hashlib.sha256(b"").hexdigest()

        # A launchpad re-shard records the new version once, as the build's input.
        result = launch(defs, instance, launchpad_config(defs, num_workers=1, max_shard_size_mb=0.25))
        version_b = ShardingConfig(max_shard_size_mb=0.25, seed=7).version()
        assert result.success and "sharding_settings" in observed(result)
        tags = {e.asset_key.to_user_string(): e.materialization.tags for e in result.get_asset_materialization_events()}
        assert tags["sample_set"][SETTINGS_INPUT_TAG] == tags["twin_tar_shards"][SETTINGS_INPUT_TAG] == version_b
        assert evaluate_sensor(defs, instance, second.cursor).asset_events == []


def test_only_transient_io_errors_are_left_to_the_retry_policy() -> None:
    from loader.io.s3_client import S3AccessError
    from pid_platform.defs.retries import is_transient, retry_only_transient

    assert all(is_transient(e) for e in (ConnectionResetError(), TimeoutError(), S3AccessError("503"), OSError(5, "EIO")))
    from pid_platform.sharding.errors import PlannedFileChangedError

    lasting = (FileNotFoundError("samples.parquet"), PermissionError("out"), ValueError("bad"), KeyError("x"),
               PlannedFileChangedError("image/a.jpg: the source changed after the plan"))  # an OSError too
    assert not any(is_transient(e) for e in lasting)
    for error in lasting:
        with pytest.raises(dg.Failure) as failure, retry_only_transient():
            raise error
        assert failure.value.allow_retries is False and str(error) in failure.value.description
    with pytest.raises(ConnectionResetError), retry_only_transient():
        raise ConnectionResetError("peer reset")  # as it is: the step's retry policy tries again
