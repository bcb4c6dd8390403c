"""``pid-build-mp4-sidecar``: build a LeRobot v3 dataset's MP4 sidecar, and optionally publish it.

    pid-build-mp4-sidecar --repo-id OWNER/DATASET --revision COMMIT_SHA \\
        --data-root hf://datasets/OWNER/DATASET@COMMIT_SHA --output /tmp/dataset-mp4-sidecar.npz \\
        [--workers N] [--episodes 0 3 5 ...] [--push [--push-target git:<url>|s3://...|hub[:org/name]]]

The build is the loader's own (``build_sidecar``), so a sidecar built here is byte-for-byte the
one training would build. Publishing is explicit (``--push``), only for a sidecar of the whole
dataset (not ``--episodes``), and only after the sidecar validates against the dataset. Without
``--push-target`` a sidecar goes where the dataset lives: the Hub repo for an ``hf://`` root, the
bucket root for an ``s3://`` root. Hub and git pushes need ``--revision`` to be a full commit SHA.

Exit status: 0 done; 1 the build, the validation or the publish failed; 2 the arguments are
wrong (argparse's own code), including ``--push`` with ``--episodes`` or an unpinned revision.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from loader.formats.errors import FormatError, short_repr
from loader.io import StreamConfig, StreamError, urls
from loader.io import roots as fs
from loader.io.source import redact_url
from loader.lerobot.meta import LeRobotMeta, LeRobotMetaError
from loader.lerobot.sidecar import SidecarBuildError, build_sidecar, validate_sidecar
from loader.lerobot.sidecar.publish_layout import Published, PublishError, is_commit_sha
from pid_platform.cli_args import endpoint_url, int_at_least, local_path
from pid_platform.lerobot.publish import (
    GitTarget,
    HubTarget,
    PublishTarget,
    parse_target,
    publish_sidecar,
)

PROG = "pid-build-mp4-sidecar"
EXIT_FAILED = 1
EXIT_USAGE = 2
DEFAULT_RETRIES = 3  # 0.2 + 0.4 + 0.8 s of back-off (jittered): a server that is down fails fast


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Index a LeRobot v3 dataset's MP4 files from their boxes into a schema-v3 "
                    "sidecar NPZ, and optionally publish it where training looks for it.",
    )
    p.add_argument("--repo-id", required=True, type=_repo_id, help="the dataset's id, OWNER/DATASET")
    p.add_argument("--revision", required=True, type=_revision,
                   help="the dataset revision the sidecar indexes: a full commit SHA for Hub and git "
                        "pushes (a tag or branch would move); any label for a bucket")
    p.add_argument("--data-root", required=True, type=_data_root,
                   help="where the dataset is read from: a folder, s3://bucket/prefix, "
                        "hf://datasets/OWNER/DATASET@SHA or http(s)://")
    p.add_argument("--output", required=True, type=local_path("--output", kind="file"),
                   help="the sidecar NPZ to write (replaced atomically), a local file")
    p.add_argument("--workers", type=int_at_least(1, 256), default=min(8, os.cpu_count() or 1),
                   help="MP4 files indexed at once; the bytes do not depend on it (default: CPUs, at most 8)")
    p.add_argument("--episodes", type=int_at_least(0), nargs="+", default=None, metavar="EPISODE",
                   help="index only the MP4 files of these episodes (a subset sidecar: never published)")
    p.add_argument("--push", action="store_true",
                   help="publish the finished sidecar (complete sidecars only)")
    p.add_argument("--push-target", default=None,
                   help="git:<url or path> (branch lerobot-sidecars), s3://bucket/prefix "
                        "(meta/mp4-sidecars/ under it) or hub[:OWNER/DATASET] (branch lerobot-sidecars); "
                        "default: the Hub for hf:// roots, the root itself for s3:// roots")
    p.add_argument("--max-retries", type=int_at_least(0, 100), default=DEFAULT_RETRIES,
                   help="reopen attempts per file before giving up (jittered back-off from 0.2 s, at most "
                        f"10 s each; default {DEFAULT_RETRIES}: a refused connection fails within about 2 s)")
    p.add_argument("--hub-endpoint", type=endpoint_url, default=None, help="Hub endpoint (default: $HF_ENDPOINT or huggingface.co)")
    p.add_argument("--s3-endpoint-url", type=endpoint_url, default=None, help="S3 endpoint (default: $AWS_ENDPOINT_URL or AWS)")
    return p


_REPO_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
_REVISION = re.compile(r"[A-Za-z0-9._/-]{1,200}")


def _repo_id(text: str) -> str:
    owner, slash, name = text.partition("/")
    parts_ok = all(_REPO_PART.fullmatch(p) and ".." not in p for p in (owner, name))
    if not slash or not parts_ok:
        raise argparse.ArgumentTypeError(
            f"{short_repr(text)} is not OWNER/DATASET (two names of letters, digits, '.', '_' or '-', "
            "joined by one '/', no '..')")
    return text


def _revision(text: str) -> str:
    # It names files and branches downstream (cache folders, git refs): never a path out of them.
    if not _REVISION.fullmatch(text) or ".." in text or text.startswith(("/", "-", ".")) or "//" in text \
            or text.endswith(("/", ".lock")):
        raise argparse.ArgumentTypeError(
            f"{short_repr(text)} is not a revision: a commit SHA, a tag or a branch name (letters, digits, "
            "'.', '_', '-', '/'; no '..', no leading '/', '-' or '.')")
    return text


def _data_root(text: str) -> str:
    try:
        fs.check_root(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if fs.root_kind(text) == "local" and os.path.isfile(urls.local_path(text)):
        raise argparse.ArgumentTypeError(f"{text} is a file; give the dataset's folder (holding meta/, data/, videos/)")
    return text  # a folder that is not a dataset fails the build (exit 1), naming meta/info.json


def push_target(args: argparse.Namespace) -> PublishTarget:
    """The target ``--push`` publishes to; PublishError says what is wrong with the arguments."""
    if args.episodes is not None:
        raise PublishError("--push publishes complete sidecars only, and --episodes builds a subset; "
                           "drop --episodes to build (and push) the whole dataset's sidecar")
    spec = args.push_target
    if spec is None:
        if urls.is_hf(args.data_root):
            spec = "hub"
        elif urls.is_s3(args.data_root):
            spec = args.data_root
        else:
            raise PublishError(f"--push: where to? {args.data_root!r} is neither hf:// nor s3://; "
                               "give --push-target git:<url>, s3://bucket/prefix or hub")
    target = parse_target(spec, repo_id=args.repo_id, hub_endpoint=args.hub_endpoint,
                          s3_endpoint_url=args.s3_endpoint_url)
    if isinstance(target, GitTarget | HubTarget) and not is_commit_sha(args.revision):
        raise PublishError(f"--push to {target} needs a pinned --revision: a full 40-character commit "
                           f"SHA, not {args.revision!r} (a branch or tag moves; the sidecar must not)")
    return target


class _Progress:
    """A tqdm bar over MP4 files, made on the first report (when the total is known)."""

    def __init__(self) -> None:
        self.bar = None
        self.bytes_read = 0

    def __call__(self, done: int, total: int, rel: str, bytes_read: int = 0) -> None:
        self.bytes_read += bytes_read
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="file", desc="indexing MP4", file=sys.stderr, dynamic_ncols=True)
        self.bar.set_postfix_str(rel, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    # Named errors already say which file and what to do; a traceback would bury that.
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def _published_lines(p: Published) -> list[str]:
    verb = "already published (nothing changed)" if p.unchanged else "published"
    lines = [f"  {verb}: {p.target}", f"    sidecar  {p.sidecar_url}", f"    pointer  {p.pointer_url}",
             f"    sha256   {p.sha256}  ({p.size} bytes)"]
    if p.commit:
        lines.append(f"    commit   {p.commit}" + (f"  (parent {p.parent})" if p.parent else ""))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    target = None
    if args.push_target is not None and not args.push:
        return _fail("--push-target is only used with --push (publishing is always explicit)", EXIT_USAGE)
    if args.push:
        try:
            target = push_target(args)
        except PublishError as exc:
            return _fail(str(exc), EXIT_USAGE)
    progress = _Progress()
    config = StreamConfig(max_retries=args.max_retries)
    try:
        meta = LeRobotMeta.load(args.data_root, config=config)
        if args.episodes is not None:
            missing = sorted(set(args.episodes) - set(meta.episode_indices.tolist()))
            if missing:
                return _fail(f"--episodes {short_repr(missing)}: no such episode in {redact_url(args.data_root)} "
                             f"({len(meta.episode_indices)} episodes)", EXIT_USAGE)
        manifest = build_sidecar(meta, args.output, repo_id=args.repo_id, revision=args.revision,
                                 data_root=args.data_root, workers=args.workers, episodes=args.episodes,
                                 progress=progress, stream_config=config)
    except (LeRobotMetaError, SidecarBuildError, FormatError, StreamError, OSError) as exc:
        return _fail(str(exc))
    finally:
        progress.close()
    samples = sum(f.sample_count for f in manifest.files)
    kind = f"subset (episodes {list(manifest.episodes or ())})" if manifest.subset else "complete"
    lines = [f"{PROG}: {args.repo_id}@{args.revision} -> {args.output}",
             f"  {kind}: {len(manifest.files)} MP4 files, {samples} samples, "
             f"{os.path.getsize(args.output)} bytes",
             f"  indexing read {progress.bytes_read} bytes of MP4 headers (no media data)"]
    if target is not None:
        problems = validate_sidecar(args.output, meta, repo_id=args.repo_id, revision=args.revision,
                                    require_complete=True)
        if problems:
            print("\n".join(lines), flush=True)
            return _fail("the sidecar does not validate, so it was not pushed:\n  " + "\n  ".join(problems))
        try:
            lines += _published_lines(publish_sidecar(args.output, target, revision=args.revision))
        except PublishError as exc:
            print("\n".join(lines), flush=True)
            return _fail(str(exc))
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
