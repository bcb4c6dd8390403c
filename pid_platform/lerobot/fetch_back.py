"""Read back what a publish put at a target, the way a reader finds it: the pointer for the
revision, then the NPZ it names, checked against the pointer's sha256 and size.

S3 and Hub targets are read through the loader's own ``fetch_published`` (training's read path,
so a check that passes here passes there). A git target has no URL training reads, so its branch
is fetched into a temporary bare repository like the publish does: ``--depth=1
--filter=blob:none`` brings the commit and its trees, and only the pointer and the NPZ blobs are
then read (a server without filter support sends every blob, which costs time, not correctness).
Credentials stay in git's helpers and never reach a message.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from loader.formats.atomic import atomic_writer
from loader.io import StreamConfig
from loader.lerobot.sidecar.publish_layout import (
    SIDECAR_BRANCH,
    SIDECAR_DIR,
    PublishError,
    check_pointed_bytes,
    pointed_sidecar,
    pointer_name,
    read_pointer,
)
from loader.lerobot.sidecar.published import fetch_published, published_home
from loader.lerobot.sidecar.schema import public_root
from pid_platform.lerobot.publish import GitTarget, HubTarget, PublishTarget, S3Target
from pid_platform.lerobot.publish_git import REMOTE, scratch_repo

__all__ = ["NothingPublishedError", "fetch_published_sidecar"]


class NothingPublishedError(PublishError):
    """The target holds no sidecar for this revision (no branch, or no pointer on it)."""


def fetch_published_sidecar(target: PublishTarget, revision: str | None, dest: str | os.PathLike[str]) -> Path:
    """Download the sidecar published at ``target`` for ``revision`` to ``dest`` (atomically).

    Raises NothingPublishedError when nothing is published there for that revision, and
    PublishError when the pointer is not a pointer, names something else than a sidecar beside
    it, or the NPZ's bytes do not match its sha256 and size.
    """
    dest = Path(dest)
    if isinstance(target, GitTarget):
        return _fetch_git(target, revision, dest)
    if isinstance(target, S3Target):
        home, config = target.root, StreamConfig(s3_endpoint_url=target.endpoint_url)
    elif isinstance(target, HubTarget):
        if target.branch != SIDECAR_BRANCH:
            # Training reads only this branch; reading another would check something nobody uses.
            raise PublishError(f"{target}: readers look only at the branch {SIDECAR_BRANCH}, not {target.branch}")
        home = published_home(target.repo_id, f"hf://datasets/{target.repo_id}")
        config = StreamConfig(hf_endpoint=target.endpoint, hf_token=target.token)
    else:
        raise TypeError(f"not a publish target: {target!r}")
    fetched = fetch_published(home, revision, dest, config=config)
    if fetched is None:
        raise NothingPublishedError(
            f"{target}: no sidecar is published for revision {revision or '(unpinned)'} "
            f"(no {SIDECAR_DIR}/{pointer_name(revision)}); materialize published_mp4_sidecar to publish it")
    return fetched


def _fetch_git(target: GitTarget, revision: str | None, dest: Path) -> Path:
    display = public_root(target.url)
    branch_ref = f"refs/heads/{target.branch}"
    pointer_path = f"{SIDECAR_DIR}/{pointer_name(revision)}"
    where = f"{display}#{target.branch}:{pointer_path}"
    with scratch_repo(target, "pid-sidecar-fetch-") as git:
        head = git.remote_refs().get(branch_ref)
        if head is None:
            raise NothingPublishedError(f"{display} has no branch {target.branch}: no sidecar is published there; "
                                        "materialize published_mp4_sidecar to publish it")
        fetched = git.fetch(f"{branch_ref}:refs/remotes/{REMOTE}/{target.branch}")
        if fetched.returncode != 0:
            raise PublishError(f"cannot fetch {target.branch} of {display}: {git._clean(fetched.stderr)}")

        def blob(path: str) -> bytes:
            # ls-tree reads only trees: a missing entry is told apart from a failed blob read.
            if not git.out("ls-tree", head, "--", path):
                raise NothingPublishedError(
                    f"{display}#{target.branch} (commit {head}) has no {path}: no sidecar is published for "
                    f"revision {revision or '(unpinned)'}; materialize published_mp4_sidecar to publish it")
            # cat-file, not show: the raw bytes, never a textconv of them.
            return git("cat-file", "blob", f"{head}:{path}").stdout

        doc = read_pointer(blob(pointer_path), where)
        name = pointed_sidecar(doc, where)
        data = blob(f"{SIDECAR_DIR}/{name}")  # in memory: a sidecar is megabytes, not gigabytes
    check_pointed_bytes(doc, where, name, hashlib.sha256(data).hexdigest(), len(data))
    with atomic_writer(dest) as out:
        out.write(data)
    return dest
