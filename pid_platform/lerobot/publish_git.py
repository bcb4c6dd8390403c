"""Publish a sidecar to any git repository: one commit on the branch ``lerobot-sidecars``.

The branch starts at the pinned source commit (so the sidecar sits beside exactly the files it
indexes) and each later publish adds a commit on top of the previous sidecar commit. Only that
branch is pushed, without ``--force``: the source branch is never touched, and a publish racing
another one is rejected by git as a non-fast-forward instead of overwriting it.

Nothing is checked out and no blob of the dataset is downloaded: the work happens in a
temporary bare repository that fetches only the commit and its trees (``--depth=1
--filter=blob:none``; a server without filter support sends the blobs too, which costs time,
not correctness), and the new trees are built with ``git mktree`` along ``meta/mp4-sidecars``.
Fetching a commit by SHA needs a server that allows it (protocol v2 servers do: git itself,
GitHub, GitLab, the Hub).
Uses the ``git`` command line; credentials stay in git's own helpers and never reach a message.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loader.lerobot.sidecar.publish_layout import (
    SIDECAR_BRANCH,
    SIDECAR_DIR,
    Published,
    PublishError,
    PublishRefused,
    require_commit_sha,
)
from loader.lerobot.sidecar.schema import public_root

REMOTE = "target"
_GIT_TIMEOUT_S = 600.0
# Inherited from a git hook or a wrapper, these would point the commands at another repository.
_REPO_ENV = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
             "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_COMMON_DIR")


@dataclass(frozen=True)
class GitTarget:
    """A git repository git can push to (a path, ``file://``, ``ssh://``, ``https://``...)."""

    url: str
    branch: str = SIDECAR_BRANCH
    author_name: str = "pid-platform"
    author_email: str = "pid-platform@localhost"

    def __str__(self) -> str:
        return f"git:{public_root(self.url)}#{self.branch}"


@contextlib.contextmanager
def scratch_repo(target: GitTarget, prefix: str) -> Iterator[_Git]:
    """A temporary bare repository with ``target`` as its remote ``REMOTE``, removed afterwards:
    where publishing and reading back both work, so no user checkout is ever touched."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        repo = Path(tmp) / "scratch.git"
        repo.mkdir()
        git = _Git(repo, target)
        git("init", "--quiet", "--bare")
        git("remote", "add", REMOTE, target.url)
        yield git


class _Git:
    """Runs git in one temporary bare repository, with an explicit identity and no prompts."""

    def __init__(self, repo: Path, target: GitTarget):
        self.repo = repo
        self.target = target
        env = {k: v for k, v in os.environ.items() if k not in _REPO_ENV}
        env.update(
            GIT_TERMINAL_PROMPT="0",  # a missing credential fails instead of waiting for a person
            GIT_AUTHOR_NAME=target.author_name, GIT_AUTHOR_EMAIL=target.author_email,
            GIT_COMMITTER_NAME=target.author_name, GIT_COMMITTER_EMAIL=target.author_email,
            LC_ALL="C",
        )
        self.env = env

    def __call__(self, *args: str, input: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            ["git", *args], cwd=self.repo, env=self.env, input=input, capture_output=True,
            timeout=_GIT_TIMEOUT_S,
        )
        if check and proc.returncode != 0:
            raise PublishError(
                f"git {args[0]} failed for {self.target} (exit {proc.returncode}): "
                f"{self._clean(proc.stderr)}"
            )
        return proc

    def out(self, *args: str, input: bytes | None = None) -> str:
        return self(*args, input=input).stdout.decode().strip()

    def _clean(self, stderr: bytes) -> str:
        text = stderr.decode(errors="replace").strip()
        # git prints the URL as given; keep a token in it out of our messages.
        if self.target.url != public_root(self.target.url):
            text = text.replace(self.target.url, public_root(self.target.url))
        return text[-2000:]

    def remote_refs(self) -> dict[str, str]:
        refs = {}
        for line in self.out("ls-remote", REMOTE).splitlines():
            sha, _, ref = line.partition("\t")
            if ref and not ref.endswith("^{}"):
                refs[ref] = sha
        return refs

    def fetch(self, *refspecs: str) -> subprocess.CompletedProcess:
        return self("fetch", "--quiet", "--no-tags", "--depth=1", "--filter=blob:none", REMOTE, *refspecs,
                    check=False)

    def parent(self, commit: str) -> str | None:
        # From the raw object: in a shallow fetch, rev-parse hides the parent commit.
        for line in self.out("cat-file", "commit", commit).splitlines():
            if line.startswith("parent "):
                return line.split()[1]
            if not line:
                break
        return None

    def tree_entries(self, tree: str | None) -> dict[str, tuple[str, str, str]]:
        """name -> (mode, type, id) of one tree (not recursive); {} for no tree."""
        if tree is None:
            return {}
        entries = {}
        for item in self("ls-tree", "-z", tree).stdout.split(b"\0"):
            if item:
                head, _, name = item.partition(b"\t")
                mode, kind, oid = head.decode().split(" ")
                entries[name.decode()] = (mode, kind, oid)
        return entries

    def make_tree(self, entries: dict[str, tuple[str, str, str]]) -> str:
        data = b"".join(f"{m} {k} {o}\t".encode() + n.encode() + b"\0" for n, (m, k, o) in entries.items())
        # --missing: the dataset's blobs were not fetched, and need not be (the server has them).
        return self.out("mktree", "-z", "--missing", input=data)


def _tree_with(git: _Git, tree: str | None, parts: list[str], files: dict[str, str]) -> str:
    """``tree`` with ``files`` (name -> blob id) placed in the folder ``parts``; the new tree's id."""
    entries = git.tree_entries(tree)
    if not parts:
        for name, blob in files.items():
            entries[name] = ("100644", "blob", blob)
        return git.make_tree(entries)
    head = parts[0]
    sub = entries.get(head)
    if sub is not None and sub[1] != "tree":
        raise PublishRefused(f"{git.target}: {head!r} is a file in the source tree, not a folder; "
                             f"cannot place the sidecar under {SIDECAR_DIR}")
    entries[head] = ("040000", "tree", _tree_with(git, sub[2] if sub else None, parts[1:], files))
    return git.make_tree(entries)


def publish_git(target: GitTarget, files: dict[str, Path | bytes], *, revision: str, message: str,
                sidecar_name: str, pointer_name: str, sha256: str, size: int) -> Published:
    """Commit ``files`` (name in ``meta/mp4-sidecars`` -> content) on ``target.branch``; push it."""
    require_commit_sha(revision, str(target))
    display = public_root(target.url)
    with scratch_repo(target, "pid-sidecar-git-") as git:
        branch_ref = f"refs/heads/{target.branch}"
        old = git.remote_refs().get(branch_ref)

        fetched = git.fetch(revision)
        if fetched.returncode != 0:
            raise PublishRefused(
                f"revision {revision} is not a commit of {display} ({git._clean(fetched.stderr)}); "
                "publish with the full SHA of a commit that repository has (the dataset version "
                "the sidecar was built from)"
            )
        if git.out("cat-file", "-t", revision) != "commit":
            raise PublishRefused(f"revision {revision} of {display} is not a commit")
        if old is not None:
            fetched = git.fetch(f"{branch_ref}:refs/remotes/{REMOTE}/{target.branch}")
            if fetched.returncode != 0:
                raise PublishError(f"cannot fetch {target.branch} of {display}: {git._clean(fetched.stderr)}")

        base = old or revision
        base_tree = git.out("rev-parse", f"{base}^{{tree}}")
        blobs = {}
        for name, content in files.items():
            if isinstance(content, Path):
                blobs[name] = git.out("hash-object", "-w", "--no-filters", "--", str(content))
            else:
                blobs[name] = git.out("hash-object", "-w", "--no-filters", "--stdin", input=content)
        tree = _tree_with(git, base_tree, SIDECAR_DIR.split("/"), blobs)
        urls = {
            "sidecar_url": f"{display}#{target.branch}:{SIDECAR_DIR}/{sidecar_name}",
            "pointer_url": f"{display}#{target.branch}:{SIDECAR_DIR}/{pointer_name}",
        }
        if old is not None and tree == base_tree:
            # The branch already holds these exact bytes (a retry, or a rebuild that changed nothing).
            return Published(target=str(target), sha256=sha256, size=size, commit=old, parent=git.parent(old),
                             unchanged=True, **urls)

        commit = git.out("commit-tree", tree, "-p", base, "-m", message)
        # No --force: if someone moved the branch since we looked, git rejects this push as a
        # non-fast-forward and nothing is overwritten.
        pushed = git("push", "--quiet", "--porcelain", REMOTE, f"{commit}:{branch_ref}", check=False)
        if pushed.returncode != 0:
            raise PublishError(
                f"push of {target.branch} to {display} was rejected ({git._clean(pushed.stderr or pushed.stdout)}); "
                "if another publish ran at the same time, run this one again"
            )
        after = git.remote_refs()
        if after.get(branch_ref) != commit:
            raise PublishError(f"after the push, {target.branch} of {display} is {after.get(branch_ref)}, "
                               f"not the commit pushed ({commit})")
        return Published(target=str(target), sha256=sha256, size=size, commit=commit, parent=base, **urls)
