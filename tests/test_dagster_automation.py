"""The sensor -> partition -> run flow, the daily schedule and the catalog sensor, on a real
temporary instance; the requested runs are executed for real."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import dagster as dg

from pid_platform.defs.partitions import SOURCES
from pid_platform.defs.resources import ShardingResource, source_store_from_env
from pid_platform.demo.sample_data import make_sample_source
from tests.support.build_data import reverse_members_in_place
from tests.support.dagster_runs import (
    apply_partition_requests,
    build_catalog,
    build_source,
    dagster_instance,
    evaluate_schedule,
    evaluate_sensor,
    load_defs,
    manifests,
    run_config,
)


def _small_source(root: Path) -> Path:
    return make_sample_source(root, photos=("coffee",), ratios=((3, 4), (9, 16)), with_problems=False)


def _run(defs: dg.Definitions, instance: dg.DagsterInstance, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
    return build_source(defs, instance, request.partition_key, tags={**request.tags, "dagster/run_key": request.run_key})


def test_sensor_registers_sources_and_builds_each_once(raw_root: Path, out_root: Path) -> None:
    _small_source(raw_root / "portraits")
    with dagster_instance() as instance:
        defs = load_defs()
        first = evaluate_sensor(defs, instance, None)
        assert apply_partition_requests(instance, first) == ["photos", "portraits"]
        assert [r.partition_key for r in first.run_requests] == ["photos", "portraits"]
        version = ShardingResource().config().version()
        assert all(version in r.run_key for r in first.run_requests)

        for request in first.run_requests:
            result = _run(defs, instance, request)
            assert result.success and all(e.passed for e in result.get_asset_check_evaluations())
        assert sum(m["total_key_count"] for m in manifests(out_root / "photos").values()) == 32
        assert sum(m["total_key_count"] for m in manifests(out_root / "portraits").values()) == 2
        runs = instance.get_runs(dg.RunsFilter(tags={"dagster/run_key": first.run_requests[0].run_key}))
        assert len(runs) == 1 and runs[0].tags["dagster/partition"] == "photos"

        # Nothing changed: nothing to do.
        idle = evaluate_sensor(defs, instance, first.cursor)
        assert idle.run_requests == [] and not idle.dynamic_partitions_requests

        # A third source: one new partition, one new run; the others are left alone.
        _small_source(raw_root / "landscapes")
        third = evaluate_sensor(defs, instance, idle.cursor)
        assert apply_partition_requests(instance, third) == ["landscapes"]
        assert [r.partition_key for r in third.run_requests] == ["landscapes"]
        assert _run(defs, instance, third.run_requests[0]).success
        assert sorted(instance.get_dynamic_partitions(SOURCES)) == ["landscapes", "photos", "portraits"]

        # A changed file changes that source's run key (a reused key would be dropped forever).
        caption = raw_root / "portraits" / "caption" / "coffee-3x4.json"
        caption.write_text(json.dumps({"prompt": "A cup of coffee, seen from above."}))
        changed = evaluate_sensor(defs, instance, third.cursor)
        assert [r.partition_key for r in changed.run_requests] == ["portraits"]
        assert changed.run_requests[0].run_key != first.run_requests[1].run_key

        # A new sharding config asks for every source again, under new keys.
        resharded = evaluate_sensor(
            defs, instance, changed.cursor,
            source_store=source_store_from_env(), sharding=ShardingResource(max_shard_size_mb=1.0),
        )
        assert [r.partition_key for r in resharded.run_requests] == ["landscapes", "photos", "portraits"]
        old_keys = {r.run_key for r in first.run_requests + third.run_requests + changed.run_requests}
        assert not old_keys & {r.run_key for r in resharded.run_requests}


def test_sensor_skips_sources_it_cannot_build_yet(raw_root: Path, out_root: Path) -> None:
    (raw_root / "incoming" / "image").mkdir(parents=True)  # no files yet: wait for them
    _small_source(raw_root / "odd...name")  # not a valid partition key: skipped, not fatal
    with dagster_instance() as instance:
        result = evaluate_sensor(load_defs(), instance, None)
        assert [r.partition_key for r in result.run_requests] == ["photos"]
        assert apply_partition_requests(instance, result) == ["photos"]


def test_daily_schedule_requests_every_registered_source(raw_root: Path, out_root: Path) -> None:
    with dg.instance_for_test() as instance:  # a schedule context needs an instance ref
        defs = load_defs()
        schedule = defs.resolve_schedule_def("daily_source_rebuild")
        when = dt.datetime(2026, 3, 1, 3, tzinfo=dt.UTC)
        empty = evaluate_schedule(defs, instance, when)
        assert isinstance(empty, dg.SkipReason)

        instance.add_dynamic_partitions(SOURCES, ["photos", "portraits"])
        requests = evaluate_schedule(defs, instance, when)
        version = ShardingResource().config().version()  # photos has no sharding.yaml: the defaults
        # portraits has no folder: requested all the same, so its run shows the error.
        # Keys: day, source, settings version, files' fingerprint, the last commit's event (none yet).
        [photos, portraits] = requests
        assert photos.partition_key == "photos" and photos.run_key.startswith(f"daily:2026-03-01:photos:{version}:")
        assert photos.run_key.endswith(":after-0")
        assert (portraits.partition_key, portraits.run_key) == (
            "portraits", "daily:2026-03-01:portraits:unreadable:unreadable:after-0")
        assert schedule.job_name == "source_build" and schedule.cron_schedule == "0 3 * * *"


def test_derived_assets_follow_their_upstream_unless_its_checks_failed(raw_root: Path, out_root: Path) -> None:
    """The automation conditions of key indexes, manifests and catalog, evaluated as the daemon does."""
    followers = [dg.AssetKey(k) for k in ("key_indexes", "wdinfo_manifests", "dataset_catalog")]
    shards_only = [dg.AssetKey("sample_set"), dg.AssetKey("twin_tar_shards")]

    def requested(result) -> dict[str, list]:
        return {k.to_user_string(): sorted(result.get_requested_partitions(k)) for k in followers
                if result.get_num_requested(k)}

    with dagster_instance() as instance:
        defs = load_defs()
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        assert build_source(defs, instance, "photos").success
        # A whole source build updated the source's assets together: only the catalog follows.
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert requested(tick) == {"dataset_catalog": [None]}
        assert build_catalog(defs, instance).success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert requested(tick) == {}

        # twin_tar_shards re-cut alone (say, from the UI) with passing checks: the key index and
        # the manifests (the commit) follow, in one request.
        staged = defs.resolve_job_def("source_build").execute_in_process(
            instance=instance, partition_key="photos", run_config=run_config(shard_size=2),
            asset_selection=shards_only)
        assert staged.success and all(e.passed for e in staged.get_asset_check_evaluations())
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert requested(tick) == {"key_indexes": ["photos"], "wdinfo_manifests": ["photos"]}

        # The stage damaged in place, twin_tar_shards again: its blocking check fails, and
        # nothing follows, so the damaged stage is never committed.
        reverse_members_in_place(out_root / ".photos.pid-staging" / "aspect_ratio_1_1" / "caption" / "part_000000"
                                 / "000000.tar")
        failed = defs.resolve_job_def("source_build").execute_in_process(
            instance=instance, partition_key="photos", run_config=run_config(shard_size=2),
            asset_selection=[dg.AssetKey("twin_tar_shards")], raise_on_error=False)
        assert {e.check_name: e.passed for e in failed.get_asset_check_evaluations()}["twin_tar_keys_match"] is False
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert requested(tick) == {}


def test_the_catalog_follows_a_build_while_another_registered_source_is_not_built(
        raw_root: Path, out_root: Path) -> None:
    """A new source folder (registered, never built, or its build failed) must not stop the catalog
    from following every other source: found by the browser test, where it never did."""
    catalog = dg.AssetKey("dataset_catalog")
    with dagster_instance() as instance:
        defs = load_defs()
        instance.add_dynamic_partitions("sources", ["photos", "unbuilt"])
        assert build_source(defs, instance, "photos").success and build_catalog(defs, instance).success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        assert tick.get_num_requested(catalog) == 0  # nothing new since the catalog
        assert build_source(defs, instance, "photos", shard_size=2).success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(catalog) == 1


def test_the_catalog_is_rewritten_every_night_after_the_daily_rebuild(raw_root: Path, out_root: Path) -> None:
    """Even with no source changed: its last materialization is what its freshness policy watches."""
    with dagster_instance() as instance:
        defs = load_defs()
        assert build_source(defs, instance, "photos").success and build_catalog(defs, instance).success
        evening = dt.datetime(2026, 3, 1, 20, tzinfo=dt.UTC)
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, evaluation_time=evening)
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor,
                                                 evaluation_time=evening + dt.timedelta(hours=7))
        assert tick.get_num_requested(dg.AssetKey("dataset_catalog")) == 0  # 03:00: not yet
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor,
                                                 evaluation_time=evening + dt.timedelta(hours=7, minutes=31))
        assert tick.get_num_requested(dg.AssetKey("dataset_catalog")) == 1  # 03:31: the nightly rewrite
        assert tick.get_num_requested(dg.AssetKey("key_indexes")) == 0  # nothing else follows the clock
