"""Logical datasets in Dagster: one asset each (``datasets/<name>``), defined in the file that
``PID_DATASETS`` names, downstream of exactly its sources' manifests; its metadata shows each
source's share, samples per epoch and repeats (table and plot); its blocking check fails when
a source is missing or the modalities do not fit. ``dataset_catalog`` writes the definitions into
``catalog.json``, where the loader resolves the name to the same mixture."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._time import get_current_datetime

from loader.formats.catalog import read_catalog
from loader.mixture import Mixture
from pid_platform.demo.sample_data import make_sample_source
from tests.support.daemon_ticks import remote_schedules, sensor_is_running, workspace_context
from tests.support.dagster_runs import (
    build_catalog,
    build_source,
    dagster_instance,
    load_defs,
    materialized,
    run_config,
    use_roots,
)

BLEND = {"sources": {"photos": {"weight": 0.7}, "portraits": {"weight": 0.3}}, "samples_per_epoch": 50}
DEFINITIONS = {
    "blend": BLEND,
    "ghostly": {"sources": {"photos": {"weight": 1}, "ghost": {"weight": 1}}},
    "deep": {"sources": {"photos": {"repeat": 2}, "portraits": {"choose": 1}}, "modalities": ["image", "depth"]},
    "both": ["photos", "portraits"],
}


@pytest.fixture
def roots(tmp_path: Path, raw_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    make_sample_source(raw_root / "portraits", photos=("coffee",), ratios=((3, 4), (9, 16)), with_problems=False)
    use_roots(monkeypatch, raw_root, tmp_path / "out")
    path = tmp_path / "datasets.yaml"
    path.write_text(yaml.safe_dump(DEFINITIONS))
    monkeypatch.setenv("PID_DATASETS", str(path))
    return tmp_path / "out"


def _key(name: str) -> dg.AssetKey:
    return dg.AssetKey(["datasets", name])


def _materialize(defs, instance, names, **sharding) -> dg.ExecuteInProcessResult:
    job = defs.resolve_implicit_global_asset_job_def()
    return job.execute_in_process(instance=instance, asset_selection=[_key(n) for n in names],
                                  run_config=run_config(**sharding), raise_on_error=False)


def _stale(defs, instance, key: dg.AssetKey) -> bool:
    graph = defs.resolve_asset_graph()
    view = AssetGraphView(temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
                          instance=instance, asset_graph=graph)
    return CachingStaleStatusResolver(instance, graph, view).get_status(key) == StaleStatus.STALE


def test_a_dataset_asset_per_definition_downstream_of_its_sources(roots: Path) -> None:
    with dagster_instance() as instance:
        defs = load_defs()
        graph = defs.resolve_asset_graph()
        for name in DEFINITIONS:
            node = graph.get(_key(name))
            assert {k.to_user_string() for k in node.parent_keys} == {"wdinfo_manifests", "dataset_catalog"}
            assert [c.name for c in node.check_keys] == ["sources_match"]
            assert graph.get_check_spec(next(iter(node.check_keys))).blocking
        mapping = defs.resolve_assets_def(_key("blend")).get_partition_mapping(dg.AssetKey("wdinfo_manifests"))
        assert isinstance(mapping, dg.SpecificPartitionsPartitionMapping)
        assert sorted(mapping.partition_keys) == ["photos", "portraits"]  # which sources feed it

        assert build_source(defs, instance, "photos").success and build_source(defs, instance, "portraits").success
        # The catalog is written whatever one dataset says: every built source, the datasets that
        # fit them; 'ghostly' (a source not built yet) and 'deep' (a modality missing) are left out.
        catalog_run = build_catalog(defs, instance)
        assert catalog_run.success
        written = read_catalog(roots)
        assert sorted(written.sources) == ["photos", "portraits"]
        assert sorted(written.datasets) == ["all", "blend", "both"]
        assert written.mixture("blend") == Mixture.from_json("blend", BLEND)
        left_out = materialized(catalog_run)["dataset_catalog"]["datasets_left_out"]
        assert sorted(left_out) == ["deep", "ghostly"] and "source 'ghost'" in left_out["ghostly"]

        result = _materialize(defs, instance, ["blend", "both", "ghostly", "deep"])
        meta = materialized(result)
        blend = meta["datasets/blend"]
        assert blend["samples_per_epoch"] == 50
        rows = {r.data["source"]: r.data for r in blend["shares"].records}
        assert {s: (r["samples_per_epoch"], r["share"]) for s, r in rows.items()} == {
            "photos": (35, 0.7), "portraits": (15, 0.3)}
        assert rows["photos"]["samples"] == 32 and rows["photos"]["repeats"] == round(35 / 32, 4)
        assert rows["photos"]["setting"] == "weight=0.7"
        # The plot carries each source's repeat factor (on its bar, and in its alt text).
        repeats = ", ".join(f"{s} x{rows[s]['repeats']:g}" for s in ("photos", "portraits"))
        assert blend["shares_plot"].startswith(f"![blend shares ({repeats})](data:image/png;base64,"), \
            blend["shares_plot"][:80]
        both = {r.data["source"]: r.data for r in meta["datasets/both"]["shares"].records}
        assert both["photos"]["repeats"] == 1.0 and both["portraits"]["repeats"] == 1.0
        per_asset = {e.asset_key.path[-1]: e for e in result.get_asset_check_evaluations()}
        assert per_asset["blend"].passed and per_asset["both"].passed
        assert not per_asset["ghostly"].passed and not per_asset["deep"].passed
        ghost = per_asset["ghostly"].metadata["problems"].value
        assert ghost == ["dataset 'ghostly', source 'ghost': not built under the output root (built: "
                         "['photos', 'portraits']); build it first or fix the name"]
        deep = per_asset["deep"].metadata["problems"].value
        assert len(deep) == 1 and "source 'photos'" in deep[0] and "lacks modalities ['depth']" in deep[0]
        assert not result.success  # the blocking checks failed the run

        # The launchpad's sharding.datasets redefine them for a run: then they fit, and are written.
        ok = build_catalog(defs, instance, datasets={"ghostly": ["photos"], "deep": ["portraits"]})
        assert ok.success and materialized(ok)["dataset_catalog"]["datasets_left_out"] == {}
        assert sorted(read_catalog(roots).datasets) == ["all", "blend", "both", "deep", "ghostly"]
        assert read_catalog(roots).mixture("blend") == Mixture.from_json("blend", BLEND)

        # A re-shard of a source marks the datasets it feeds stale.
        assert _stale(defs, instance, _key("blend"))  # the catalog it reads through changed
        assert _materialize(defs, instance, ["blend"]).success
        assert not _stale(defs, instance, _key("blend"))
        assert build_source(defs, instance, "portraits", shard_size=2).success
        assert _stale(defs, instance, _key("blend"))


def test_without_definitions_there_are_no_dataset_assets(out_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PID_DATASETS", raising=False)
    with dagster_instance():
        keys = load_defs().resolve_asset_graph().get_all_asset_keys()
    assert not [k for k in keys if k.path[0] == "datasets"]


def test_the_strict_reader_names_the_file_the_dataset_and_the_key(tmp_path: Path) -> None:
    from pid_platform.defs.datasets.definitions import dataset_definitions

    bad = tmp_path / "datasets.yaml"
    bad.write_text(yaml.safe_dump({"blend": {"sources": {"photos": {"weight": -1}}}}))
    with pytest.raises(ValueError) as exc:
        dataset_definitions({"PID_DATASETS": str(bad)})
    assert str(bad) in str(exc.value) and "dataset 'blend', source 'photos'" in str(exc.value)
    bad.write_text(yaml.safe_dump({"a b": ["photos"]}))
    with pytest.raises(ValueError, match="dataset name 'a b'"):
        dataset_definitions({"PID_DATASETS": str(bad)})


def _loaded_and_running(names: set[str]) -> set[str]:
    """The code location loaded as the daemon loads it (a sqlite instance: the workspace wants
    one it can share with a code server); of ``names``, the sensors running there. The daily
    schedule must be there too."""
    with dg.instance_for_test() as instance, workspace_context(instance) as context:
        assert "daily_source_rebuild" in {s.name for s in remote_schedules(context)}
        return {n for n in names if sensor_is_running(context, n)}


def test_a_bad_datasets_yaml_keeps_the_code_location_and_shows_its_error_on_the_datasets(
        roots: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo in datasets.yaml once unloaded the code location: every sensor, the schedule and the
    run-failure alert stopped, and the cause was screens down a stack trace. Now the location
    loads as the daemon loads it; a bad entry's asset shows its error (file, dataset, key), a file
    that cannot be read at all shows it on the catalog's dataset_definitions_read check, and the
    catalog goes on listing every built source with the datasets it had."""
    path = roots.parent / "datasets.yaml"
    sensors = {"raw_sources_sensor", "run_failure_alert_sensor", "follow_upstream_sensor"}
    with dagster_instance() as instance:
        defs = load_defs()
        assert build_source(defs, instance, "photos").success and build_source(defs, instance, "portraits").success
        assert build_catalog(defs, instance).success  # blend and both, as defined

        # One entry wrong: a negative weight.
        path.write_text(yaml.safe_dump({**DEFINITIONS, "blend": {"sources": {"photos": {"weight": -1}}}}))
        assert _loaded_and_running(sensors) == sensors
        defs = load_defs()
        description = defs.resolve_assets_def(_key("blend")).specs_by_key[_key("blend")].description
        assert str(path) in description and "dataset 'blend', source 'photos'" in description
        failed = _materialize(defs, instance, ["blend"])
        (check,) = failed.get_asset_check_evaluations()
        (problem,) = check.metadata["problems"].value
        assert not check.passed and str(path) in problem and "dataset 'blend', source 'photos'" in problem
        catalog_run = build_catalog(defs, instance)
        assert catalog_run.success  # the catalog keeps blend as it was, and says why
        kept = materialized(catalog_run)["dataset_catalog"]["datasets_kept"]
        assert sorted(kept) == ["blend"] and "weight" in kept["blend"]
        assert read_catalog(roots).mixture("blend") == Mixture.from_json("blend", BLEND)
        read = {e.check_name: e for e in catalog_run.get_asset_check_evaluations()}["dataset_definitions_read"]
        (problem,) = read.metadata["problems"].value
        assert not read.passed and problem == check.metadata["problems"].value[0]

        # The file cannot be read at all (a key written twice): still loaded, every sensor running.
        path.write_text("both: [photos]\nblend:\n  sources: {photos: {weight: 1}}\n  samples_per_epoch: 1\n"
                        "  samples_per_epoch: 2\n")
        assert _loaded_and_running(sensors) == sensors
        defs = load_defs()
        catalog_run = build_catalog(defs, instance)
        assert catalog_run.success
        written = read_catalog(roots)
        assert sorted(written.sources) == ["photos", "portraits"]
        assert sorted(written.datasets) == ["all", "blend", "both"]  # the datasets it had
        assert written.mixture("blend") == Mixture.from_json("blend", BLEND)
        assert not [k for k in defs.resolve_asset_graph().get_all_asset_keys() if k.path[0] == "datasets"]
        read = {e.check_name: e for e in catalog_run.get_asset_check_evaluations()}["dataset_definitions_read"]
        (problem,) = read.metadata["problems"].value
        assert not read.passed and str(path) in problem and "blend.samples_per_epoch is written twice" in problem


def test_with_a_bad_datasets_yaml_the_daemon_still_ticks_the_sensors_and_raises_the_alert(
        roots: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Found on the second day: a typo in datasets.yaml silenced raw-source discovery and alerting.
    The daemon's own sensor iterations, on a real instance with the checked-in run queue: with a
    datasets.yaml that does not parse, the discovery sensor still requests a build of each source,
    and a run that fails raises the alert on the next tick."""
    import datetime as dt
    import logging

    from dagster._core.test_utils import freeze_time
    from dagster._daemon.sensor import execute_sensor_iteration

    (roots.parent / "datasets.yaml").write_text("blend: {sources: [photos\n")  # never closed
    queue = {"run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"}}
    with dg.instance_for_test(overrides=queue) as instance, workspace_context(instance) as context:
        with context.create_request_context() as request:
            (entry,) = request.get_code_location_entries().values()
            assert entry.load_error is None

        def tick(at: dt.datetime) -> None:
            with freeze_time(at):
                list(execute_sensor_iteration(context, logging.getLogger("sensor_daemon"), None, None))

        now = get_current_datetime()
        tick(now)
        builds = instance.get_runs(dg.RunsFilter(job_name="source_build"))
        assert sorted(r.tags["dagster/partition"] for r in builds) == ["photos", "portraits"]
        assert all(r.status == dg.DagsterRunStatus.QUEUED for r in builds)

        failed = builds[0]
        instance.report_run_failed(failed)
        with caplog.at_level(logging.ERROR, logger="pid_platform.alerts"):
            tick(now + dt.timedelta(seconds=61))
        alerts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ALERT")]
        assert alerts and alerts[0].startswith(f"ALERT Dagster run {failed.run_id[:8]} of source_build failed"), alerts
