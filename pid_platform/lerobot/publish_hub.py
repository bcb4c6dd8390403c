"""Publish a sidecar to a Hugging Face Hub dataset repo, on its branch ``lerobot-sidecars``.

Same shape as the git target, through ``huggingface_hub``'s API: the branch is created from the
pinned source commit (``create_branch(..., revision=<sha>, exist_ok=True)``), the NPZ and its
pointer go in one commit on that branch (``create_commit(..., revision=branch,
parent_commit=<branch head>)``, so a publish racing another one fails instead of stacking on a
head it never saw). The source branch is never committed to. Needs a write token (the usual
``huggingface_hub`` lookup: ``HF_TOKEN``, ``hf auth login``), or ``HubTarget.token``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from loader.lerobot.sidecar.publish_layout import (
    SIDECAR_BRANCH,
    SIDECAR_DIR,
    Published,
    PublishError,
    PublishRefused,
    require_commit_sha,
)

REPO_TYPE = "dataset"


@dataclass(frozen=True)
class HubTarget:
    """A dataset repo on the Hub (``endpoint`` defaults to ``HF_ENDPOINT``, else huggingface.co)."""

    repo_id: str
    endpoint: str | None = None
    token: str | None = field(default=None, repr=False)
    branch: str = SIDECAR_BRANCH

    def __str__(self) -> str:
        where = f"{self.endpoint.rstrip('/')}/" if self.endpoint else ""
        return f"hub:{where}datasets/{self.repo_id}#{self.branch}"


@contextmanager
def _errors(target: HubTarget, what: str) -> Iterator[None]:
    from huggingface_hub.errors import (
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except RevisionNotFoundError as e:
        raise PublishRefused(f"{what} on {target}: revision not found ({e}); pass the full SHA of a "
                             "commit of that dataset repo") from e
    except RepositoryNotFoundError as e:
        raise PublishError(f"{what} on {target}: dataset repo not found, or the token may not "
                           f"read it ({e})") from e
    except HfHubHTTPError as e:
        raise PublishError(f"{what} on {target}: {e}") from e


def publish_hub(target: HubTarget, files: dict[str, Path | bytes], *, revision: str, message: str,
                sidecar_name: str, pointer_name: str, sha256: str, size: int) -> Published:
    from huggingface_hub import CommitOperationAdd, HfApi

    require_commit_sha(revision, str(target))
    # HF_ENDPOINT read now, as the loader's hf:// reads do (huggingface_hub reads it at import).
    api = HfApi(endpoint=target.endpoint or os.environ.get("HF_ENDPOINT") or None, token=target.token)
    repo_id = target.repo_id
    with _errors(target, f"looking up revision {revision}"):
        info = api.dataset_info(repo_id, revision=revision)
    if info.sha != revision:
        raise PublishRefused(f"revision {revision} of {target} resolves to commit {info.sha}; pass that "
                             "commit's full SHA")
    with _errors(target, f"creating branch {target.branch} from {revision}"):
        api.create_branch(repo_id, branch=target.branch, revision=revision, repo_type=REPO_TYPE, exist_ok=True)
        heads = {b.name: b.target_commit for b in api.list_repo_refs(repo_id, repo_type=REPO_TYPE).branches}
    head = heads.get(target.branch)
    if head is None:
        raise PublishError(f"{target}: branch {target.branch} is missing right after it was created")
    operations = [
        CommitOperationAdd(path_in_repo=f"{SIDECAR_DIR}/{name}",
                           path_or_fileobj=str(content) if isinstance(content, Path) else content)
        for name, content in files.items()
    ]
    with _errors(target, f"committing to {target.branch}"):
        # huggingface_hub drops files whose bytes the branch already holds; with nothing left it
        # makes no commit and returns the current head.
        commit = api.create_commit(repo_id, operations, commit_message=message, repo_type=REPO_TYPE,
                                   revision=target.branch, parent_commit=head)
        after = {b.name: b.target_commit for b in api.list_repo_refs(repo_id, repo_type=REPO_TYPE).branches}
    if after.get(target.branch) != commit.oid:
        raise PublishError(f"after the commit, {target.branch} of {target} is {after.get(target.branch)}, "
                           f"not the commit made ({commit.oid})")
    base = f"hf://datasets/{repo_id}@{target.branch}/{SIDECAR_DIR}"
    unchanged = commit.oid == head
    return Published(
        target=str(target), sidecar_url=f"{base}/{sidecar_name}", pointer_url=f"{base}/{pointer_name}",
        sha256=sha256, size=size, commit=commit.oid, parent=None if unchanged else head, unchanged=unchanged,
    )
