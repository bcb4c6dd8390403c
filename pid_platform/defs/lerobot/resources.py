"""The ``lerobot`` resource: where LeRobot datasets are found, where their sidecars are built, and
where they are published.

From the environment (read when the code location loads):
  ``PID_LEROBOT_ROOT``     folder holding one folder per dataset (default ``demo/lerobot``);
                           a sub-folder with ``meta/info.json`` is a dataset. ``s3://`` works too.
  ``PID_OUTPUT_ROOT``      local output root (default ``demo/out``); sidecars go to
                           ``<output_root>/lerobot/<dataset>/mp4-sidecar.npz``
  ``PID_LEROBOT_PUBLISH``  ``none`` (default: build and check, publish nothing), ``git:<url or path>``,
                           ``s3://bucket/prefix`` or ``hub[:<org>/<name>]``; ``{dataset}`` is replaced by
                           the dataset's folder name (``git:/srv/git/{dataset}.git``)
  ``PID_LEROBOT_REPO_ID``  the datasets' repo ids (default ``local/{dataset}``)

The revision a sidecar is built for is the dataset folder's git commit when the folder is a
clean git checkout (a clone of the dataset's repository), else none (unpinned): git and Hub
targets publish only pinned sidecars, so a dirty or non-git folder can be built and checked but
its publish fails with the reason.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

import dagster as dg
from pydantic import Field

from loader.io import roots as fs
from loader.io import urls
from pid_platform.lerobot.publish import PublishTarget, parse_target
from pid_platform.sharding.commit.s3_output import default_work_root, is_s3_url, refuse_other_urls

DEFAULT_LEROBOT_ROOT = "demo/lerobot"
DEFAULT_OUTPUT_ROOT = "demo/out"
SIDECAR_FILE = "mp4-sidecar.npz"
NO_PUBLISH = "none"


class LeRobotResource(dg.ConfigurableResource):
    """LeRobot v3 datasets under ``root``: their sidecars under ``output_root``, published to ``publish_target``."""

    root: str = Field(description="Folder (or s3://bucket/prefix) holding one folder per LeRobot v3 dataset.")
    output_root: str = Field(description="Local folder; sidecars go to <output_root>/lerobot/<dataset>/.")
    publish_target: str = Field(
        default=NO_PUBLISH,
        description="none, git:<url or path>, s3://bucket/prefix or hub[:org/name]; {dataset} is filled in.",
    )
    repo_id_template: str = Field(default="local/{dataset}", description="Repo id of each dataset.")
    workers: int = Field(default=4, description="MP4 files indexed at once per build.")

    def check_name(self, dataset: str) -> str:
        # A partition key becomes a path component: a hand-added key must not point outside the root.
        if not dataset or dataset in (".", "..") or "/" in dataset or "\\" in dataset or dataset.startswith("."):
            raise ValueError(f"dataset {dataset!r} is not a plain folder name; delete that partition of "
                             "'lerobot_datasets' in the UI and add the dataset's folder name instead")
        return dataset

    def data_root(self, dataset: str) -> str:
        return fs.join(self.root, self.check_name(dataset))

    def sidecar_path(self, dataset: str) -> Path:
        return Path(self.output_root) / "lerobot" / self.check_name(dataset) / SIDECAR_FILE

    def repo_id(self, dataset: str) -> str:
        return self.repo_id_template.format(dataset=self.check_name(dataset))

    def revision(self, dataset: str) -> tuple[str | None, str]:
        """(the pinned commit of the dataset folder or None, how it was decided)."""
        root = self.data_root(dataset)
        if fs.root_kind(root) != "local":
            return None, "not a git checkout (a remote root): unpinned"
        return git_revision(Path(root))

    def target(self, dataset: str) -> PublishTarget | None:
        if self.publish_target.strip().lower() == NO_PUBLISH:
            return None
        return parse_target(self.publish_target.replace("{dataset}", self.check_name(dataset)),
                            repo_id=self.repo_id(dataset))

    def datasets(self) -> list[str]:
        """Sorted folder names under ``root`` that hold ``meta/info.json``."""
        try:
            names = fs.list_dir(self.root, "")
        except FileNotFoundError:
            return []
        return [n for n in names if not n.startswith(".") and fs.exists(self.root, f"{n}/meta/info.json")]


def git_revision(folder: Path) -> tuple[str | None, str]:
    """HEAD of ``folder`` if it is the top of a git checkout with no changes to tracked files."""

    def git(*args: str) -> str | None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        proc = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, env=env,
                              timeout=60)
        return proc.stdout.strip() if proc.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != folder.resolve():
        return None, "not the top of a git checkout: unpinned"
    head = git("rev-parse", "--verify", "HEAD^{commit}")
    if head is None:
        return None, "a git checkout without commits: unpinned"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    if dirty:
        return None, f"git checkout at {head} with uncommitted changes to tracked files: unpinned"
    return head, "git HEAD of a clean checkout"


def lerobot_from_env(environ: Mapping[str, str] | None = None) -> LeRobotResource:
    env = os.environ if environ is None else environ
    root = env.get("PID_LEROBOT_ROOT") or DEFAULT_LEROBOT_ROOT
    out = env.get("PID_OUTPUT_ROOT") or DEFAULT_OUTPUT_ROOT
    refuse_other_urls(out, "PID_OUTPUT_ROOT")
    if is_s3_url(out):
        # Sidecars are built locally and published to their dataset (PID_LEROBOT_PUBLISH), not to
        # the twin-tar output root: with an S3 output root they are built in the work folder.
        out = str(Path(env.get("PID_WORK_ROOT") or default_work_root()) / "lerobot-sidecars")
    if urls.is_local(root):
        # Absolute now, so a run worker started from another folder reads the same place.
        root = str(Path(urls.local_path(root)).resolve())
    return LeRobotResource(
        root=root, output_root=str(Path(urls.local_path(out)).resolve()),
        publish_target=env.get("PID_LEROBOT_PUBLISH") or NO_PUBLISH,
        repo_id_template=env.get("PID_LEROBOT_REPO_ID") or "local/{dataset}",
    )


@dg.definitions
def resources() -> dg.Definitions:
    return dg.Definitions(resources={"lerobot": lerobot_from_env()})
