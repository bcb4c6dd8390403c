"""The S3 side of the ``source_store`` seam: a raw root and an output root on a real S3 server
(SeaweedFS on 127.0.0.1), discovered by the sensor and built by the same job as a local one; the
loader and the example training job read the result straight from the bucket."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from loader.wds.pipeline import build_dataset
from pid_platform.defs.partitions import SOURCES
from pid_platform.defs.resources import S3SourceStoreResource
from tests.support.dagster_runs import (
    apply_partition_requests,
    build_catalog,
    build_source,
    check_outcomes,
    dagster_instance,
    evaluate_sensor,
    load_defs,
    manifests,
    materialized,
    observed,
    run_config,
    skipped_steps,
    tars,
    use_roots,
)
from tests.support.s3_objects import current_version, pointer
from tests.support.seaweedfs import SeaweedS3, raw_and_output_buckets, upload_tree

REPO = Path(__file__).resolve().parents[1]

BUCKET = "dagster-raw"


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dagster_instance() as found:
        yield found


def test_s3_raw_root_is_sensed_and_built(
    s3_env: SeaweedS3, photo_drop_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_env.make_bucket(BUCKET)
    upload_tree(s3_env.client(), photo_drop_template, BUCKET, "drops")
    monkeypatch.setenv("PID_RAW_ROOT", f"s3://{BUCKET}/drops")
    monkeypatch.setenv("PID_OUTPUT_ROOT", str(tmp_path / "out"))
    with dagster_instance() as instance:
        defs = load_defs()
        store = defs.resources["source_store"]
        assert isinstance(store, S3SourceStoreResource) and store.s3.endpoint_url == s3_env.endpoint_url

        sensed = evaluate_sensor(defs, instance, None)
        assert apply_partition_requests(instance, sensed) == ["photos"]
        assert [r.partition_key for r in sensed.run_requests] == ["photos"]
        assert evaluate_sensor(defs, instance, sensed.cursor).run_requests == []  # ETags unchanged

        result = build_source(defs, instance, "photos")
        assert result.success and all(e.passed for e in result.get_asset_check_evaluations())
        assert materialized(result)["sample_set"]["raw_source"] == f"s3://{BUCKET}/drops/photos"
    assert sum(m["total_key_count"] for m in manifests(tmp_path / "out" / "photos").values()) == 32


def _dagster_build(source: str, **sharding) -> dict[str, dict]:
    """Every webdataset asset of ``source`` and the catalog, through Dagster, checks included."""
    with dagster_instance() as instance:
        defs = load_defs()
        built = build_source(defs, instance, source, **sharding)
        assert built.success and all(check_outcomes(built).values()), check_outcomes(built)
        catalog = build_catalog(defs, instance)
        assert catalog.success
        return {**materialized(built), **materialized(catalog)}


def test_every_asset_from_s3_into_s3_matches_the_local_build_and_trains(
    s3_env: SeaweedS3, photo_drop_template: Path, raw_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = raw_and_output_buckets(s3_env, photo_drop_template, monkeypatch, "dagster-both")
    monkeypatch.setenv("PID_WORK_ROOT", str(tmp_path / "work"))
    monkeypatch.chdir(tmp_path)
    # Three write tasks, meeting in the bucket: no step of an s3 build needs another's disk.
    on_s3 = _dagster_build("photos", max_shard_size_mb=0.25, write_tasks=3)
    assert on_s3["twin_tar_shards"]["write_tasks"] == 3
    assert on_s3["wdinfo_manifests"]["output"] == "s3://dagster-both-out/built/photos"
    assert on_s3["dataset_catalog"]["catalog"] == "s3://dagster-both-out/built/catalog.json"
    assert not (tmp_path / "s3:").exists()

    use_roots(monkeypatch, raw_root, tmp_path / "local")
    local = _dagster_build("photos", max_shard_size_mb=0.25, write_tasks=3)
    assert local["twin_tar_shards"]["write_tasks"] == 3
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint_url)  # use_roots took it away
    assert local["twin_tar_shards"]["config_version"] == on_s3["twin_tar_shards"]["config_version"]

    published = current_version(client, "dagster-both-out", "built/photos")
    local_out = tmp_path / "local" / "photos"
    local_tars = {p.relative_to(local_out).as_posix(): p.read_bytes() for p in sorted(tars(local_out))}
    assert {k: v for k, v in published.items() if k.endswith(".tar")} == local_tars  # byte-identical
    s3_manifests = {k.rsplit("/", 2)[-2]: json.loads(v) for k, v in published.items() if k.endswith("wdinfo.json")}
    assert s3_manifests == manifests(local_out)
    assert len(s3_manifests) == 8 and sum(m["total_key_count"] for m in s3_manifests.values()) == 32

    # The loader finds the build by the same specs as a local one: catalog name, prefix, manifest URL.
    catalog = "s3://dagster-both-out/built"
    by_name = build_dataset("photos", catalog=catalog, decode=None, shuffle=False)
    keys = sorted(s["__key__"] for s in by_name)
    assert keys == sorted(s["__key__"] for s in build_dataset(str(local_out), decode=None, shuffle=False))
    assert sorted(s["__key__"] for s in build_dataset(f"{catalog}/photos", decode=None, shuffle=False)) == keys

    # A few training steps straight from the bucket (the example job, one process).
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_policy.py"), "--data", "twin-tars", "--root",
         f"{catalog}/photos", "--checkpoint-dir", str(tmp_path / "ckpt"), "--epochs", "1", "--batch-size", "4",
         "--num-workers", "0", "--log-every", "2"],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done: 8 steps, 1 epochs, 32 samples per rank" in proc.stdout


def test_any_machine_finds_an_s3_build_up_to_date_and_reshards_it_from_the_bucket(
    s3_env: SeaweedS3, photo_drop_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    instance: dg.DagsterInstance,
) -> None:
    """Each run below has an empty work folder of its own, as a fresh worker would: what a
    build needs of the last one (its samples, every file's outcome, its settings) comes from the
    version the bucket serves."""
    client = raw_and_output_buckets(s3_env, photo_drop_template, monkeypatch, "dagster-fresh")
    instance.add_dynamic_partitions(SOURCES, ["photos"])  # one instance: the machines share it

    def run(machine: str, **kwargs):
        monkeypatch.setenv("PID_WORK_ROOT", str(tmp_path / machine))
        return load_defs().resolve_job_def("source_build").execute_in_process(
            instance=instance, partition_key="photos", raise_on_error=False, **kwargs)

    first = run("machine-1", run_config=run_config(max_shard_size_mb=0.25, write_tasks=2))
    assert first.success and all(check_outcomes(first).values()), check_outcomes(first)
    version = pointer(client, "dagster-fresh-out", "built/photos")["version"]

    # A rebuild elsewhere: the published outcomes are reused (nothing decoded), the samples and
    # settings are those the version was cut from, so nothing is built and its checks hold.
    again = run("machine-2", run_config=run_config(max_shard_size_mb=0.25, write_tasks=2))
    assert again.success
    seen = observed(again)["sample_set"]
    assert seen["up_to_date"] is True and seen["files_validated"] == 0
    assert {"twin_tar_shards", "key_indexes", "wdinfo_manifests"} <= skipped_steps(again)
    assert check_outcomes(again) and all(check_outcomes(again).values())
    assert pointer(client, "dagster-fresh-out", "built/photos")["version"] == version
    assert not (tmp_path / "machine-2").exists() or not any((tmp_path / "machine-2").rglob("*.parquet"))

    # A re-shard alone (no sample_set in the run) on a third machine cuts the published samples.
    reshard = run("machine-3", run_config=run_config(max_shard_size_mb=0.5),
                  asset_selection=[dg.AssetKey(a) for a in ("twin_tar_shards", "key_indexes", "wdinfo_manifests")])
    assert reshard.success and all(check_outcomes(reshard).values())
    assert materialized(reshard)["twin_tar_shards"]["sample_set"] == "committed"
    resharded = current_version(client, "dagster-fresh-out", "built/photos")
    assert pointer(client, "dagster-fresh-out", "built/photos")["version"] != version
    assert sum(json.loads(v)["total_key_count"] for k, v in resharded.items() if k.endswith("wdinfo.json")) == 32


def test_a_tar_deleted_from_the_served_version_is_sent_again_by_the_dagster_steps(
    s3_env: SeaweedS3, photo_drop_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    instance: dg.DagsterInstance,
) -> None:
    """A re-shard with the same settings on a fresh machine stages the very version the pointer
    names: its write tasks keep what the bucket holds and send the tar that was deleted, never
    copying a tar onto itself (which failed every retry, blaming a re-staged plan)."""
    client = raw_and_output_buckets(s3_env, photo_drop_template, monkeypatch, "dagster-repair")
    instance.add_dynamic_partitions(SOURCES, ["photos"])

    def run(machine: str, **kwargs):
        monkeypatch.setenv("PID_WORK_ROOT", str(tmp_path / machine))
        return load_defs().resolve_job_def("source_build").execute_in_process(
            instance=instance, partition_key="photos", raise_on_error=False,
            run_config=run_config(max_shard_size_mb=0.25, write_tasks=2), **kwargs)

    assert run("machine-1").success
    version = pointer(client, "dagster-repair-out", "built/photos")["version"]
    prefix = f"built/photos/versions/{version}/"
    listed = client.list_objects_v2(Bucket="dagster-repair-out", Prefix=prefix)["Contents"]
    lost = sorted(o["Key"] for o in listed if o["Key"].endswith(".tar"))[0]
    client.delete_object(Bucket="dagster-repair-out", Key=lost)

    again = run("machine-2", asset_selection=[dg.AssetKey(a) for a in
                                              ("twin_tar_shards", "key_indexes", "wdinfo_manifests")])
    assert again.success
    shards = materialized(again)["twin_tar_shards"]
    assert shards["written"] == 1 and shards["reused"] == shards["shards"] - 1  # that shard only
    assert pointer(client, "dagster-repair-out", "built/photos")["version"] == version
    client.head_object(Bucket="dagster-repair-out", Key=lost)
    dataset = build_dataset("s3://dagster-repair-out/built/photos", decode=None, shuffle=False, verify="sha256")
    assert len({s["__key__"] for s in dataset}) == 32


def test_adding_a_modality_through_the_dagster_s3_path_writes_no_image_tar(
    s3_env: SeaweedS3, raw_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    instance: dg.DagsterInstance,
) -> None:
    """The plan step on a machine that never held the build extends the published plan; its
    write tasks send only the added modality's tars, into the folder of the version they join."""
    from tests.support.s3_objects import S3Requests
    from tests.test_add_modality import NEW

    client = s3_env.client()
    s3_env.make_bucket("dagster-addmod-raw")
    s3_env.make_bucket("dagster-addmod-out")
    aside = tmp_path / "aside"
    aside.mkdir()
    shutil.move(raw_root / "photos" / NEW, aside / NEW)
    upload_tree(client, raw_root, "dagster-addmod-raw", "drops")
    monkeypatch.setenv("PID_RAW_ROOT", "s3://dagster-addmod-raw/drops")
    monkeypatch.setenv("PID_OUTPUT_ROOT", "s3://dagster-addmod-out/built")
    instance.add_dynamic_partitions(SOURCES, ["photos"])

    def run(machine: str):
        monkeypatch.setenv("PID_WORK_ROOT", str(tmp_path / machine))
        return load_defs().resolve_job_def("source_build").execute_in_process(
            instance=instance, partition_key="photos", raise_on_error=False,
            run_config=run_config(max_shard_size_mb=0.25, write_tasks=2))

    first = run("machine-1")
    assert first.success and all(check_outcomes(first).values()), check_outcomes(first)
    v1 = pointer(client, "dagster-addmod-out", "built/photos")["version"]

    shutil.move(aside / NEW, raw_root / "photos" / NEW)
    upload_tree(client, raw_root, "dagster-addmod-raw", "drops")
    with S3Requests() as requests:
        second = run("machine-2")
    writes = requests.writes()
    assert second.success and all(check_outcomes(second).values()), check_outcomes(second)
    assert [w for w in writes if "/image/" in w[1] or "/caption/" in w[1]] == []
    # The only copies inside the bucket: the commit carrying the staged state into the version.
    assert [k for op, k in writes if op == "CopyObject" and "/.pid-build/" not in k] == []
    sent = [k for _, k in writes if k.endswith(".tar")]
    assert sent and all(f"/{NEW}/" in k and f"/versions/{v1}/" in k for k in sent)
    p2 = pointer(client, "dagster-addmod-out", "built/photos")
    assert p2["version"] != v1 and p2["uses"] == [v1]
    spec = "s3://dagster-addmod-out/built/photos"
    got = sorted(s["__key__"] for s in build_dataset(spec, modalities=["caption", "image", NEW], decode=None,
                                                     shuffle=False))
    assert len(got) == 32
