"""Publishing complete MP4 sidecars: to a real bare git repository, to an S3 bucket on a real
SeaweedFS server, and to a Hugging Face Hub STAND-IN (a local server, not the Hub; see
``tests/support/hub_standin.py``). Sidecars are real: built by the loader from a v3 dataset with
real encoded video."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from loader.io import StreamConfig, open_url
from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.sidecar import ensure_sidecar, read_sidecar, validate_sidecar
from loader.lerobot.sidecar.publish_layout import SIDECAR_BRANCH, SIDECAR_DIR
from loader.lerobot.sidecar.published import fetch_published, published_home
from pid_platform.lerobot.publish import (
    GitTarget,
    HubTarget,
    PublishError,
    S3Target,
    SubsetSidecarError,
    parse_target,
    publish_sidecar,
)
from tests.support.fault_proxy import cut_request
from tests.support.hub_standin import HubStandIn
from tests.support.publish_data import (
    REPO_ID,
    add_commit,
    build,
    dataset_files,
    git,
    git_bytes,
    refs,
    touch_video,
)
from tests.support.s3_objects import S3Requests
from tests.support.seaweedfs import upload_to_new_bucket

BRANCH_REF = f"refs/heads/{SIDECAR_BRANCH}"


@pytest.fixture
def repo(tmp_path: Path, source: tuple[Path, str, Path]) -> Path:
    """A private copy of the source repository, safe to push to."""
    return Path(shutil.copytree(source[0], tmp_path / "dataset.git"))


# -- git ---------------------------------------------------------------------------------------

def test_git_publish_branches_from_the_pinned_commit_and_leaves_main_alone(
    repo: Path, source: tuple[Path, str, Path], lerobot_v3_root: Path,  # noqa: F811
) -> None:
    _, sha, sidecar = source
    before = refs(repo)
    result = publish_sidecar(sidecar, GitTarget(str(repo)))

    after = refs(repo)
    assert after["refs/heads/main"] == before["refs/heads/main"] == sha  # the source branch never moves
    assert set(after) == {"refs/heads/main", BRANCH_REF}
    assert (result.commit, result.parent, result.unchanged) == (after[BRANCH_REF], sha, False)
    assert git("rev-list", "--parents", "-n1", SIDECAR_BRANCH, cwd=repo).split() == [result.commit, sha]
    assert git("log", "-1", "--format=%an <%ae>|%cn <%ce>", SIDECAR_BRANCH, cwd=repo) == (
        "pid-platform <pid-platform@localhost>|pid-platform <pid-platform@localhost>")

    # The branch is the dataset at that commit plus exactly the two sidecar files.
    changed = git("diff", "--name-only", sha, SIDECAR_BRANCH, cwd=repo).splitlines()
    assert changed == [f"{SIDECAR_DIR}/{sha}.json", f"{SIDECAR_DIR}/{sha}.npz"]
    assert git_bytes(repo, SIDECAR_BRANCH, f"{SIDECAR_DIR}/{sha}.npz") == sidecar.read_bytes()
    pointer = json.loads(git_bytes(repo, SIDECAR_BRANCH, f"{SIDECAR_DIR}/{sha}.json"))
    with read_sidecar(sidecar) as sc:
        samples = sum(f["sample_count"] for f in sc.manifest["files"])
        files = len(sc.files)
    assert pointer == {
        "format": "lerobot-mp4-sidecar-pointer", "pointer_version": 1, "sidecar": f"{sha}.npz",
        "sha256": result.sha256, "size": sidecar.stat().st_size, "schema_version": 3, "repo_id": REPO_ID,
        "revision": sha, "files": files, "samples": samples, "subset": False,
    }
    assert files == 4 and samples == 2 * sum((6, 9, 12, 7, 10))

    # What a reader checks out is still valid for the dataset it sits beside.
    out = repo.parent / "checked-out.npz"
    out.write_bytes(git_bytes(repo, result.commit, f"{SIDECAR_DIR}/{sha}.npz"))
    assert validate_sidecar(out, LeRobotMeta.load(str(lerobot_v3_root)), revision=sha, require_complete=True) == []


def test_git_republish_adds_a_commit_on_the_previous_sidecar_commit(
    tmp_path: Path, repo: Path, source: tuple[Path, str, Path], lerobot_v3_root: Path,  # noqa: F811
) -> None:
    _, sha, sidecar = source
    first = publish_sidecar(sidecar, GitTarget(f"file://{repo}"))
    # Same revision, a video rewritten in place: the new sidecar's fingerprints differ.
    changed = Path(shutil.copytree(lerobot_v3_root, tmp_path / "ds"))
    touch_video(changed)
    rebuilt = build(changed, tmp_path / "rebuilt.npz", revision=sha)
    assert rebuilt.read_bytes() != sidecar.read_bytes()

    second = publish_sidecar(rebuilt, GitTarget(f"file://{repo}"))
    assert (second.parent, second.unchanged) == (first.commit, False)
    assert git("rev-list", "--parents", "-n1", SIDECAR_BRANCH, cwd=repo).split() == [second.commit, first.commit]
    assert git_bytes(repo, SIDECAR_BRANCH, f"{SIDECAR_DIR}/{sha}.npz") == rebuilt.read_bytes()
    assert refs(repo)["refs/heads/main"] == sha

    # Publishing the same bytes again (a retry) changes nothing.
    again = publish_sidecar(rebuilt, GitTarget(str(repo)))
    assert (again.commit, again.parent, again.unchanged) == (second.commit, first.commit, True)
    assert refs(repo)[BRANCH_REF] == second.commit


def test_git_publish_for_a_newer_revision_keeps_both_sidecars(
    tmp_path: Path, repo: Path, source: tuple[Path, str, Path], lerobot_v3_root: Path,  # noqa: F811
) -> None:
    _, sha, sidecar = source
    first = publish_sidecar(sidecar, GitTarget(str(repo)))
    newer = add_commit(repo, {"README.md": b"# a newer version of the dataset\n"}, "Add a README")
    second = publish_sidecar(build(lerobot_v3_root, tmp_path / "newer.npz", revision=newer), GitTarget(str(repo)))
    assert second.parent == first.commit
    assert refs(repo)["refs/heads/main"] == newer
    names = git("ls-tree", "--name-only", f"{SIDECAR_BRANCH}:{SIDECAR_DIR}", cwd=repo).splitlines()
    assert names == sorted([f"{sha}.json", f"{sha}.npz", f"{newer}.json", f"{newer}.npz"])


def test_git_refuses_a_subset_sidecar_and_pushes_nothing(
    tmp_path: Path, repo: Path, source: tuple[Path, str, Path], lerobot_v3_root: Path,  # noqa: F811
) -> None:
    subset = build(lerobot_v3_root, tmp_path / "subset.npz", revision=source[1], episodes=[0, 3])
    with pytest.raises(SubsetSidecarError, match=r"episodes \[0, 3\].*without --episodes"):
        publish_sidecar(subset, GitTarget(str(repo)))
    assert BRANCH_REF not in refs(repo)


@pytest.mark.parametrize(
    ("revision", "message"),
    [
        ("0123456789abcdef0123456789abcdef01234567", "is not a commit of"),
        (None, "full 40-character commit SHA"),
        ("main", "full 40-character commit SHA"),
    ],
)
def test_git_needs_a_full_sha_that_the_repository_has(
    tmp_path: Path, repo: Path, lerobot_v3_root: Path, revision: str | None, message: str,  # noqa: F811
) -> None:
    sidecar = build(lerobot_v3_root, tmp_path / "sc.npz", revision=revision)
    with pytest.raises(PublishError, match=message):
        publish_sidecar(sidecar, GitTarget(str(repo)))
    assert BRANCH_REF not in refs(repo)


def test_publish_refuses_another_revision_than_the_sidecar_indexes(
    repo: Path, source: tuple[Path, str, Path],
) -> None:
    with pytest.raises(PublishError, match="was built for revision"):
        publish_sidecar(source[2], GitTarget(str(repo)), revision="f" * 40)


def test_git_errors_name_the_repository_without_its_credentials(tmp_path: Path, source: tuple[Path, str, Path]) -> None:
    missing = f"file://user:s3cret-token@{tmp_path}/nowhere.git"
    with pytest.raises(PublishError) as err:
        publish_sidecar(source[2], GitTarget(missing))
    assert "s3cret-token" not in str(err.value) and "nowhere.git" in str(err.value)


# -- S3 bucket (real SeaweedFS) ---------------------------------------------------------------

@pytest.fixture
def s3_dataset(s3_env, lerobot_v3_root: Path) -> str:  # noqa: F811
    """The v3 dataset uploaded to a fresh bucket: its ``s3://`` root."""
    return upload_to_new_bucket(s3_env, lerobot_v3_root, f"lerobot-{uuid.uuid4().hex[:12]}", "datasets/av1")


def test_s3_publish_uploads_the_npz_first_and_the_pointer_last(tmp_path: Path, s3_env, s3_dataset: str) -> None:
    meta = LeRobotMeta.load(s3_dataset)
    sidecar = tmp_path / "sc.npz"
    build_args = dict(repo_id=REPO_ID, revision="v1", data_root=s3_dataset)
    from loader.lerobot.sidecar import build_sidecar

    build_sidecar(meta, sidecar, **build_args)
    with S3Requests() as requests:
        result = publish_sidecar(sidecar, parse_target(s3_dataset))

    prefix = s3_dataset.removeprefix(f"s3://{s3_dataset.split('/')[2]}/")
    data_key = f"{prefix}/{SIDECAR_DIR}/v1.{result.sha256[:16]}.npz"
    pointer_key = f"{prefix}/{SIDECAR_DIR}/v1.json"
    writes = requests.ops("PutObject", "CreateMultipartUpload", "DeleteObject")
    assert writes == [("PutObject", data_key), ("PutObject", pointer_key)]
    assert result.sidecar_url.endswith(data_key) and result.pointer_url.endswith(pointer_key)

    # Read back the way training would: pointer -> NPZ -> sha256 -> valid for the bucket's dataset.
    fetched = fetch_published(published_home(REPO_ID, s3_dataset), "v1", tmp_path / "fetched.npz")
    assert fetched is not None and fetched.read_bytes() == sidecar.read_bytes()
    assert validate_sidecar(fetched, meta, revision="v1", require_complete=True) == []
    cache = tmp_path / "cache"
    installed = ensure_sidecar(meta, repo_id=REPO_ID, revision="v1", cache_root=cache,
                               published=lambda: fetch_published(s3_dataset, "v1", tmp_path / "dl.npz"))
    assert Path(installed).read_bytes() == sidecar.read_bytes()


def test_s3_republish_switches_the_pointer_and_keeps_one_previous_generation(
    tmp_path: Path, s3_env, s3_dataset: str, lerobot_v3_root: Path,  # noqa: F811
) -> None:
    target = S3Target(s3_dataset)
    bucket = target.bucket
    generations = []
    for i in range(3):
        ds = Path(shutil.copytree(lerobot_v3_root, tmp_path / f"ds{i}"))  # new ctimes: new bytes
        generations.append(publish_sidecar(build(ds, tmp_path / f"sc{i}.npz", revision="v1"), target))
    assert len({g.sha256 for g in generations}) == 3
    keys = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket, Prefix=f"datasets/av1/{SIDECAR_DIR}/")["Contents"]}
    names = {k.rsplit("/", 1)[-1] for k in keys}
    # The current NPZ, the one a reader of the previous pointer may still be fetching, the pointer.
    assert names == {f"v1.{generations[2].sha256[:16]}.npz", f"v1.{generations[1].sha256[:16]}.npz", "v1.json"}
    pointer = json.loads(s3_env.client().get_object(Bucket=bucket, Key=f"datasets/av1/{SIDECAR_DIR}/v1.json")["Body"].read())
    assert pointer["sha256"] == generations[2].sha256

    # The same bytes again: nothing is written.
    with S3Requests() as requests:
        again = publish_sidecar(tmp_path / "sc2.npz", target)
    assert again.unchanged and not requests.ops("PutObject", "DeleteObject")


def test_s3_failed_upload_leaves_the_previous_pointer(
    tmp_path: Path, s3_env, s3_dataset: str, lerobot_v3_root: Path, fault_proxy,  # noqa: F811
) -> None:
    target = S3Target(s3_dataset)
    good = publish_sidecar(build(lerobot_v3_root, tmp_path / "good.npz", revision="v1"), target)
    # Every connection through the proxy is reset as the NPZ's PUT starts (each of botocore's
    # retries too): the upload never reaches the server, whatever else goes through.
    proxy = fault_proxy(s3_env.endpoint_url, [cut_request(rb"PUT \S*\.npz")] * 50)
    ds = Path(shutil.copytree(lerobot_v3_root, tmp_path / "ds"))
    with pytest.raises(PublishError, match="npz"):
        publish_sidecar(build(ds, tmp_path / "bad.npz", revision="v1"), S3Target(s3_dataset, endpoint_url=proxy.url))
    assert proxy.fired["cut_request"] >= 1, proxy.fired
    pointer = json.loads(s3_env.client().get_object(Bucket=target.bucket, Key=f"datasets/av1/{SIDECAR_DIR}/v1.json")["Body"].read())
    assert pointer["sha256"] == good.sha256


def test_s3_refuses_a_subset_sidecar(tmp_path: Path, s3_env, s3_dataset: str, lerobot_v3_root: Path) -> None:  # noqa: F811
    subset = build(lerobot_v3_root, tmp_path / "subset.npz", revision="v1", episodes=[1])
    with pytest.raises(SubsetSidecarError):
        publish_sidecar(subset, S3Target(s3_dataset))
    bucket = S3Target(s3_dataset).bucket
    assert "Contents" not in s3_env.client().list_objects_v2(Bucket=bucket, Prefix=f"datasets/av1/{SIDECAR_DIR}/")


# -- Hugging Face Hub: against the local STAND-IN server (not the real Hub) ---------------------

@pytest.fixture
def standin_dataset(hub_standin: HubStandIn, lerobot_v3_root: Path) -> str:  # noqa: F811
    """The v3 dataset as a dataset repo on the Hub stand-in; the commit of its ``main``."""
    return hub_standin.add_dataset(REPO_ID, dataset_files(lerobot_v3_root), message="LeRobot v3 dataset")


def test_hub_standin_publish_creates_the_branch_from_the_pinned_commit(
    tmp_path: Path, hub_standin: HubStandIn, standin_dataset: str, lerobot_v3_root: Path,  # noqa: F811
) -> None:
    sha = standin_dataset
    sidecar = build(lerobot_v3_root, tmp_path / "sc.npz", revision=sha)
    target = HubTarget(REPO_ID, endpoint=hub_standin.endpoint, token=hub_standin.token)
    result = publish_sidecar(sidecar, target)

    assert hub_standin.branches(REPO_ID) == {"main": sha, SIDECAR_BRANCH: result.commit}
    log = hub_standin.log(REPO_ID, SIDECAR_BRANCH)
    assert [c.oid for c in log] == [result.commit, sha] and result.parent == sha
    files = hub_standin.files(REPO_ID, SIDECAR_BRANCH)
    assert set(files) - set(hub_standin.files(REPO_ID, sha)) == {f"{SIDECAR_DIR}/{sha}.npz", f"{SIDECAR_DIR}/{sha}.json"}
    assert files[f"{SIDECAR_DIR}/{sha}.npz"] == sidecar.read_bytes()
    # Only the endpoints the stand-in implements were needed (anything else answers 501).
    assert hub_standin.failed_calls() == []
    assert hub_standin.paths_called() == {
        ("GET", "info"), ("GET", "refs"), ("POST", "create_branch"), ("POST", "preupload"), ("POST", "commit"),
    }

    # Training's read path: hf:// through the loader, pointer first, checked, then valid.
    assert result.sidecar_url == f"hf://datasets/{REPO_ID}@{SIDECAR_BRANCH}/{SIDECAR_DIR}/{sha}.npz"
    with open_url(result.sidecar_url, config=StreamConfig(hf_endpoint=hub_standin.endpoint)) as fh:
        assert fh.read() == sidecar.read_bytes()
    home = published_home(REPO_ID, f"hf://datasets/{REPO_ID}@{sha}")
    fetched = fetch_published(home, sha, tmp_path / "fetched.npz")
    assert fetched is not None and fetched.read_bytes() == sidecar.read_bytes()
    assert validate_sidecar(fetched, LeRobotMeta.load(str(lerobot_v3_root)), revision=sha) == []


def test_hub_standin_republish_stacks_on_the_previous_sidecar_commit(
    tmp_path: Path, hub_standin: HubStandIn, standin_dataset: str, lerobot_v3_root: Path,  # noqa: F811
) -> None:
    sha = standin_dataset
    target = HubTarget(REPO_ID, endpoint=hub_standin.endpoint, token=hub_standin.token)
    first = publish_sidecar(build(lerobot_v3_root, tmp_path / "a.npz", revision=sha), target)
    changed = Path(shutil.copytree(lerobot_v3_root, tmp_path / "ds"))
    touch_video(changed)
    second = publish_sidecar(build(changed, tmp_path / "b.npz", revision=sha), target)
    assert (second.parent, second.unchanged) == (first.commit, False)
    assert [c.oid for c in hub_standin.log(REPO_ID, SIDECAR_BRANCH)] == [second.commit, first.commit, sha]
    again = publish_sidecar(tmp_path / "b.npz", target)
    assert (again.commit, again.unchanged) == (second.commit, True)
    # A newer dataset version on main: its sidecar joins the same branch; main is never written.
    newer = hub_standin.commit_files(REPO_ID, "main", {"README.md": b"# v2\n"}, "dataset v2")
    third = publish_sidecar(build(lerobot_v3_root, tmp_path / "c.npz", revision=newer), target)
    assert third.parent == second.commit
    assert hub_standin.branches(REPO_ID) == {"main": newer, SIDECAR_BRANCH: third.commit}
    assert {f"{SIDECAR_DIR}/{sha}.npz", f"{SIDECAR_DIR}/{newer}.npz"} <= set(hub_standin.files(REPO_ID, SIDECAR_BRANCH))


@pytest.mark.parametrize(
    ("revision", "token", "message"),
    [
        ("main", None, "full 40-character commit SHA"),
        ("0123456789abcdef0123456789abcdef01234567", None, "revision not found"),
        (None, "not-the-token", "401"),
    ],
)
def test_hub_standin_refusals(
    tmp_path: Path, hub_standin: HubStandIn, standin_dataset: str, lerobot_v3_root: Path,  # noqa: F811
    revision: str | None, token: str | None, message: str,
) -> None:
    sidecar = build(lerobot_v3_root, tmp_path / "sc.npz", revision=revision or standin_dataset)
    target = HubTarget(REPO_ID, endpoint=hub_standin.endpoint, token=token or hub_standin.token)
    with pytest.raises(PublishError, match=message):
        publish_sidecar(sidecar, target)
    assert SIDECAR_BRANCH not in hub_standin.branches(REPO_ID)


def test_hub_standin_refuses_a_subset_before_any_request(
    tmp_path: Path, hub_standin: HubStandIn, standin_dataset: str, lerobot_v3_root: Path,  # noqa: F811
) -> None:
    subset = build(lerobot_v3_root, tmp_path / "subset.npz", revision=standin_dataset, episodes=[2])
    with pytest.raises(SubsetSidecarError):
        publish_sidecar(subset, HubTarget(REPO_ID, endpoint=hub_standin.endpoint, token=hub_standin.token))
    assert hub_standin.paths_called() == set()


def test_parse_target() -> None:
    assert parse_target("git:/srv/ds.git") == GitTarget("/srv/ds.git")
    assert parse_target("s3://b/p", s3_endpoint_url="http://x") == S3Target("s3://b/p", "http://x")
    assert parse_target("hub", repo_id="o/n") == HubTarget("o/n")
    assert parse_target("hub:o/m", hub_endpoint="http://h") == HubTarget("o/m", endpoint="http://h")
    for bad in ("git:", "hub", "ftp://x", "s3://user:pw@b/p"):
        with pytest.raises(PublishError):
            parse_target(bad)
