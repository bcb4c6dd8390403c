"""Shared fixtures. Real servers live in tests/support/ and are registered here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pid_platform.demo.sample_data import make_sample_source

pytest_plugins = [
    "tests.support.leaks",  # fails the run if a process the suite started outlives it
    "tests.support.scheduling",  # fails a test that leaves this process under real-time scheduling
    "tests.support.seaweedfs",
    "tests.support.paused_procs",  # `procs`: real processes held at pause points
    "tests.support.http_server",
    "tests.support.fault_proxy",
    "tests.support.forward_proxy",  # `forward_proxy`: what HTTP_PROXY names
    "tests.support.lerobot_data",
    "tests.support.hub_standin",
    "tests.support.dagster_runs",
    "tests.support.publish_data",  # `source`: a bare git repo holding the dataset, and its sidecar
    "pytester",  # `pytester`: runs a suite of its own (tests/test_encoder_scheduling.py)
]

# Four photographs x eight aspect ratios: every bucket gets real pictures, and it builds fast.
TEST_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")
SOURCE = "photos"


@pytest.fixture(scope="session")
def photo_drop_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A raw root holding one clean source, ``photos``, made once per session (read-only use)."""
    root = tmp_path_factory.mktemp("raw-template")
    make_sample_source(root / SOURCE, photos=TEST_PHOTOS, with_problems=False)
    return root


@pytest.fixture
def raw_root(tmp_path: Path, photo_drop_template: Path) -> Path:
    """A private copy of the template raw root, safe to modify: ``raw_root / "photos" / "image"``..."""
    dst = tmp_path / "raw"
    shutil.copytree(photo_drop_template, dst)
    return dst
