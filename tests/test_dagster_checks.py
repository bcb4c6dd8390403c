"""Checks that stay true and the ones an operator expects: after a no-op rebuild every check of an
unchanged source reads passed (re-asserted on the committed version, as the UI reads the
instance) and a damaged served version reads failed; a source that lost many samples is flagged;
a lost key index fails its check; a source built after the catalog shows the catalog's check
failing until the catalog is rebuilt."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from pid_platform.demo.sample_data import make_sample_source
from tests.support.dagster_runs import (
    build_catalog,
    build_source,
    check_metadata,
    check_outcomes,
    dagster_instance,
    load_defs,
    materialized,
    skipped_steps,
)

SOURCE_CHECKS = {
    "sample_set": ["dropped_fraction_within_bound"],
    "twin_tar_shards": ["shards_within_size_bound", "twin_tar_keys_match"],
    "key_indexes": ["key_indexes_match_tars"],
    "wdinfo_manifests": ["manifest_counts_match_tars"],
}
CHECK_KEYS = [dg.AssetCheckKey(dg.AssetKey(a), n) for a, names in SOURCE_CHECKS.items() for n in names]


def _check_states(instance: dg.DagsterInstance, source: str) -> dict[str, tuple[str, bool]]:
    """check -> (status of its latest execution for ``source``, whether it targets the latest
    materialization): what the asset's check panel shows."""
    infos = instance.event_log_storage.get_asset_check_partition_info(CHECK_KEYS, partition_keys=[source])
    return {i.check_key.name: (i.latest_execution_status.value, i.is_current) for i in infos}


def test_after_a_no_op_rebuild_the_checks_read_passed(raw_root: Path, out_root: Path) -> None:
    with dagster_instance() as instance:
        defs = load_defs()
        first = build_source(defs, instance, "photos")
        assert first.success and all(check_outcomes(first).values())
        passed = {c.name: ("SUCCEEDED", True) for c in CHECK_KEYS}
        assert _check_states(instance, "photos") == passed

        again = build_source(defs, instance, "photos")  # nothing changed: the steps are skipped
        assert again.success and materialized(again) == {}
        assert {"twin_tar_shards", "key_indexes", "wdinfo_manifests"} <= skipped_steps(again)
        # ... and the checks were re-asserted on the committed version, in this run.
        assert check_outcomes(again) == {c.name: True for c in CHECK_KEYS}
        assert check_metadata(again, "twin_tar_keys_match")["checked"] == "the committed version (no-op build)"
        assert _check_states(instance, "photos") == passed


def test_a_no_op_rebuild_reports_a_committed_version_damaged_since(raw_root: Path, out_root: Path) -> None:
    from tests.support.build_data import reverse_members_in_place

    with dagster_instance() as instance:
        defs = load_defs()
        assert build_source(defs, instance, "photos").success
        # Damage the served version in a way the intake's up-to-date test does not look at.
        reverse_members_in_place(out_root / "photos" / "aspect_ratio_1_1" / "caption" / "part_000000" / "000000.tar")
        again = build_source(defs, instance, "photos")
        outcomes = check_outcomes(again)
        assert outcomes["twin_tar_keys_match"] is False and outcomes["shards_within_size_bound"] is True
        states = _check_states(instance, "photos")
        assert states["twin_tar_keys_match"] == ("FAILED", True)


def test_a_source_that_lost_many_samples_is_flagged_but_built(raw_root: Path, out_root: Path) -> None:
    make_sample_source(raw_root / "messy", photos=("astronaut",), ratios=((1, 1), (16, 9)), with_problems=True)
    with dagster_instance() as instance:
        defs = load_defs()
        messy = build_source(defs, instance, "messy")
        assert messy.success  # a warning, not a failure: the kept samples are built and committed
        assert set(materialized(messy)) == set(SOURCE_CHECKS)
        assert check_outcomes(messy)["dropped_fraction_within_bound"] is False
        found = check_metadata(messy, "dropped_fraction_within_bound")
        assert (found["samples"], found["dropped_total"], found["dropped_fraction"]) == (3, 3, 0.5)
        [evaluation] = [e for e in messy.get_asset_check_evaluations() if e.check_name == "dropped_fraction_within_bound"]
        assert evaluation.severity == dg.AssetCheckSeverity.WARN

        clean = build_source(defs, instance, "photos")
        assert check_outcomes(clean)["dropped_fraction_within_bound"] is True


def _check_alone(defs: dg.Definitions, instance: dg.DagsterInstance, job: str, check: dg.AssetCheckKey,
                 partition: str | None = None) -> dg.ExecuteInProcessResult:
    """The check executed on its own, as the UI's "Execute" button on a check does."""
    subset = defs.resolve_job_def(job).get_subset(asset_selection=set(), asset_check_selection={check})
    return subset.execute_in_process(instance=instance, partition_key=partition, raise_on_error=False,
                                     run_config={"resources": {"sharding": {"config": {"num_workers": 1}}}})


def test_a_lost_key_index_of_the_served_version_fails_its_check(raw_root: Path, out_root: Path) -> None:
    check = dg.AssetCheckKey(dg.AssetKey("key_indexes"), "key_indexes_match_tars")
    with dagster_instance() as instance:
        defs = load_defs()
        first = build_source(defs, instance, "photos")
        assert check_outcomes(first)["key_indexes_match_tars"] is True  # on the staged version, before the commit
        index = out_root / "photos" / "aspect_ratio_1_1" / "_key_index" / "part_000000" / "000000.parquet"
        index.unlink()  # a sync that dropped a file, a hand clean-up
        again = _check_alone(defs, instance, "source_build", check, "photos")
        assert check_outcomes(again) == {check.name: False}
        assert check_metadata(again, check.name)["problems"] == [f"{index}: missing"]
        assert _check_states(instance, "photos")["key_indexes_match_tars"] == ("FAILED", True)


def test_the_catalog_check_fails_until_the_catalog_lists_every_built_source(raw_root: Path, out_root: Path) -> None:
    make_sample_source(raw_root / "portraits", photos=("coffee",), ratios=((3, 4),), with_problems=False)
    check = dg.AssetCheckKey(dg.AssetKey("dataset_catalog"), "catalog_lists_every_built_source")
    with dagster_instance() as instance:
        defs = load_defs()
        assert build_source(defs, instance, "photos").success
        catalog = build_catalog(defs, instance)
        assert catalog.success and check_outcomes(catalog) == {check.name: True}

        assert build_source(defs, instance, "portraits").success
        alone = _check_alone(defs, instance, "catalog_build", check)
        assert check_outcomes(alone) == {check.name: False}
        assert check_metadata(alone, check.name)["problems"] == [
            f"portraits: built but not in {out_root / 'catalog.json'}", f"{out_root / 'catalog.json'}: dataset 'all' "
            "is not every built source"]
        assert check_outcomes(build_catalog(defs, instance)) == {check.name: True}
