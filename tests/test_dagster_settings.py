"""Re-sharding as lineage: each source's settings in its ``sharding.yaml``, read by runs, the
sensor and the daily schedule; a launchpad override is written there; a change shows the
source's assets stale and rebuilds exactly that source."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._time import get_current_datetime

from pid_platform.defs.resources import ShardingResource
from pid_platform.demo.sample_data import make_sample_source
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.settings import SETTINGS_NAME
from tests.support.dagster_runs import (
    apply_partition_requests,
    build_source,
    dagster_instance,
    evaluate_schedule,
    evaluate_sensor,
    load_defs,
    materialized,
    use_roots,
)

DEFAULT = ShardingResource().config()
RESHARDED = ShardingConfig(**{**DEFAULT.__dict__, "max_shard_size_mb": 0.25, "classify_aspect_ratio": False})


@pytest.fixture
def roots(tmp_path: Path, raw_root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    make_sample_source(raw_root / "portraits", photos=("coffee",), ratios=((3, 4), (9, 16)), with_problems=False)
    use_roots(monkeypatch, raw_root, tmp_path / "out")
    return raw_root, tmp_path / "out"


def run(defs: dg.Definitions, instance: dg.DagsterInstance, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
    """What the daemon launches for a request: the job, the partition, the tags, no run config."""
    result = build_source(defs, instance, request.partition_key, tags={**request.tags, "dagster/run_key": request.run_key})
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    return result


def built_with(out: Path, source: str) -> ShardingConfig:
    return ShardingConfig(**json.loads((out / source / ".pid-build" / "sharding.json").read_bytes()))


def record(instance: dg.DagsterInstance, result: dg.SensorResult) -> None:
    """What the daemon does with the sensor's observations."""
    for event in result.asset_events:
        instance.report_runless_asset_event(event)


def stale(defs: dg.Definitions, instance: dg.DagsterInstance, asset: str, source: str) -> bool:
    """Whether the UI shows ``asset``'s partition ``source`` stale (the resolver the UI uses)."""
    graph = defs.resolve_asset_graph()
    view = AssetGraphView(temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
                          instance=instance, asset_graph=graph)
    resolver = CachingStaleStatusResolver(instance, graph, view)
    return resolver.get_status(dg.AssetKey(asset), source) == StaleStatus.STALE


def test_a_reshard_in_the_settings_file_rebuilds_that_source_only_and_shows_it_stale(roots) -> None:
    raw, out = roots
    with dagster_instance() as instance:
        defs = load_defs()
        first = evaluate_sensor(defs, instance, None)
        assert apply_partition_requests(instance, first) == ["photos", "portraits"]
        second = evaluate_sensor(defs, instance, first.cursor)
        assert second.run_requests == []
        record(instance, second)  # both sources known now: their settings are observed
        for request in first.run_requests:
            run(defs, instance, request)
        assert built_with(out, "photos") == DEFAULT
        assert not stale(defs, instance, "sample_set", "photos")

        (raw / "photos" / SETTINGS_NAME).write_text("max_shard_size_mb: 0.25\nclassify_aspect_ratio: false\n")
        third = evaluate_sensor(defs, instance, second.cursor)
        assert [r.partition_key for r in third.run_requests] == ["photos"]  # that source only
        [request] = third.run_requests
        assert RESHARDED.version() in request.run_key and request.tags["pid/config_version"] == RESHARDED.version()
        assert request.tags["pid/settings_file"] == str(raw / "photos" / SETTINGS_NAME)
        record(instance, third)
        # Recorded only where the version changed.
        assert {(e.partition, e.tags["dagster/data_version"]) for e in third.asset_events} == {
            ("photos", RESHARDED.version())}
        # The UI shows the re-sharded source's assets stale, and only that source's.
        assert stale(defs, instance, "sample_set", "photos") and stale(defs, instance, "twin_tar_shards", "photos")
        assert not stale(defs, instance, "sample_set", "portraits")

        previous = sorted(p.relative_to(out) for p in (out / "photos").rglob("wdinfo.json"))
        result = run(defs, instance, request)
        assert built_with(out, "photos") == RESHARDED and built_with(out, "portraits") == DEFAULT
        assert materialized(result)["twin_tar_shards"]["config_version"] == RESHARDED.version()
        assert len(previous) == 8 and [p.name for p in (out / "photos").rglob("wdinfo.json")] == ["wdinfo.json"]
        assert not stale(defs, instance, "sample_set", "photos")
        assert evaluate_sensor(defs, instance, third.cursor).run_requests == []


def test_the_daily_schedule_builds_each_source_with_its_own_settings(roots) -> None:
    raw, out = roots
    (raw / "photos" / SETTINGS_NAME).write_text("max_shard_size_mb: 0.25\nclassify_aspect_ratio: false\n")
    with dg.instance_for_test() as instance:  # a schedule context needs an instance ref
        defs = load_defs()
        apply_partition_requests(instance, evaluate_sensor(defs, instance, None))
        when = dt.datetime(2026, 3, 2, 3, tzinfo=dt.UTC)
        requests = evaluate_schedule(defs, instance, when)
        assert [(r.partition_key, r.run_key.split(":")[:4]) for r in requests] == [
            ("photos", ["daily", "2026-03-02", "photos", RESHARDED.version()]),
            ("portraits", ["daily", "2026-03-02", "portraits", DEFAULT.version()]),
        ]
        for request in requests:
            run(defs, instance, request)
    # A nightly run never cuts a re-sharded source back to the defaults.
    assert built_with(out, "photos") == RESHARDED and built_with(out, "portraits") == DEFAULT


def test_a_launchpad_override_is_written_to_the_settings_file_and_kept(roots) -> None:
    raw, out = roots
    with dg.instance_for_test() as instance:
        defs = load_defs()
        apply_partition_requests(instance, evaluate_sensor(defs, instance, None))
        # The launchpad: sharding config set for one run of photos.
        result = build_source(defs, instance, "photos", max_shard_size_mb=0.25, classify_aspect_ratio=False)
        assert result.success
        assert (raw / "photos" / SETTINGS_NAME).read_text().endswith(
            "classify_aspect_ratio: false\nmax_shard_size_mb: 0.25\n")
        assert materialized(result)["sample_set"]["settings_file"] == str(raw / "photos" / SETTINGS_NAME)
        assert not (raw / "portraits" / SETTINGS_NAME).exists()

        # The next run without the override, the schedule and the sensor all keep it: the sensor
        # finds photos' committed build current and asks only for portraits, never built.
        [request, _] = evaluate_schedule(defs, instance, dt.datetime(2026, 3, 3, 3, tzinfo=dt.UTC))
        assert request.partition_key == "photos" and RESHARDED.version() in request.run_key
        run(defs, instance, request)
        assert built_with(out, "photos") == RESHARDED
        sensed = evaluate_sensor(defs, instance, None)
        assert {r.partition_key: r.tags["pid/config_version"] for r in sensed.run_requests} == {
            "portraits": DEFAULT.version()}


def test_a_bad_settings_file_fails_the_run_naming_the_file(roots) -> None:
    raw, _ = roots
    (raw / "photos" / SETTINGS_NAME).write_text("max_shard_size: 3\n")
    with dagster_instance() as instance:
        defs = load_defs()
        result = build_source(defs, instance, "photos")
        assert not result.success
        failure = next(e for e in result.all_events if e.is_step_failure)
        message = failure.step_failure_data.error.message
        assert str(raw / "photos" / SETTINGS_NAME) in message and "unknown settings ['max_shard_size']" in message
