"""Issue 34: runs started from the UI end as the operator expects, driven as the UI drives them
(GraphQL launches with the launchpad's config, "Re-execute" from the run page, the daemon's run
queue, run workers): a re-execution that finds its source rebuilt since has nothing to finish
(part 2)."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pytest

from pid_platform.demo import pid_demo as demo
from tests.support.ui_launch import (
    REPO,
    dequeue,
    launch,
    launchpad_params,
    partition_status,
    reexecute,
    run_messages,
    step_keys,
    ui_workspace,
    wait_done,
)

SOURCE = "photos"
SUCCESS, FAILURE = dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE


@pytest.fixture
def ui_home(tmp_path: Path, out_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A prepared instance (``pid-demo --prepare-instance``) whose code server and run workers
    import this tree."""
    home = demo.prepare_home(tmp_path / "home")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return home


def _hide_a_file(raw_root: Path) -> tuple[Path, Path]:
    """One image gone without touching any other file's identity (the image folder becomes links
    to the other files of the real one, moved aside): a write task holding it fails for good."""
    image = raw_root / SOURCE / "image"
    victim = sorted(image.iterdir())[0]
    real = image.rename(image.with_name("_image"))
    image.mkdir()
    for f in sorted(real.iterdir()):
        if f.name != victim.name:
            (image / f.name).symlink_to(f)
    return image, real


@pytest.mark.slow
def test_reexecute_from_failure_after_a_rebuild_has_nothing_to_finish(
    ui_home: Path, raw_root: Path, out_root: Path,
) -> None:
    with dg.DagsterInstance.get() as instance, ui_workspace(instance) as context:
        instance.add_dynamic_partitions("sources", [SOURCE])
        # The samples staged; then a file goes missing and a write task of the tars fails.
        staged = launch(context, launchpad_params("source_build", SOURCE, ["sample_set"], write_tasks=3))
        assert wait_done(instance, staged, 300, context) == SUCCESS
        image, real = _hide_a_file(raw_root)
        failed = launch(context, launchpad_params("source_build", SOURCE,
                                                  ["twin_tar_shards", "key_indexes", "wdinfo_manifests"],
                                                  write_tasks=3))
        assert wait_done(instance, failed, 300, context) == FAILURE
        failed_steps = step_keys(instance, failed, dg.DagsterEventType.STEP_FAILURE)
        assert len(failed_steps) == 1 and failed_steps[0].startswith("twin_tar_shards.write_task"), failed_steps

        # The file is back, and the source is rebuilt and committed by another run (the sensor's).
        shutil.rmtree(image)
        real.rename(image)
        rebuilt = launch(context, launchpad_params("source_build", SOURCE))
        assert wait_done(instance, rebuilt, 300, context) == SUCCESS
        committed = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("wdinfo_manifests"), asset_partitions=[SOURCE]),
            limit=1).records[0]

        # Re-execute -> From failure on the failed run: nothing is staged any more.
        again = reexecute(context, failed)
        dequeue(context)
        assert wait_done(instance, again, 300, context) == SUCCESS
        said = [m for m in run_messages(instance, again) if "nothing to finish" in m]
        assert said and all(f"nothing to finish: {SOURCE} was rebuilt by run {rebuilt}" in m for m in said), said
        assert not any("already done" in m for m in run_messages(instance, again))
        assert step_keys(instance, again, dg.DagsterEventType.STEP_FAILURE) == []
        # The committed build's state stands: no new materialization, no asset red.
        latest = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("wdinfo_manifests"), asset_partitions=[SOURCE]),
            limit=1).records[0]
        assert latest.storage_id == committed.storage_id
        for asset in ("twin_tar_shards", "key_indexes", "wdinfo_manifests"):
            assert partition_status(context, asset) == {"materialized": [SOURCE], "failed": []}, asset
    assert (out_root / SOURCE / ".pid-build" / "sharding.json").is_file()
