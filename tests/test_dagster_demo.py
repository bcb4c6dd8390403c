"""The main job (``pid-demo``) against a persistent instance in a temporary project folder.

The demo builds whatever sources are under ``demo/raw`` and datasets under ``demo/lerobot``, and
only makes its samples when they are missing, so small ones are put there first to keep this fast.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from pid_platform.demo import pid_demo as demo
from pid_platform.demo.sample_data import make_sample_source

DATASET = demo.LEROBOT_DATASET


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The demo sets these for its own process; monkeypatch puts the old values back afterwards.
    for name in ("DAGSTER_HOME", "PID_RAW_ROOT", "PID_OUTPUT_ROOT", "PID_LEROBOT_ROOT"):
        monkeypatch.setenv(name, "unset-by-test")
    for name in ("PID_LEROBOT_PUBLISH", "PID_LEROBOT_REPO_ID"):  # the defaults: publish nothing
        monkeypatch.delenv(name, raising=False)
    raw = tmp_path / "demo" / "raw"
    make_sample_source(raw / "photos", photos=("astronaut", "chelsea"), ratios=((1, 1), (16, 9)), with_problems=True)
    make_sample_source(raw / "photos-portrait", photos=("coffee",), ratios=((3, 4),), with_problems=False)
    # The demo's own dataset maker, with fewer and smaller frames: 2 cameras x 2 MP4s, 14 frames each.
    assert demo.ensure_sample_lerobot(tmp_path / "demo" / "lerobot", episode_lengths=(6, 8), episodes_per_file=1,
                                      size=(64, 48))
    assert not demo.ensure_sample_lerobot(tmp_path / "demo" / "lerobot")  # there already: left alone
    return tmp_path


def test_demo_builds_everything_and_is_idempotent(project: Path, capsys: pytest.CaptureFixture) -> None:
    assert demo.main(["--root", str(project), "--workers", "1"]) == 0
    first = capsys.readouterr().out
    assert "== photos: ok" in first and "== photos-portrait: ok" in first
    assert "unreadable_image: image" in first and "truncated" in first  # drops are shown with reasons
    assert (project / ".dagster_home" / "dagster.yaml").is_file()
    assert (project / "demo" / "out" / "catalog.json").is_file()

    # The LeRobot dataset: its sidecar built from the MP4 boxes, checked, and (publish_target none) not published.
    sidecar = project / "demo" / "out" / "lerobot" / DATASET / "mp4-sidecar.npz"
    assert sidecar.is_file() and f"   built: {sidecar}" in first
    lerobot = _section(first, f"== lerobot {DATASET}: ok")
    assert "MP4 files      4 (av01 64x48), 28 samples" in lerobot
    assert f"({sidecar.stat().st_size / 1024:.1f} KiB)" in lerobot
    assert "boxes only, no media data" in lerobot and "as int64 arrays" in lerobot
    assert "mp4_sidecar_is_valid passed (4 video files validated)" in lerobot
    assert "not published: publishing is off" in lerobot
    assert "published_sidecar_streams did not run: nothing published to read back" in lerobot

    assert demo.main(["--root", str(project), "--workers", "1"]) == 0
    again = capsys.readouterr().out
    assert again.split("\n\n", 1)[1] == first.split("\n\n", 1)[1]  # same outputs, same report
    assert f"   kept (it still matches the dataset): {sidecar}" in again

    # The runs are in the persistent instance, for the UI to show.
    with dg.DagsterInstance.from_config(str(project / ".dagster_home")) as instance:
        runs = instance.get_runs()
        assert len(runs) == 8  # (2 sources + catalog + 1 LeRobot dataset) x 2
        assert all(r.is_success for r in runs)
        # Each run carries the workspace's code location, as the UI's own runs do: it is listed
        # under its job on the Jobs and Overview pages and re-executes from the code location.
        for run in runs:
            origin = run.remote_job_origin
            assert origin is not None and origin.location_name == "pid_platform", run.run_id
            assert origin.job_name == run.job_name
        # The label the UI filters a code location's runs by.
        labelled = instance.get_runs(dg.RunsFilter(tags={".dagster/repository": "__repository__@pid_platform"}))
        assert len(labelled) == 8
        assert instance.get_dynamic_partitions("sources") == ["photos", "photos-portrait"]
        assert instance.get_dynamic_partitions("lerobot_datasets") == [DATASET]
        sidecar = dg.AssetRecordsFilter(asset_key=dg.AssetKey("mp4_sidecar"), asset_partitions=[DATASET])
        assert len(instance.fetch_materializations(sidecar, limit=10).records) == 2
        # Publishing is off in the demo: the publish is never materialized, each run observes why.
        published = dg.AssetRecordsFilter(asset_key=dg.AssetKey("published_mp4_sidecar"), asset_partitions=[DATASET])
        assert instance.fetch_materializations(published, limit=10).records == []
        notes = instance.fetch_observations(published, limit=10).records
        assert len(notes) == 2 and all(r.asset_observation.metadata["published"].value is False for r in notes)


def test_demo_exits_nonzero_when_a_build_fails(project: Path, capsys: pytest.CaptureFixture) -> None:
    (project / "demo" / "raw" / "empty-drop" / "image").mkdir(parents=True)  # no files: intake fails
    assert demo.main(["--root", str(project), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert "== empty-drop: FAILED" in out and "failed steps: sample_set" in out
    assert "== photos: ok" in out


def test_demo_exits_nonzero_when_a_sidecar_build_fails(project: Path, capsys: pytest.CaptureFixture) -> None:
    broken = project / "demo" / "lerobot" / "broken-dataset" / "meta"
    broken.mkdir(parents=True)
    (broken / "info.json").write_text("{}")  # a dataset folder, but no v3 dataset
    assert demo.main(["--root", str(project), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    failed = _section(out, "== lerobot broken-dataset: FAILED")
    # The cause by its own class name: no Dagster wrapper, no module path.
    assert "failed step mp4_sidecar: LeRobotMetaError: " in failed and "loader.lerobot" not in failed, failed
    assert "mp4_sidecar_is_valid did not run" in failed and "published_mp4_sidecar did not run" in failed
    assert f"== lerobot {DATASET}: ok" in out and "== photos: ok" in out


def _section(out: str, heading: str) -> str:
    """The block of the report that starts with ``heading`` (up to the next blank line)."""
    assert heading in out, out
    return out.split(heading, 1)[1].split("\n\n", 1)[0]
