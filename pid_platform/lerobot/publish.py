"""Publish a complete MP4 sidecar where training looks for it: a git repo, a Hub dataset repo or an
``s3://`` root (layout and pointer: ``layout.py``; one module per target).

Publishing is always an explicit act of a maintainer (training only reads). Before anything is
written the sidecar is opened with the loader's own reader, so only a readable schema-v3 sidecar
of the WHOLE dataset goes out: a subset sidecar (built with ``--episodes``) is refused.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from loader.io import urls
from loader.lerobot.sidecar import SIDECAR_SCHEMA_VERSION, read_sidecar
from loader.lerobot.sidecar.publish_layout import (
    SIDECAR_BRANCH,
    SIDECAR_DIR,
    Published,
    PublishError,
    PublishRefused,
    SubsetSidecarError,
    addressed_npz_name,
    make_pointer,
    pointer_name,
    versioned_npz_name,
)
from pid_platform.lerobot.publish_git import GitTarget, publish_git
from pid_platform.lerobot.publish_hub import HubTarget, publish_hub
from pid_platform.lerobot.publish_s3 import S3Target, publish_s3

PublishTarget = GitTarget | S3Target | HubTarget

__all__ = [
    "SIDECAR_BRANCH", "SIDECAR_DIR", "GitTarget", "HubTarget", "PublishError", "PublishRefused", "PublishTarget", "Published",
    "S3Target", "SubsetSidecarError", "parse_target", "publish_sidecar", "sidecar_manifest",
]


def parse_target(spec: str, *, repo_id: str | None = None, hub_endpoint: str | None = None,
                 s3_endpoint_url: str | None = None) -> PublishTarget:
    """``git:<url or path>``, ``s3://bucket/prefix``, ``hub`` (the dataset ``repo_id``) or ``hub:<org/name>``."""
    if spec.startswith("git:"):
        url = spec[len("git:"):]
        if not url:
            raise PublishRefused("push target 'git:' needs a repository: git:<url or path>")
        return GitTarget(url=url)
    if urls.is_s3(spec):
        return S3Target(root=spec, endpoint_url=s3_endpoint_url)
    if spec == "hub" or spec.startswith("hub:"):
        repo = spec[len("hub:"):] if spec.startswith("hub:") else repo_id
        if not repo or repo.count("/") != 1:
            raise PublishRefused(f"push target {spec!r} needs a dataset repo id <org>/<name> (got {repo!r})")
        return HubTarget(repo_id=repo, endpoint=hub_endpoint)
    raise PublishRefused(f"unknown push target {spec!r}: use git:<url or path>, s3://bucket/prefix, or hub[:<org>/<name>]")


def sidecar_manifest(sidecar: str | os.PathLike[str]) -> dict:
    """The manifest of a sidecar that may be published; refuses a subset or another schema."""
    with read_sidecar(sidecar) as opened:
        manifest = dict(opened.manifest)
    if manifest.get("schema_version") != SIDECAR_SCHEMA_VERSION:
        raise PublishRefused(f"{sidecar}: schema version {manifest.get('schema_version')}, only schema "
                             f"v{SIDECAR_SCHEMA_VERSION} sidecars are published; rebuild it")
    if manifest.get("subset"):
        raise SubsetSidecarError(
            f"{sidecar} indexes only episodes {manifest.get('episodes')} of {manifest.get('repo_id')}: a "
            "subset sidecar must not be published (training would find videos missing from it); "
            "build it again without --episodes, then publish"
        )
    return manifest


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def publish_sidecar(sidecar: str | os.PathLike[str], target: PublishTarget, *,
                    revision: str | None = None) -> Published:
    """Publish the complete sidecar at ``sidecar`` to ``target``.

    ``revision`` defaults to the one the sidecar was built for, and must equal it when given:
    a sidecar is published only under the source revision it indexes.
    """
    path = Path(sidecar)
    manifest = sidecar_manifest(path)
    built_for = manifest.get("revision")
    if revision is None:
        revision = built_for
    elif built_for is not None and revision != built_for:
        raise PublishRefused(f"{path} was built for revision {built_for}, not {revision}; publish it under "
                             "the revision it indexes, or rebuild it for that revision")
    if isinstance(target, HubTarget) and target.repo_id != manifest["repo_id"]:
        raise PublishRefused(f"{path} indexes {manifest['repo_id']}, not {target.repo_id}")
    sha256, size = _sha256(path), path.stat().st_size
    files = len(manifest["files"])
    message = (f"Add MP4 sidecar for {manifest['repo_id']}@{revision} "
               f"(schema v{manifest['schema_version']}, {files} video file{'' if files == 1 else 's'})")
    pointer_file = pointer_name(revision)
    if isinstance(target, S3Target):
        name = addressed_npz_name(revision, sha256)
        pointer = make_pointer(sidecar_name=name, sha256=sha256, size=size, manifest=manifest)
        return publish_s3(target, path, pointer, revision=revision, sidecar_name=name,
                          pointer_name=pointer_file, sha256=sha256, size=size)
    name = versioned_npz_name(revision)
    pointer = make_pointer(sidecar_name=name, sha256=sha256, size=size, manifest=manifest)
    publish = publish_git if isinstance(target, GitTarget) else publish_hub
    return publish(target, {name: path, pointer_file: pointer}, revision=revision,  # type: ignore[arg-type]
                   message=message, sidecar_name=name, pointer_name=pointer_file, sha256=sha256, size=size)
