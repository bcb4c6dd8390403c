"""Materialize the code location's assets for real sources on a real (temporary) instance."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg

from loader.formats.wdinfo import read_wdinfo
from pid_platform.demo.sample_data import make_sample_source
from pid_platform.sharding.commit.verify_output import manifest_mismatches
from pid_platform.sharding.commit.versions import staging_dir
from tests.support.build_data import reverse_members_in_place
from tests.support.dagster_runs import (
    SOURCE_ASSETS,
    build_catalog,
    build_source,
    check_metadata,
    check_outcomes,
    dagster_instance,
    load_defs,
    manifests,
    materialized,
    observed,
    run_config,
    skipped_steps,
    tars,
)

ALL_CHECKS = {"dropped_fraction_within_bound", "twin_tar_keys_match", "shards_within_size_bound",
              "key_indexes_match_tars", "manifest_counts_match_tars"}


def test_every_asset_materializes_and_every_check_passes(raw_root: Path, out_root: Path) -> None:
    with dagster_instance() as instance:
        defs = load_defs()
        result = build_source(defs, instance, "photos")
        assert result.success
        meta = materialized(result)
        assert set(meta) == set(SOURCE_ASSETS)
        assert check_outcomes(result) == dict.fromkeys(ALL_CHECKS, True)

        # 4 photographs x 8 aspect ratios, nothing dropped, one bucket per ratio.
        assert meta["sample_set"]["samples"] == 32
        assert meta["sample_set"]["dropped_total"] == 0
        assert meta["sample_set"]["orphans"] == {"caption": 0, "image": 0, "umt5": 0}
        shards = meta["twin_tar_shards"]
        assert (shards["samples"], shards["buckets"]) == (32, 8)
        assert shards["written"] == shards["shards"] and shards["reused"] == 0
        # Typed tables (the UI sorts them by column) and the asset's row count: its samples.
        by_bucket = {r.data["bucket"]: r.data for r in shards["shards_by_bucket"].records}
        assert by_bucket["aspect_ratio_16_9"]["samples"] == 4 and len(by_bucket) == 8
        assert {c.name: c.type for c in shards["shards_by_bucket"].schema.columns}["bytes"] == "int"
        assert shards["dagster/row_count"] == 32 and meta["sample_set"]["dagster/row_count"] == 32
        assert meta["wdinfo_manifests"]["dagster/row_count"] == 32
        assert meta["key_indexes"]["key_indexes"] == shards["shards"]
        assert meta["wdinfo_manifests"]["samples"] == 32
        assert meta["wdinfo_manifests"]["removed_count"] == 0

        src_out = out_root / "photos"
        found = manifests(src_out)
        assert len(found) == 8
        assert sum(m["total_key_count"] for m in found.values()) == 32
        for path in meta["wdinfo_manifests"]["manifests"]:
            man = read_wdinfo(path)
            for t in man.tars:
                for modality in man.data_keys:
                    assert (Path(man.root_path()) / modality / t.path).is_file()
                assert (Path(path).parent / t.key_index).is_file()
        assert len(tars(src_out)) == shards["shards"] * 3  # image, caption, umt5

        catalog = build_catalog(defs, instance)
        assert catalog.success
        cat_meta = materialized(catalog)["dataset_catalog"]
        assert cat_meta["sources"] == ["photos"] and cat_meta["total_key_count"] == 32
        doc = json.loads((out_root / "catalog.json").read_text())
        assert doc["datasets"] == {"all": ["photos"]}

        # The instance knows which source each materialization belongs to.
        for name in SOURCE_ASSETS:
            assert instance.get_materialized_partitions(dg.AssetKey(name)) == {"photos"}


def test_intake_metadata_counts_what_was_dropped(raw_root: Path, out_root: Path) -> None:
    make_sample_source(raw_root / "messy", photos=("astronaut",), ratios=((1, 1), (16, 9)), with_problems=True)
    with dagster_instance() as instance:
        result = build_source(load_defs(), instance, "messy")
        assert result.success
        intake = materialized(result)["sample_set"]
    # Two crops plus the EXIF-rotated picture survive; three bad samples are counted, not lost.
    assert intake["samples"] == 3
    assert intake["dropped_by_reason"] == {
        "bad_caption: caption": 1, "missing_modality: caption": 1, "unreadable_image: image": 1,
    }
    assert intake["orphans"] == {"caption": 0, "image": 1, "umt5": 1}
    assert intake["examples"]["unreadable_image: image"] == ["truncated"]
    assert intake["key_collisions"] == 0
    assert {"outcome": "dropped: missing_modality: caption", "count": 1, "examples": "orphan"} in [
        r.data for r in intake["report"].records]


def test_reshard_rewrites_manifests_and_removes_stale_tars(raw_root: Path, out_root: Path) -> None:
    src_out = out_root / "photos"
    with dagster_instance() as instance:
        defs = load_defs()
        small = build_source(defs, instance, "photos", max_shard_size_mb=0.25)
        assert small.success and all(check_outcomes(small).values())
        small_meta = materialized(small)
        small_tars = tars(src_out)
        small_manifests = manifests(src_out)
        assert small_meta["twin_tar_shards"]["shards"] > 8  # several shards in some buckets

        before = _snapshot(src_out)
        again = build_source(defs, instance, "photos", max_shard_size_mb=0.25)
        # Nothing changed: intake says so in an observation (no new data version), nothing downstream
        # runs and nothing is written.
        assert again.success and materialized(again) == {}
        up = observed(again)["sample_set"]
        assert up["up_to_date"] is True and up["files_validated"] == 0 and up["samples"] == 32
        assert up["outcomes_reused"] == 32 * 3
        assert {"twin_tar_shards", "key_indexes", "wdinfo_manifests"} <= skipped_steps(again)
        assert _snapshot(src_out) == before and not staging_dir(src_out).exists()
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("sample_set"), asset_partitions=["photos"]), limit=5
        ).records
        assert len(records) == 1  # the first build's; the no-op made no new version

        big = build_source(defs, instance, "photos", max_shard_size_mb=64)
        assert big.success and all(check_outcomes(big).values())
        big_meta = materialized(big)
        assert set(big_meta) == set(SOURCE_ASSETS)  # the whole lineage re-materialized

    assert big_meta["twin_tar_shards"]["config_version"] != small_meta["twin_tar_shards"]["config_version"]
    assert big_meta["twin_tar_shards"]["shards"] == 8
    big_manifests = manifests(src_out)
    assert big_manifests != small_manifests
    assert all(len(m["data_list"]) == 1 for m in big_manifests.values())
    assert sum(m["total_key_count"] for m in big_manifests.values()) == 32

    stale = small_tars - tars(src_out)
    assert stale and not any(p.exists() for p in stale)
    assert big_meta["wdinfo_manifests"]["removed_count"] >= len(stale)
    listed = {
        (src_out / bucket / modality / rel)
        for bucket, m in big_manifests.items() for modality in m["data_keys"] for rel in m["data_list"]
    }
    assert tars(src_out) == listed  # nothing on disk that no manifest lists
    assert not staging_dir(src_out).exists()  # published by renaming: no stage left behind


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` (build state included): its bytes and mtime."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_failed_blocking_check_stops_downstream(raw_root: Path, out_root: Path) -> None:
    src_out = out_root / "photos"
    manifest = src_out / "aspect_ratio_1_1" / "wdinfo.json"
    with dagster_instance() as instance:
        defs = load_defs()
        assert build_source(defs, instance, "photos").success
        committed = manifest.read_bytes()
        published = _snapshot(src_out)

        # Stage a re-sharding (the first two steps only), then damage one freshly written staged
        # tar in a way the shard writer's reuse test (plan digest + size, mtime, inode) misses.
        staged_run = defs.resolve_job_def("source_build").execute_in_process(
            instance=instance, partition_key="photos", run_config=run_config(max_shard_size_mb=0.25),
            asset_selection=[dg.AssetKey("sample_set"), dg.AssetKey("twin_tar_shards")],
        )
        assert staged_run.success
        # 0.25 MB cuts the 1:1 bucket into shards of 1, 2 and 1 samples: shard 1 is new.
        staged_tar = staging_dir(src_out) / "aspect_ratio_1_1" / "caption" / "part_000000" / "000001.tar"
        assert staged_tar.stat().st_nlink == 1  # written for the new sharding, not linked from the output
        reverse_members_in_place(staged_tar)
        result = build_source(defs, instance, "photos", max_shard_size_mb=0.25)

        assert not result.success
        assert materialized(result)["twin_tar_shards"]["written"] == 0  # the damaged stage was kept
        assert check_outcomes(result) == {"dropped_fraction_within_bound": True, "twin_tar_keys_match": False,
                                          "shards_within_size_bound": True}
        problems = check_metadata(result, "twin_tar_keys_match")["problems"]
        assert any("aspect_ratio_1_1/part_000000/000001.tar" in p for p in problems)
        # Downstream of the blocked asset nothing ran: no key indexes, no new manifests.
        assert set(materialized(result)) == {"sample_set", "twin_tar_shards"}
        started = {e.step_key for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_START}
        failed = {e.step_key for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE}
        assert failed == {"twin_tar_shards_twin_tar_keys_match"}
        assert not started & {"key_indexes", "wdinfo_manifests"}
        # Nothing was published: the output is byte for byte (and mtime for mtime) the last good one.
        assert manifest.read_bytes() == committed
        assert _snapshot(src_out) == published
        assert manifest_mismatches(src_out, sorted(manifests(src_out))) == []
