"""The main job (``pid-demo``) against a persistent instance in a temporary project folder.

The demo builds whatever sources are under ``demo/raw`` and only makes its sample sources when
they are missing, so small ones are put there first to keep this fast.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from pid_platform import demo
from pid_platform.sample_data import make_sample_source


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The demo sets these for its own process; monkeypatch puts the old values back afterwards.
    for name in ("DAGSTER_HOME", "PID_RAW_ROOT", "PID_OUTPUT_ROOT"):
        monkeypatch.setenv(name, "unset-by-test")
    raw = tmp_path / "demo" / "raw"
    make_sample_source(raw / "photos", photos=("astronaut", "chelsea"), ratios=((1, 1), (16, 9)), with_problems=True)
    make_sample_source(raw / "photos-portrait", photos=("coffee",), ratios=((3, 4),), with_problems=False)
    return tmp_path


def test_demo_builds_everything_and_is_idempotent(project: Path, capsys: pytest.CaptureFixture) -> None:
    assert demo.main(["--root", str(project), "--workers", "1"]) == 0
    first = capsys.readouterr().out
    assert "== photos: ok" in first and "== photos-portrait: ok" in first
    assert "unreadable_image: image" in first and "truncated" in first  # drops are shown with reasons
    assert (project / ".dagster_home" / "dagster.yaml").is_file()
    assert (project / "demo" / "out" / "catalog.json").is_file()

    assert demo.main(["--root", str(project), "--workers", "1"]) == 0
    again = capsys.readouterr().out
    assert again.split("\n\n", 1)[1] == first.split("\n\n", 1)[1]  # same outputs, same report

    # The runs are in the persistent instance, for the UI to show.
    with dg.DagsterInstance.from_config(str(project / ".dagster_home")) as instance:
        runs = instance.get_runs()
        assert len(runs) == 6  # (2 sources + catalog) x 2
        assert all(r.is_success for r in runs)
        assert instance.get_dynamic_partitions("sources") == ["photos", "photos-portrait"]


def test_demo_exits_nonzero_when_a_build_fails(project: Path, capsys: pytest.CaptureFixture) -> None:
    (project / "demo" / "raw" / "empty-drop" / "image").mkdir(parents=True)  # no files: intake fails
    assert demo.main(["--root", str(project), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert "== empty-drop: FAILED" in out and "failed steps: sample_set" in out
    assert "== photos: ok" in out
