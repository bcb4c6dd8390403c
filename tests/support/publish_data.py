"""Helpers shared by the LeRobot publish, CLI and Dagster tests (this module holds no tests).

Real parts only: datasets are written by ``tests.support.lerobot_data`` (real encoded video),
sidecars are built by ``loader.lerobot.sidecar``, git repositories are real bare repositories
made with ``git init --bare`` and filled by a real commit and push.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.sidecar import build_sidecar

REPO_ID = "pid-tests/lerobot-av1"
# A person's commit, not ours: the publisher must set its own identity whatever the environment says.
_PERSON = {"GIT_AUTHOR_NAME": "Dataset Owner", "GIT_AUTHOR_EMAIL": "owner@example.org",
           "GIT_COMMITTER_NAME": "Dataset Owner", "GIT_COMMITTER_EMAIL": "owner@example.org"}


def git(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **_PERSON, **(env or {})}, timeout=60)
    assert proc.returncode == 0, f"git {' '.join(args)}: {proc.stderr}"
    return proc.stdout.strip()


def git_bytes(bare: Path, rev: str, path: str) -> bytes:
    return subprocess.run(["git", "cat-file", "blob", f"{rev}:{path}"], cwd=bare, capture_output=True,
                          check=True).stdout


def refs(bare: Path) -> dict[str, str]:
    """Every ref of a repository -> its commit."""
    out = git("for-each-ref", "--format=%(refname) %(objectname)", cwd=bare)
    return dict(line.split(" ") for line in out.splitlines())


def make_source_repo(tmp: Path, dataset: Path, name: str = "dataset.git") -> tuple[Path, str]:
    """A bare repository whose ``main`` holds ``dataset``'s files in one commit; (path, commit)."""
    bare = tmp / name
    work = tmp / f"{name}-work"
    git("init", "--quiet", "--bare", "--initial-branch=main", str(bare))
    shutil.copytree(dataset, work)
    git("init", "--quiet", "--initial-branch=main", cwd=work)
    git("add", "--all", cwd=work)
    git("commit", "--quiet", "-m", "LeRobot v3 dataset", cwd=work)
    git("push", "--quiet", str(bare), "HEAD:refs/heads/main", cwd=work)
    return bare, git("rev-parse", "HEAD", cwd=work)


def add_commit(bare: Path, files: dict[str, bytes], message: str) -> str:
    """Someone else's next commit on ``main`` (a newer dataset version); its SHA."""
    work = bare.parent / f"{bare.name}-next"
    if not work.exists():
        git("clone", "--quiet", str(bare), str(work))
    git("pull", "--quiet", cwd=work)
    for rel, data in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(data)
    git("add", "--all", cwd=work)
    git("commit", "--quiet", "-m", message, cwd=work)
    git("push", "--quiet", "origin", "HEAD:refs/heads/main", cwd=work)
    return git("rev-parse", "HEAD", cwd=work)


def build(dataset: Path, out: Path, *, revision: str | None, repo_id: str = REPO_ID,
          episodes: Sequence[int] | None = None) -> Path:
    """A real sidecar of ``dataset`` (built by the loader), at ``out``."""
    meta = LeRobotMeta.load(str(dataset))
    build_sidecar(meta, out, repo_id=repo_id, revision=revision, data_root=str(dataset), episodes=episodes)
    return out


def dataset_files(dataset: Path) -> dict[str, bytes]:
    return {p.relative_to(dataset).as_posix(): p.read_bytes() for p in sorted(dataset.rglob("*")) if p.is_file()}


def touch_video(dataset: Path) -> str:
    """Rewrite one video in place with the same bytes: its identity (mtime/ctime) changes, so a
    sidecar built afterwards differs, as after a real re-encode at the same path."""
    video = sorted(dataset.glob("videos/*/chunk-*/file-*.mp4"))[0]
    data = video.read_bytes()
    video.write_bytes(data)
    st = video.stat()
    os.utime(video, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    return video.relative_to(dataset).as_posix()


def commit_on_branch(bare: Path, branch: str, files: dict[str, bytes], message: str) -> str:
    """Someone else's commit on ``branch`` of ``bare`` (e.g. a hand edit of a published sidecar); its SHA."""
    work = bare.parent / f"{bare.name}-{branch}-edit"
    if work.exists():
        shutil.rmtree(work)
    git("clone", "--quiet", "--branch", branch, str(bare), str(work))
    for rel, data in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(data)
    git("add", "--all", cwd=work)
    git("commit", "--quiet", "-m", message, cwd=work)
    git("push", "--quiet", "origin", f"HEAD:refs/heads/{branch}", cwd=work)
    return git("rev-parse", "HEAD", cwd=work)


def serve_partial_clones(bare: Path) -> None:
    """Let ``bare`` answer ``--filter=blob:none`` fetches and later single-blob fetches, as GitHub,
    GitLab and the Hub do (git's own default for a local path is to ignore the filter)."""
    git("config", "uploadpack.allowFilter", "true", cwd=bare)
    git("config", "uploadpack.allowAnySHA1InWant", "true", cwd=bare)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, lerobot_v3_root: Path) -> tuple[Path, str, Path]:
    """(bare repo template holding the dataset on main, its commit, a complete sidecar for it);
    for the modules that publish to git or read a publish back."""
    tmp = tmp_path_factory.mktemp("lerobot-git")
    bare, sha = make_source_repo(tmp, lerobot_v3_root)
    return bare, sha, build(lerobot_v3_root, tmp / "complete.npz", revision=sha)
