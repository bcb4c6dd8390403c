"""The shape of the code location, written down: a change to lineage, partitions, checks, jobs or
automation fails here until this snapshot is updated on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from dagster_aws.s3 import S3Resource

from pid_platform.defs.datasets.definitions import read_datasets_file
from pid_platform.defs.resources import (
    SHARDING_CODE_VERSION,
    LocalSourceStoreResource,
    S3SourceStoreResource,
    ShardingResource,
    source_store_from_env,
)
from tests.support.dagster_runs import load_defs

REPO = Path(__file__).resolve().parents[1]
SOURCES = 'Dynamic partitions: "sources"'
LEROBOT_DATASETS = 'Dynamic partitions: "lerobot_datasets"'
BUILD = "webdataset_build"

EXPECTED_ASSETS = {
    "raw_source": {
        "deps": [], "group": BUILD, "partitions": SOURCES, "code_version": None,
        "kinds": [], "checks": [], "pools": [],
    },
    "lerobot_dataset": {
        "deps": [], "group": "lerobot", "partitions": LEROBOT_DATASETS, "code_version": None,
        "kinds": [], "checks": [], "pools": [],
    },
    "sharding_settings": {
        "deps": [], "group": BUILD, "partitions": SOURCES, "code_version": None,
        "kinds": [], "checks": [], "pools": [],
    },
    "sample_set": {
        "deps": ["raw_source", "sharding_settings"], "group": BUILD, "partitions": SOURCES,
        "code_version": "intake-v1-classify_aspect_ratio=True",
        "kinds": ["parquet", "python"], "checks": ["dropped_fraction_within_bound"], "pools": ["pid_build"],
    },
    "twin_tar_shards": {
        "deps": ["sample_set", "sharding_settings"], "group": BUILD, "partitions": SOURCES,
        "code_version": "<sharding>", "kinds": ["python", "webdataset"], "checks": ["shards_within_size_bound", "twin_tar_keys_match"],
        "pools": ["pid_build"],
    },
    "key_indexes": {
        "deps": ["twin_tar_shards"], "group": BUILD, "partitions": SOURCES, "code_version": "<sharding>",
        "kinds": ["parquet", "python"], "checks": ["key_indexes_match_tars"], "pools": [],
    },
    "wdinfo_manifests": {
        "deps": ["key_indexes"], "group": BUILD, "partitions": SOURCES, "code_version": "<sharding>",
        "kinds": ["json", "python"], "checks": ["manifest_counts_match_tars"], "pools": [],
    },
    "dataset_catalog": {  # its code version: a digest of $PID_DATASETS (an edit makes automation rewrite it)
        "deps": ["wdinfo_manifests"], "group": "catalog", "partitions": None, "code_version": "<datasets>",
        "kinds": ["json", "python"], "checks": ["catalog_lists_every_built_source"], "pools": [],
    },
    "mp4_sidecar": {
        "deps": ["lerobot_dataset"], "group": "lerobot", "partitions": LEROBOT_DATASETS,
        "code_version": "mp4-sidecar-v3",
        "kinds": ["numpy", "python"], "checks": ["mp4_sidecar_is_valid"], "pools": [],
    },
    "published_mp4_sidecar": {
        "deps": ["mp4_sidecar"], "group": "lerobot", "partitions": LEROBOT_DATASETS,
        "code_version": "mp4-sidecar-v3-pointer-v1", "kinds": ["python"], "checks": ["published_sidecar_streams"],
        "pools": ["lerobot_publish"],
    },
}

# Observable source assets: where lineage starts.
OBSERVED = {"raw_source", "lerobot_dataset", "sharding_settings"}

# Every check has one result per partition of its asset's partitions (the catalog has none) and
# blocks what is downstream, except the intake's dropped-samples warning.
CHECK_PARTITIONS = {"mp4_sidecar_is_valid": "lerobot_datasets", "published_sidecar_streams": "lerobot_datasets",
                    "catalog_lists_every_built_source": None}
WARNINGS = {"dropped_fraction_within_bound"}

EXPECTED_JOBS = {
    "source_build": [
        "key_indexes", "key_indexes:key_indexes_match_tars", "sample_set", "sample_set:dropped_fraction_within_bound",
        "twin_tar_shards", "twin_tar_shards:shards_within_size_bound",
        "twin_tar_shards:twin_tar_keys_match", "wdinfo_manifests", "wdinfo_manifests:manifest_counts_match_tars",
    ],
    "catalog_build": ["dataset_catalog", "dataset_catalog:catalog_lists_every_built_source"],
    "lerobot_sidecar_build": [
        "mp4_sidecar", "mp4_sidecar:mp4_sidecar_is_valid", "published_mp4_sidecar",
        "published_mp4_sidecar:published_sidecar_streams",
    ],
}

EXPECTED_AUTOMATION = {
    "raw_sources_sensor": ("sensor", "source_build", "RUNNING"),
    "daily_source_rebuild": ("schedule 0 3 * * * UTC", "source_build", "RUNNING"),
    "lerobot_datasets_sensor": ("sensor", "lerobot_sidecar_build", "RUNNING"),
    "run_failure_alert_sensor": ("sensor", None, "RUNNING"),
    "queued_builds_sensor": ("sensor", None, "RUNNING"),
    "run_holds_sensor": ("sensor", None, "RUNNING"),
    "follow_upstream_sensor": ("automation-condition sensor", None, "RUNNING"),
}

# Assets that follow their upstream by themselves (eager, gated on upstream blocking checks).
FOLLOWERS = ["dataset_catalog", "key_indexes", "wdinfo_manifests"]


@pytest.fixture(scope="module")
def defs() -> dg.Definitions:
    with dg.instance_for_test():
        return load_defs()


def _snapshot_assets(defs: dg.Definitions) -> dict:
    graph = defs.resolve_asset_graph()
    out = {}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        version = node.code_version
        out[key.to_user_string()] = {
            "deps": sorted(k.to_user_string() for k in node.parent_keys),
            "group": node.group_name,
            "partitions": str(node.partitions_def) if node.partitions_def else None,
            "code_version": "<sharding>" if version == SHARDING_CODE_VERSION else
            "<datasets>" if version == f"datasets-{read_datasets_file().version()}" else version,
            "kinds": sorted(node.kinds),
            "checks": sorted(c.name for c in node.check_keys),
            "pools": sorted(node.pools or ()),
        }
    return out


def test_assets_lineage_and_checks(defs: dg.Definitions) -> None:
    assert _snapshot_assets(defs) == EXPECTED_ASSETS


def test_every_check_is_blocking_and_per_source(defs: dg.Definitions) -> None:
    graph = defs.resolve_asset_graph()
    for check_key in graph.asset_check_keys:
        spec = graph.get_check_spec(check_key)
        assert spec.blocking == (check_key.name not in WARNINGS), check_key
        want = CHECK_PARTITIONS.get(check_key.name, "sources")
        assert (spec.partitions_def.name if spec.partitions_def else None) == want, check_key
        assert spec.description and len(spec.description) > 40, check_key


def test_every_asset_is_described(defs: dg.Definitions) -> None:
    for spec in defs.resolve_all_asset_specs():
        assert spec.description and len(spec.description) > 40, spec.key


def test_every_asset_has_an_owner_and_a_domain(defs: dg.Definitions) -> None:
    domains = {}
    for spec in defs.resolve_all_asset_specs():
        if spec.key.to_user_string() in OBSERVED:  # source assets take no owners in 1.13
            if "domain" in spec.tags:
                domains[spec.key.to_user_string()] = spec.tags["domain"]
            continue
        assert list(spec.owners) == ["team:data-platform"], spec.key
        domains[spec.key.to_user_string()] = spec.tags["domain"]
    assert {k for k, d in domains.items() if d == "robot-learning"} == {
        "lerobot_dataset", "mp4_sidecar", "published_mp4_sidecar"}
    assert set(EXPECTED_ASSETS) - set(domains) <= {"sharding_settings"}


def test_jobs_select_what_they_should(defs: dg.Definitions) -> None:
    jobs = {}
    for name in EXPECTED_JOBS:
        layer = defs.resolve_job_def(name).asset_layer
        keys = [k.to_user_string() for k in layer.selected_asset_keys]
        checks = [f"{c.asset_key.to_user_string()}:{c.name}" for c in layer.asset_graph.asset_check_keys]
        jobs[name] = sorted(keys + checks)
    assert jobs == EXPECTED_JOBS


def test_schedules_and_sensors(defs: dg.Definitions) -> None:
    found = {}
    for s in defs.sensors or []:
        sensor = defs.resolve_sensor_def(s.name)
        if isinstance(sensor, dg.AutomationConditionSensorDefinition):  # runs whatever its conditions ask
            found[sensor.name] = ("automation-condition sensor", None, sensor.default_status.name)
            continue
        job = sensor.job_name if sensor.targets else None  # a run-failure sensor starts no job
        found[sensor.name] = ("sensor", job, sensor.default_status.name)
    for s in defs.schedules or []:
        schedule = defs.resolve_schedule_def(s.name)
        found[schedule.name] = (
            f"schedule {schedule.cron_schedule} {schedule.execution_timezone}", schedule.job_name,
            schedule.default_status.name,
        )
    assert found == EXPECTED_AUTOMATION


def test_every_sensor_and_schedule_is_described(defs: dg.Definitions) -> None:
    """The UI shows ``description=`` on the Automation page; a function's docstring is not it."""
    described = [defs.resolve_sensor_def(s.name) for s in defs.sensors or []]
    described += [defs.resolve_schedule_def(s.name) for s in defs.schedules or []]
    assert sorted(d.name for d in described) == sorted(EXPECTED_AUTOMATION)
    for d in described:
        assert d.description and len(d.description) > 60, d.name


def test_derived_assets_follow_upstream_and_every_io_step_retries(defs: dg.Definitions) -> None:
    graph = defs.resolve_asset_graph()
    followers = sorted(k.to_user_string() for k in graph.get_all_asset_keys()
                       if graph.get(k).automation_condition is not None)
    assert followers == FOLLOWERS
    for key in FOLLOWERS:
        label = graph.get(dg.AssetKey(key)).automation_condition.get_label() or ""
        condition = str(graph.get(dg.AssetKey(key)).automation_condition)
        assert "blocking" in condition.lower() or "blocking" in label.lower(), key
    for name in set(EXPECTED_ASSETS) - OBSERVED:  # observations, not steps
        # Every op of the asset: twin_tar_shards is a graph (plan -> write tasks -> collect).
        for op in defs.resolve_assets_def(name).node_def.iterate_op_defs():
            assert op.retry_policy is not None and op.retry_policy.max_retries >= 3, (name, op.name)


def test_resources_bind_one_store_key(defs: dg.Definitions) -> None:
    assert sorted(defs.resources) == ["lerobot", "s3", "sharding", "source_store"]
    assert isinstance(defs.resources["s3"], S3Resource)
    assert isinstance(defs.resources["source_store"], LocalSourceStoreResource)
    sharding = defs.resources["sharding"]
    assert isinstance(sharding, ShardingResource)
    assert (sharding.num_workers, sharding.trust_pickle, sharding.datasets) == (2, False, {})


def test_store_is_chosen_by_raw_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    local = source_store_from_env({})
    assert isinstance(local, LocalSourceStoreResource)
    assert (local.raw_root, local.output_root) == (str(tmp_path / "demo/raw"), str(tmp_path / "demo/out"))
    s3 = source_store_from_env(
        {"PID_RAW_ROOT": "s3://drops/raw", "PID_OUTPUT_ROOT": "built", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    )
    assert isinstance(s3, S3SourceStoreResource)
    assert (s3.raw_root, s3.s3.endpoint_url, s3.output_root) == ("s3://drops/raw", "http://127.0.0.1:9", str(tmp_path / "built"))
    assert s3.s3_settings().endpoint_url == "http://127.0.0.1:9" and s3.source_target("photos") is None
    # An S3 output: builds stage in a local work folder and are published to the bucket.
    to_s3 = source_store_from_env({"PID_OUTPUT_ROOT": "s3://drops/out", "PID_WORK_ROOT": "work"})
    assert str(to_s3.source_target("photos")) == "s3://drops/out/photos"
    assert to_s3.source_out("photos") == tmp_path / "work" / "drops" / "out" / "photos"
    with pytest.raises(ValueError, match="gs:// is not a place builds are written to"):
        source_store_from_env({"PID_OUTPUT_ROOT": "gs://drops/out"})
    with pytest.raises(ValueError, match="must not carry credentials"):
        source_store_from_env({}, s3=S3Resource(aws_access_key_id="AKIA", aws_secret_access_key="x")).s3_settings()
    with pytest.raises(ValueError, match="plain folder name"):
        local.source_out("../elsewhere")


def test_workspace_loads_as_the_ui_loads_it(tmp_path: Path) -> None:
    """``dagster definitions validate`` loads workspace.yaml exactly as ``dagster dev`` does."""
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "PID_RAW_ROOT": str(tmp_path / "raw"),
           "PID_OUTPUT_ROOT": str(tmp_path / "out")}
    dagster = Path(sys.executable).parent / "dagster"
    proc = subprocess.run(
        [str(dagster), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Validation successful for code location pid_platform" in proc.stdout + proc.stderr
