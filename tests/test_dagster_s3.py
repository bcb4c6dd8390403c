"""The S3 side of the ``source_store`` seam: a raw root on a real S3 server (SeaweedFS on
127.0.0.1), discovered by the sensor and built by the same job as a local one."""

from __future__ import annotations

from pathlib import Path

import pytest

from pid_platform.defs.resources import S3SourceStoreResource
from tests.support.dagster_runs import (
    apply_partition_requests,
    build_source,
    dagster_instance,
    evaluate_sensor,
    load_defs,
    manifests,
    materialized,
)
from tests.support.seaweedfs import SeaweedS3, upload_tree

BUCKET = "dagster-raw"


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
