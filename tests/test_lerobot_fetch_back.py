"""Reading a publish back (``fetch_published_sidecar``) from a real bare git repository and the Hub
STAND-IN, and holding a real streamed batch against the dataset's features (``batch_problems``).
The Dagster check built on both is tested in ``test_dagster_lerobot.py`` (git and SeaweedFS S3)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loader.lerobot.sidecar.publish_layout import SIDECAR_BRANCH, SIDECAR_DIR, PublishError
from loader.lerobot.streaming import StreamingLeRobotDataset, make_loader
from pid_platform.lerobot.fetch_back import NothingPublishedError, fetch_published_sidecar
from pid_platform.lerobot.publish import GitTarget, HubTarget, publish_sidecar
from pid_platform.lerobot.stream_check import batch_problems
from tests.support.hub_standin import HubStandIn
from tests.support.lerobot_data import CAMERAS
from tests.support.publish_data import (
    REPO_ID,
    build,
    commit_on_branch,
    dataset_files,
    git_bytes,
    serve_partial_clones,
)


@pytest.fixture
def published(tmp_path: Path, source: tuple[Path, str, Path]) -> tuple[Path, str, Path]:
    """A private copy of the source repository (serving partial clones) with the sidecar published."""
    bare = Path(shutil.copytree(source[0], tmp_path / "dataset.git"))
    serve_partial_clones(bare)
    publish_sidecar(source[2], GitTarget(str(bare)))
    return bare, source[1], source[2]


def test_git_read_back_gives_the_published_bytes(tmp_path: Path, published: tuple[Path, str, Path]) -> None:
    bare, sha, sidecar = published
    got = fetch_published_sidecar(GitTarget(f"file://{bare}"), sha, tmp_path / "back" / "sc.npz")
    assert got == tmp_path / "back" / "sc.npz" and got.read_bytes() == sidecar.read_bytes()


def test_git_read_back_of_nothing_says_so(tmp_path: Path, source: tuple[Path, str, Path],
                                          published: tuple[Path, str, Path]) -> None:
    unpublished = Path(shutil.copytree(source[0], tmp_path / "plain.git"))
    with pytest.raises(NothingPublishedError, match=f"has no branch {SIDECAR_BRANCH}"):
        fetch_published_sidecar(GitTarget(str(unpublished)), source[1], tmp_path / "a.npz")
    other = "0123456789abcdef0123456789abcdef01234567"
    with pytest.raises(NothingPublishedError, match=f"has no {SIDECAR_DIR}/{other}.json"):
        fetch_published_sidecar(GitTarget(str(published[0])), other, tmp_path / "b.npz")
    assert not (tmp_path / "a.npz").exists() and not (tmp_path / "b.npz").exists()


def test_git_read_back_refuses_a_pointer_outside_or_a_short_npz(tmp_path: Path,
                                                                  published: tuple[Path, str, Path]) -> None:
    bare, sha, _ = published
    pointer_rel = f"{SIDECAR_DIR}/{sha}.json"
    pointer = json.loads(git_bytes(bare, SIDECAR_BRANCH, pointer_rel))
    outside = json.dumps({**pointer, "sidecar": "../../meta/info.json"}).encode()
    commit_on_branch(bare, SIDECAR_BRANCH, {pointer_rel: outside}, "a pointer out of its folder")
    with pytest.raises(PublishError, match="not a sidecar file beside it"):
        fetch_published_sidecar(GitTarget(str(bare)), sha, tmp_path / "a.npz")

    npz_rel = f"{SIDECAR_DIR}/{sha}.npz"
    short = git_bytes(bare, SIDECAR_BRANCH, npz_rel)[:-10]
    commit_on_branch(bare, SIDECAR_BRANCH, {pointer_rel: json.dumps(pointer).encode(), npz_rel: short}, "cut")
    with pytest.raises(PublishError, match=f"{len(short)} bytes, the pointer says {pointer['sha256']} and "
                                           f"{pointer['size']}"):
        fetch_published_sidecar(GitTarget(str(bare)), sha, tmp_path / "b.npz")
    assert not (tmp_path / "a.npz").exists() and not (tmp_path / "b.npz").exists()


def test_hub_standin_read_back(tmp_path: Path, hub_standin: HubStandIn, lerobot_v3_root: Path) -> None:  # noqa: F811
    sha = hub_standin.add_dataset(REPO_ID, dataset_files(lerobot_v3_root), message="LeRobot v3 dataset")
    target = HubTarget(REPO_ID, endpoint=hub_standin.endpoint, token=hub_standin.token)
    with pytest.raises(NothingPublishedError, match=f"no {SIDECAR_DIR}/{sha}.json"):
        fetch_published_sidecar(target, sha, tmp_path / "none.npz")
    sidecar = build(lerobot_v3_root, tmp_path / "sc.npz", revision=sha)
    publish_sidecar(sidecar, target)
    assert fetch_published_sidecar(target, sha, tmp_path / "back.npz").read_bytes() == sidecar.read_bytes()


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory, lerobot_v3_root: Path) -> tuple[dict, dict]:  # noqa: F811
    """(one real batch of 4 from the AV1 dataset, the dataset's features)."""
    tmp = tmp_path_factory.mktemp("stream-batch")
    ds = StreamingLeRobotDataset(REPO_ID, root=str(lerobot_v3_root), sidecar_cache_root=tmp / "sc",
                                 index_cache_root=tmp / "ix")
    batches = iter(make_loader(ds, batch_size=4))
    batch = next(batches)
    batches.close()
    return batch, ds.meta.features


def test_a_real_batch_matches_its_features(streamed: tuple[dict, dict]) -> None:
    batch, features = streamed
    assert batch_problems(batch, features, 4) == []
    assert batch_problems(batch, features, 3) != []  # the count is held too


def test_batch_problems_name_the_key_and_what_was_expected(streamed: tuple[dict, dict]) -> None:
    batch, features = streamed
    camera = CAMERAS[0]
    as_uint8 = {**batch, camera: (batch[camera] * 255).round().to(torch.uint8)}
    assert batch_problems(as_uint8, features, 4) == [
        f"{camera}: expected (4, 3, 48, 64) torch.float32, got (4, 3, 48, 64) uint8 (feature video [48, 64, 3])"]
    hwc = {**batch, camera: batch[camera].permute(0, 2, 3, 1)}
    assert batch_problems(hwc, features, 4)[0].startswith(f"{camera}: expected (4, 3, 48, 64) torch.float32, "
                                                          "got (4, 48, 64, 3) float32")
    bright = {**batch, camera: batch[camera] * 2 + 0.1}
    assert batch_problems(bright, features, 4)[0].startswith(f"{camera}: pixel values ")
    state = {**batch, "observation.state": batch["observation.state"].double()}
    assert batch_problems(state, features, 4)[0].startswith("observation.state: expected (4, ")
    missing = {k: v for k, v in batch.items() if k not in ("index", "task")}
    assert batch_problems(missing, features, 4)[:1] == [
        f"features ['index'] are missing from the batch (keys: {sorted(missing)})"]
    assert batch_problems(missing, features, 4)[1].startswith("task: expected 4 strings, got NoneType")
