"""Mixtures reach the loader on their own, as the daemon drives it: an edit of ``datasets.yaml``
is written into ``catalog.json`` by the next automation tick (after the definitions are
reloaded), the catalog follows each committed source while other builds are still queued, and
``datasets/<name>`` follow their sources and the catalog, re-running their ``sources_match``."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.test_utils import freeze_time
from dagster._time import get_current_datetime

from loader.formats.catalog import read_catalog
from loader.mixture import Mixture
from pid_platform.demo import pid_demo as demo
from pid_platform.demo.sample_data import make_sample_source
from pid_platform.demo.workspace_runs import open_workspace_runs
from tests.support.daemon_ticks import REPO, run_queued, tick_automation, workspace_context
from tests.support.dagster_runs import (
    build_catalog,
    build_source,
    dagster_instance,
    load_defs,
    use_roots,
)

CATALOG = dg.AssetKey("dataset_catalog")
BLEND = {"sources": {"photos": {"weight": 0.7}, "portraits": {"weight": 0.3}}, "samples_per_epoch": 50}
EDITED = {"sources": {"photos": {"weight": 0.5}, "portraits": {"weight": 0.5}}, "samples_per_epoch": 100}


@pytest.fixture
def definitions(tmp_path: Path, raw_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    make_sample_source(raw_root / "portraits", photos=("coffee",), ratios=((3, 4), (9, 16)), with_problems=False)
    use_roots(monkeypatch, raw_root, tmp_path / "out")
    path = tmp_path / "datasets.yaml"
    path.write_text(yaml.safe_dump({"blend": BLEND, "both": ["photos", "portraits"]}))
    monkeypatch.setenv("PID_DATASETS", str(path))
    return path


def _out() -> Path:
    import os

    return Path(os.environ["PID_OUTPUT_ROOT"])


def test_an_edited_datasets_yaml_reaches_catalog_json_with_the_next_automation_run(
        definitions: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found on the second day: the UI showed datasets/blend with the new shares while catalog.json,
    which the loader reads, kept the old mixture until a manifest changed or 03:30."""
    monkeypatch.setenv("DAGSTER_HOME", str(demo.prepare_home(tmp_path / "home")))
    with dg.DagsterInstance.get() as instance:
        with open_workspace_runs(instance, REPO / "workspace.yaml") as runs:
            instance.add_dynamic_partitions("sources", ["photos", "portraits"])
            for source in ("photos", "portraits"):
                assert runs.run("source_build", partition_key=source, run_config=demo.QUIET).success
            assert runs.run("catalog_build", run_config=demo.QUIET).success
        now = get_current_datetime()
        with workspace_context(instance) as context, freeze_time(now):
            tick_automation(context)
        for run in run_queued(instance):  # the datasets' first evaluation, if any
            assert run.status == dg.DagsterRunStatus.SUCCESS
        before = {r.run_id for r in instance.get_runs()}
        with workspace_context(instance) as context, freeze_time(now + dt.timedelta(seconds=31)):
            tick_automation(context)  # nothing changed: nothing requested
        assert {r.run_id for r in instance.get_runs()} == before
        assert read_catalog(_out()).mixture("blend") == Mixture.from_json("blend", BLEND)

        definitions.write_text(yaml.safe_dump({"blend": EDITED, "both": ["photos", "portraits"]}))
        # Reload definitions (the UI's button; the daemon reloads its workspace too), then its next tick.
        with workspace_context(instance) as context, freeze_time(now + dt.timedelta(seconds=62)):
            tick_automation(context)
        requested = [r for r in instance.get_runs() if r.run_id not in before]
        assert len(requested) == 1 and CATALOG in requested[0].asset_selection
        assert requested[0].tags["pid/launched_by"] == "automation"
        (run,) = run_queued(instance)
        assert run.status == dg.DagsterRunStatus.SUCCESS
        assert read_catalog(_out()).mixture("blend") == Mixture.from_json("blend", EDITED)

        with workspace_context(instance) as context, freeze_time(now + dt.timedelta(seconds=93)):
            tick_automation(context)  # handled: not requested again
        assert len(instance.get_runs()) == len(before) + 1


def test_the_catalog_follows_a_commit_while_other_builds_are_queued(definitions: Path) -> None:
    """Found on the second day: 40 new sources dropped at once, the first committed at 04:43, the
    catalog listed it at 05:08, after the whole queue: eager() waits while any dependency is in
    progress. A queued build of one source now holds back no other source's catalog entry."""
    with dagster_instance() as instance:
        defs = load_defs()
        assert build_source(defs, instance, "photos").success and build_catalog(defs, instance).success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        instance.add_dynamic_partitions("sources", ["portraits"])
        # A build of portraits launched and not started yet (waiting in the run queue, say).
        queued = instance.create_run_for_job(defs.resolve_job_def("source_build"),
                                             tags={"dagster/partition": "portraits"},
                                             status=dg.DagsterRunStatus.NOT_STARTED)
        assert build_source(defs, instance, "photos", shard_size=2).success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(CATALOG) == 1
        assert instance.get_run_by_id(queued.run_id).status == dg.DagsterRunStatus.NOT_STARTED


def test_a_commit_while_the_catalog_run_works_is_not_lost(definitions: Path) -> None:
    """The catalog's run may scan the sources before a commit that lands while it works: the
    commit must still bring a catalog run after it (eager() forgot it once the run ended)."""
    with dagster_instance() as instance:
        defs = load_defs()
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        assert build_source(defs, instance, "photos").success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(CATALOG) == 1
        # The requested catalog run, launched and working...
        working = instance.create_run_for_job(defs.resolve_job_def("catalog_build"),
                                              status=dg.DagsterRunStatus.STARTED)
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(CATALOG) == 0
        # ... while portraits commits; then the run ends (its catalog written).
        assert build_source(defs, instance, "portraits").success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(CATALOG) == 0  # not while its run works
        assert build_catalog(defs, instance).success
        instance.report_run_canceled(working)
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(CATALOG) == 1
        assert build_catalog(defs, instance).success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(CATALOG) == 0  # handled


def test_dataset_assets_follow_their_sources_and_rerun_their_check(definitions: Path) -> None:
    """Found on the second day: after every build datasets/<name> read stale, had no automation
    condition, and their sources_match check was never re-run. Now a rebuild of a source requests
    the catalog and the datasets that read it; a dataset naming a source not built yet is
    requested too (its check fails naming the source) without holding back the catalog."""
    keys = {n: dg.AssetKey(["datasets", n]) for n in ("blend", "both", "later")}
    definitions.write_text(yaml.safe_dump({"blend": BLEND, "both": ["photos", "portraits"],
                                           "later": {"sources": {"photos": {"weight": 1}, "web": {"weight": 1}}}}))
    with dagster_instance() as instance:
        defs = load_defs()
        for key in keys.values():
            assert defs.resolve_assets_def(key).specs_by_key[key].automation_condition is not None
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)  # the first evaluation
        assert build_source(defs, instance, "photos").success and build_source(defs, instance, "portraits").success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(CATALOG) == 1
        assert build_catalog(defs, instance).success
        # The catalog's blocking check passed: the datasets follow it.
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert {n for n, k in keys.items() if tick.get_num_requested(k)} == {"blend", "both", "later"}
        job = defs.resolve_implicit_global_asset_job_def()
        result = job.execute_in_process(instance=instance, asset_selection=list(keys.values()), raise_on_error=False)
        checks = {e.asset_key.to_user_string(): e.passed for e in result.get_asset_check_evaluations()
                  if e.check_name == "sources_match"}
        assert checks == {"datasets/blend": True, "datasets/both": True, "datasets/later": False}
        assert sorted(read_catalog(_out()).sources) == ["photos", "portraits"]  # 'later' held back no source
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(CATALOG) == 0 and not any(tick.get_num_requested(k) for k in keys.values())

        # A re-shard of portraits: the catalog and the datasets reading portraits follow, and
        # their checks run again.
        assert build_source(defs, instance, "portraits", shard_size=2).success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(CATALOG) == 1
        assert {n for n, k in keys.items() if tick.get_num_requested(k)} == {"blend", "both", "later"}
