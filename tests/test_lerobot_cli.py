"""``pid-build-mp4-sidecar``: builds through the loader, shows progress, and pushes only complete
sidecars (to a real bare git repo, a real SeaweedFS bucket, and the Hub STAND-IN server)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.sidecar import read_sidecar, validate_sidecar
from loader.lerobot.sidecar.publish_layout import SIDECAR_BRANCH, SIDECAR_DIR
from pid_platform.lerobot.cli import main
from tests.support.hub_standin import HubStandIn
from tests.support.publish_data import (
    REPO_ID,
    dataset_files,
    git_bytes,
    make_source_repo,
    refs,
)
from tests.support.seaweedfs import upload_tree

CLI = str(Path(sys.executable).parent / "pid-build-mp4-sidecar")
SHA = "0123456789abcdef0123456789abcdef01234567"


def _args(root: Path | str, out: Path, revision: str = SHA, *extra: str) -> list[str]:
    return ["--repo-id", REPO_ID, "--revision", revision, "--data-root", str(root), "--output", str(out), *extra]


def test_console_script_builds_a_valid_sidecar_with_a_progress_bar(tmp_path: Path, lerobot_v3_root: Path) -> None:  # noqa: F811
    out = tmp_path / "sc.npz"
    res = subprocess.run([CLI, *_args(lerobot_v3_root, out, SHA, "--workers", "2")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"{REPO_ID}@{SHA} -> {out}" in res.stdout
    assert "complete: 4 MP4 files, 88 samples" in res.stdout
    assert "indexing MP4" in res.stderr and "4/4" in res.stderr  # tqdm writes to stderr
    with read_sidecar(out) as sc:
        assert (sc.manifest["repo_id"], sc.manifest["revision"], sc.manifest["subset"]) == (REPO_ID, SHA, False)
    assert validate_sidecar(out, LeRobotMeta.load(str(lerobot_v3_root)), require_complete=True) == []


def test_episodes_build_a_subset_sidecar(tmp_path: Path, lerobot_v3_root: Path, capsys) -> None:  # noqa: F811
    out = tmp_path / "subset.npz"
    assert main(_args(lerobot_v3_root, out, SHA, "--episodes", "0", "4")) == 0
    assert "subset (episodes [0, 4]): 4 MP4 files" in capsys.readouterr().out  # ep 0 in file 0, ep 4 in file 1
    assert main(_args(lerobot_v3_root, out, SHA, "--episodes", "1")) == 0
    with read_sidecar(out) as sc:
        assert sc.manifest["subset"] and sc.manifest["episodes"] == [1]
        assert len(sc.files) == 2  # one MP4 per camera holds episode 1


def test_push_of_a_subset_is_refused_before_anything_is_built(tmp_path: Path, lerobot_v3_root: Path, capsys) -> None:  # noqa: F811
    bare, sha = make_source_repo(tmp_path, lerobot_v3_root)
    out = tmp_path / "sc.npz"
    code = main(_args(lerobot_v3_root, out, sha, "--episodes", "0", "--push", "--push-target", f"git:{bare}"))
    assert code == 2
    assert "complete sidecars only" in capsys.readouterr().err
    assert not out.exists() and set(refs(bare)) == {"refs/heads/main"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--push", "--push-target", "hub"], "needs a pinned --revision"),
        (["--push", "--push-target", "git:/srv/ds.git"], "needs a pinned --revision"),
        (["--push"], "give --push-target"),
        (["--push-target", "hub"], "only used with --push"),
        (["--push", "--push-target", "ftp://x"], "unknown push target"),
    ],
)
def test_push_argument_errors_exit_2(tmp_path: Path, lerobot_v3_root: Path, capsys, extra: list[str],  # noqa: F811
                                     message: str) -> None:
    out = tmp_path / "sc.npz"
    assert main(_args(lerobot_v3_root, out, "main", *extra)) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_a_failed_build_exits_1_with_the_reason(tmp_path: Path, capsys) -> None:
    assert main(_args(tmp_path / "not-a-dataset", tmp_path / "sc.npz")) == 1
    assert "meta/info.json" in capsys.readouterr().err


def test_push_to_a_git_repository(tmp_path: Path, lerobot_v3_root: Path, capsys) -> None:  # noqa: F811
    bare, sha = make_source_repo(tmp_path, lerobot_v3_root)
    out = tmp_path / "sc.npz"
    assert main(_args(lerobot_v3_root, out, sha, "--push", "--push-target", f"git:{bare}")) == 0
    after = refs(bare)
    assert after["refs/heads/main"] == sha and f"refs/heads/{SIDECAR_BRANCH}" in after
    assert git_bytes(bare, SIDECAR_BRANCH, f"{SIDECAR_DIR}/{sha}.npz") == out.read_bytes()
    text = capsys.readouterr().out
    assert f"published: git:{bare}#{SIDECAR_BRANCH}" in text and f"(parent {sha})" in text


def test_push_defaults_to_the_bucket_root_of_an_s3_dataset(tmp_path: Path, s3_env, lerobot_v3_root: Path, capsys) -> None:  # noqa: F811
    bucket = s3_env.make_bucket(f"lerobot-cli-{uuid.uuid4().hex[:10]}")
    upload_tree(s3_env.client(), lerobot_v3_root, bucket, "ds")
    root = f"s3://{bucket}/ds"
    assert main(_args(root, tmp_path / "sc.npz", "v1", "--push")) == 0
    assert f"published: {root}" in capsys.readouterr().out
    body = s3_env.client().get_object(Bucket=bucket, Key=f"ds/{SIDECAR_DIR}/v1.json")["Body"].read()
    assert b'"revision": "v1"' in body


def test_push_of_an_hf_dataset_goes_to_the_hub_standin(tmp_path: Path, hub_standin: HubStandIn,  # noqa: F811
                                                       lerobot_v3_root: Path, capsys) -> None:  # noqa: F811
    """Read the dataset through hf:// from the Hub STAND-IN, build, push back to its branch."""
    sha = hub_standin.add_dataset(REPO_ID, dataset_files(lerobot_v3_root))
    out = tmp_path / "sc.npz"
    assert main(_args(f"hf://datasets/{REPO_ID}@{sha}", out, sha, "--push")) == 0, capsys.readouterr().err
    branches = hub_standin.branches(REPO_ID)
    assert branches["main"] == sha
    assert hub_standin.log(REPO_ID, SIDECAR_BRANCH)[0].parent == sha
    assert hub_standin.files(REPO_ID, SIDECAR_BRANCH)[f"{SIDECAR_DIR}/{sha}.npz"] == out.read_bytes()
    with read_sidecar(out) as sc:
        # Fingerprints come from the stand-in's ETags, and the stored root names the pinned commit.
        assert sc.manifest["data_root"] == f"hf://datasets/{REPO_ID}@{sha}"
        assert all(f["fingerprint"].startswith("etag:") for f in sc.manifest["files"])
    # The only misses are the probes for the next meta/episodes file (the Hub cannot list).
    assert {(c.path, c.status) for c in hub_standin.failed_calls()} <= {("resolve", 404)}
