"""Issue 34 part 6: a rebuild costs what changed. A change of a raw file's ctime or inode alone
(``chmod -R``, ``chown``, a hard link, a restore that keeps mtimes) leaves its bytes as they
were: the discovery sensor requests no build and the intake decodes nothing again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import dagster as dg
import pytest

from pid_platform.demo import pid_demo as demo
from pid_platform.demo.workspace_runs import open_workspace_runs
from tests.support.dagster_runs import (
    apply_partition_requests,
    evaluate_sensor,
    load_defs,
    run_config,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sqlite_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = demo.prepare_home(tmp_path / "home")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


def _latest_intake(instance: dg.DagsterInstance, source: str) -> dict:
    """The metadata of the newest sample_set event of ``source`` (a build, or an up-to-date check)."""
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey("sample_set"), asset_partitions=[source])
    records = (instance.fetch_materializations(flt, limit=1).records
               + instance.fetch_observations(flt, limit=1).records)
    newest = max(records, key=lambda r: r.storage_id)
    event = newest.asset_materialization or newest.asset_observation
    return {k: v.value for k, v in event.metadata.items()}


def test_chmod_chown_and_a_restore_request_no_build_and_decode_nothing(
    sqlite_home: Path, raw_root: Path, out_root: Path, tmp_path: Path,
) -> None:
    with dg.DagsterInstance.get() as instance, open_workspace_runs(instance, REPO / "workspace.yaml") as runs:
        defs = load_defs()
        first_tick = evaluate_sensor(defs, instance, None)
        assert apply_partition_requests(instance, first_tick) == ["photos"]
        (request,) = first_tick.run_requests
        built = runs.run("source_build", partition_key="photos", run_config=run_config(), tags=request.tags)
        assert built.success
        assert _latest_intake(instance, "photos")["files_validated"] > 0

        files = sorted(p for p in (raw_root / "photos").rglob("*") if p.is_file())
        backup = tmp_path / "backup"
        backup.mkdir()
        for i, path in enumerate(files):
            os.chmod(path, 0o600)  # chmod -R: ctime moves
            os.link(path, backup / f"{i}")  # a hard link: ctime moves (the link count)
        # A restore from backup that keeps mtimes: a new inode, the same bytes and mtime.
        restored = files[0]
        shutil.copy2(restored, tmp_path / "restore")
        os.replace(tmp_path / "restore", restored)

        tick = evaluate_sensor(defs, instance, first_tick.cursor)
        assert tick.run_requests == [], [r.tags for r in tick.run_requests]

        # The nightly rebuild (or an operator's) finds every outcome in the intake cache.
        again = runs.run("source_build", partition_key="photos", run_config=run_config())
        assert again.success
        intake = _latest_intake(instance, "photos")
        assert intake["files_validated"] == 0 and intake["outcomes_reused"] > 0, intake
