"""The commit: refuses unless every shard of the staged plan lies in a finished write task's
record, then writes the manifests and switches readers to the new version in one step.

For a folder, the tars must match their stamps; then the manifests and the folder swap
(``pipeline.run_manifests``, ``versions.commit``). For an ``s3://`` output, the manifests come
from the plan and the records' digests (no tar is read), each record is checked against the
objects (size, then sha256 or ETag), every object is checked in one listing, and the pointer is
switched only from the one the plan saw (``staged.json``); then ``staged/`` is deleted.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from loader.formats.version_pointer import (
    POINTER_NAME,
    VersionPointer,
    version_dir,
)
from loader.formats.wdinfo import root_base
from loader.io.errors import ObjectNotFoundError
from loader.io.s3_client import S3AccessError
from pid_platform.sharding import pipeline
from pid_platform.sharding.commit import s3_output
from pid_platform.sharding.commit.claims import this_process
from pid_platform.sharding.commit.in_place import published_manifests as published_in_place
from pid_platform.sharding.commit.lease import build_lease, check_held
from pid_platform.sharding.commit.manifest_roots import rewrite_manifest_roots
from pid_platform.sharding.commit.manifests import (
    BucketManifest,
    write_manifests,
)
from pid_platform.sharding.commit.s3_output import (
    CARRIED_STATE,
    PublishedVersion,
    PublishRaceError,
    S3Output,
)
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.layout import STATE_DIR, final_dir
from pid_platform.sharding.pause_points import pause_point
from pid_platform.sharding.plan.add_modality import load_plan_cut
from pid_platform.sharding.plan.columnar import Shard, ShardRef
from pid_platform.sharding.plan.plan_files import load_shards
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.tasks import staging
from pid_platform.sharding.tasks.outcomes import (
    TasksUnfinishedError,
    Unfinished,
    report_of,
    unfinished_write,
    validate_of,
)
from pid_platform.sharding.tasks.records import WRITE, bucket_staging, records
from pid_platform.sharding.tasks.staging import (
    STAGED_NAME,
    Staged,
    delete_staged,
    scratch_dir,
    shard_homes,
    staged_folder_plan,
    staged_or_refuse,
    tar_rel,
)
from pid_platform.sharding.tasks.write import KEY_INDEX, staged_results, unfinished_write_tasks
from pid_platform.sharding.write.tars import ShardResult


def run_commit(out: Path | S3Output, *, num_workers: int = 1, manifest_root: str = "relative",
               work_root: str | Path | None = None) -> pipeline.BuildSummary | None:
    """Commit the staged plan of ``out`` once every write task is done: its manifests, then the
    output's switch: a folder's swap (``commit_folder``), or a bucket's conditional pointer
    write (``commit_staged``; None when nothing is staged over a published version)."""
    if not isinstance(out, S3Output):
        return commit_folder(out, num_workers=num_workers, manifest_root=manifest_root)
    done = commit_staged(out, work_root=work_root, num_workers=num_workers)
    if done is None:
        return None
    folder = done.shards.folder
    summary = pipeline.BuildSummary(done.shards.staged.source, folder, report_of(folder),
                                    pipeline.summarize(done.shards.results()), [m.path for m in done.manifests], [],
                                    validate_of(folder), up_to_date=done.published.unchanged,
                                    published=done.published.url)
    shutil.rmtree(folder, ignore_errors=True)
    return summary


@pipeline.build_step
def commit_folder(out: Path, *, num_workers: int = 1, manifest_root: str = "relative") -> pipeline.BuildSummary:
    """Commit the staged plan of ``out`` once every write task is done: manifests, state, swap.

    Refuses (``TasksUnfinishedError``, naming the tasks) while any shard lacks a finished task.
    With nothing staged over a committed build (the plan found it up to date) it only rewrites
    the manifests' roots if asked otherwise and reports the committed build.
    """
    out = Path(out)
    root_base(manifest_root, final_dir(out))  # a bad root is refused before anything is written
    found = staged_folder_plan(out, "commit")
    if found is None:
        final = final_dir(out)
        rewrite_manifest_roots(out, manifest_root)
        report = report_of(final)
        results, manifests = pipeline.committed_results(out)
        return pipeline.BuildSummary(report.source, out, report, pipeline.summarize(results), manifests, [],
                                     validate_of(final), up_to_date=True)
    staging, _plan = found
    # One row per shard, read once for the checks, the manifests and the summary.
    plans = load_shards(staging, pipeline.load_sharding_config(staging))
    problem = unfinished_write_tasks(out, plans=plans)
    if problem is not None:
        raise TasksUnfinishedError(f"commit of {out}: {problem}")
    report = report_of(staging)
    _config, _plans, results = staged_results(staging, plans=plans)
    validate = validate_of(staging)
    _, manifests, removed = pipeline.run_manifests(out, report.source, num_workers=num_workers,
                                                   manifest_root=manifest_root, plans=plans)
    return pipeline.BuildSummary(report.source, out, report, pipeline.summarize(results),
                                 [m.path for m in manifests], removed, validate)


@dataclass
class StagedShards:
    """The plan staged in the bucket, as its write tasks left it (read into ``folder``)."""

    staged: Staged
    folder: Path  # a scratch folder holding the plan's state
    config: ShardingConfig
    plans: list[ShardRef]  # one row per shard (``plan_files.load_shards``): no sample is read
    cov: staging.Coverage

    def results(self) -> list[ShardResult]:
        return pipeline.planned_results(self.plans, self.cov.written.__contains__)

    def unfinished(self, output: S3Output) -> Unfinished | None:
        return unfinished_write(len(self.plans), self.cov.ofs, self.cov.missing, f"{output}/{staging.rel('tasks')}/")

    def problems(self, output: S3Output, check: str) -> list[str]:
        """What the write tasks' ``check`` found in their shards, and every shard object the
        bucket does not hold with the size the task sent (one listing)."""
        found = [p for i in range(len(self.plans)) for p in self.cov.problems.get(i, {}).get(check, [])]
        listings: dict[str, dict[str, int]] = {}
        for i, plan in enumerate(self.plans):
            if i in self.cov.missing:
                continue
            for v, objs in shard_homes(self.staged, plan, self.cov.key_index_bytes[i]).items():
                if v not in listings:
                    listings[v] = s3_output.list_sizes(output, version_dir(v))
                there = listings[v]
                for r, n in objs.items():
                    if (check == KEY_INDEX) != r.endswith(".parquet"):
                        continue
                    if there.get(r) != n:
                        found.append(f"{output}/{version_dir(v)}/{r}: {there.get(r, 'missing')} in the bucket, "
                                     f"{n} bytes sent")
        return found


def staged_shards(output: S3Output, work_root: str | Path | None, what: str,
                  state: tuple[str, ...] | None = staging.TASK_STATE, *,
                  skip: tuple[str, ...] = ()) -> StagedShards | None:
    """The staged plan (its ``state`` files, None: all, but not ``skip``) and its write records;
    None when nothing is staged over a published version."""
    staged = staged_or_refuse(output, what)
    if staged is None:
        return None
    folder = scratch_dir(output, work_root, what.replace(" ", "-"))
    shutil.rmtree(folder, ignore_errors=True)
    staging.pull_plan_state(output, staged, folder, state, skip=skip)
    config = pipeline.load_sharding_config(folder)
    with staging.staged_plan(output, staged, folder) as plan:
        plans = load_shards(folder, config, plan)
    return StagedShards(staged, folder, config, plans,
                        staging.coverage(plans, [r for r in records(bucket_staging(output), WRITE)
                                                 if r.get("plan_sha256") == staged.plan_sha256]))


@dataclass
class S3Commit:
    shards: StagedShards
    manifests: list[BucketManifest]  # written in ``shards.folder``
    published: PublishedVersion


def commit_staged(output: S3Output, *, work_root: str | Path | None = None, num_workers: int = 1,
                  now: Callable[[], float] = time.time) -> S3Commit | None:
    """Commit the plan staged in the bucket once every write task's record is there: manifests,
    one listing that checks every object, the pointer switch; then ``staged/`` goes. None when
    nothing is staged over a published version (the plan found it up to date)."""
    with build_lease(output):
        shards = staged_shards(output, work_root, "commit", state=None, skip=staging.COPIED_STATE)
        if shards is None:
            return None
        problem = shards.unfinished(output)
        if problem is not None:
            raise TasksUnfinishedError(f"commit of {output}: {problem}")
        refuse_altered_records(output, shards)
        folder, plans, cov = shards.folder, shards.plans, shards.cov
        cut = load_plan_cut(folder)
        position = {(p.bucket, p.index): i for i, p in enumerate(plans)}
        manifests = write_manifests(
            folder, shards.staged.source, plans, num_workers=num_workers,
            tar_sha256=lambda _out, p: cov.digests[position[(p.bucket, p.index)]],
            plan_modalities=cut.plan_modalities if cut else None, key_index_present=lambda _path: True)
        staged = shards.staged
        expected: dict[str, dict[str, int]] = {}  # version folder -> object -> size
        for i, p in enumerate(plans):
            for v, objs in shard_homes(staged, p, cov.key_index_bytes[i]).items():
                expected.setdefault(v, {}).update(objs)
        manifest_rels = sorted(m.path.relative_to(folder).as_posix() for m in manifests)
        state_rels = [f"{STATE_DIR}/{n}" for n in CARRIED_STATE if (folder / STATE_DIR / n).is_file()]
        bodies: dict[str, bytes | Path] = {r: folder / r for r in manifest_rels + state_rels}
        if staged.base is not None:  # their roots name the folder the tars are in
            bodies.update(published_in_place({r: (folder / r).read_bytes() for r in manifest_rels}, staged.base))
        mine = expected.setdefault(staged.version, {})
        for r, body in bodies.items():
            mine[r] = len(body) if isinstance(body, bytes) else body.stat().st_size
        copies = [n for n in CARRIED_STATE if n in staged.state and not (folder / STATE_DIR / n).is_file()]
        if copies:
            sizes = s3_output.list_sizes(output, staging.rel("state"))
            mine.update({f"{STATE_DIR}/{n}": sizes.get(n, -1) for n in copies})
        published = _publish(output, staged, bodies, manifest_rels, expected, now, copies)
        delete_staged(output)
        return S3Commit(shards, manifests, published)


def refuse_altered_records(output: S3Output, shards: StagedShards, threads: int = 16) -> None:
    """``StagedStateError`` naming the record and the tar unless each tar every write record
    names is in the bucket with the size the plan gives it and the record says, and with the
    record's sha256 where the server keeps one of the whole object (a put in one request sends
    it as ``ChecksumSHA256``, which the server checked against the bytes), else with the ETag
    its put got: the manifests take their checksums from the records, so an altered record
    would publish checksums no tar has. One HEAD per tar, on threads, before anything is sent."""
    staged, cov = shards.staged, shards.cov
    todo = [(i, p, m) for i, p in enumerate(shards.plans) for m in p.modalities]
    bucket = output.store()

    def check(item: tuple[int, Shard, str]) -> str | None:
        i, plan, m = item
        key = f"{version_dir(staged.home(True))}/{tar_rel(plan, m)}"
        said_bytes, said_sha = cov.tar_bytes[i].get(m), cov.digests[i].get(m)
        said_etag = cov.etags[i].get(m)
        try:
            info = bucket.head(output.key(key))
        except ObjectNotFoundError:
            info = None
        if info is None:
            there = "no object"
        elif said_bytes != plan.tar_bytes(m) or info.size != said_bytes:
            there = f"{info.size} bytes there, {plan.tar_bytes(m)} planned"
        elif info.sha256 is not None and info.sha256 != said_sha:
            there = f"sha256 {info.sha256} there"
        elif info.sha256 is None and said_etag is not None and info.etag != said_etag:
            there = f"ETag {info.etag} there, {said_etag} at its put"
        else:
            return None
        return (f"{cov.record[i]}: names {output}/{key} with {said_bytes} bytes and sha256 {said_sha}; {there}: the "
                "record was altered, or the tar replaced, after its task; nothing was published. Run `pid-shard "
                "plan` again (then the tasks and the commit)")

    with ThreadPoolExecutor(max(1, min(threads, len(todo)))) as pool:
        for problem in pool.map(check, todo):
            if problem is not None:
                raise staging.StagedStateError(problem)


def _publish(output: S3Output, staged: Staged, bodies: dict[str, bytes | Path], manifest_rels: list[str],
             expected: dict[str, dict[str, int]], now: Callable[[], float],
             copies: list[str] = ()) -> PublishedVersion:
    """The manifests and settings (``bodies``: path in the version folder -> bytes or file) of
    the staged version (whose tars the write tasks sent), and its state files ``copies``
    copied inside the bucket from ``staged/state/``, then the check of every object where it
    lives (``expected``: version folder -> object -> size) and the conditional pointer switch."""
    vid = staged.version
    uses = [staged.base] if staged.base is not None else []
    current, _etag = s3_output.read_pointer_tagged(output)
    refuse_if_moved(output, staged, current)
    result = PublishedVersion(str(output), vid, current.version if current else None)
    holder = this_process()
    check_held(output, vid)
    with s3_output.publish_claims(output, {vid}, now=now, holder=holder) as (claim,):
        for r, body in bodies.items():
            bucket_staging(output, "").put(f"{version_dir(vid)}/{r}", body, "the commit")
            result.uploaded += 1
        if copies:
            bucket = output.store()
            for n in copies:
                try:
                    bucket.copy(output.key(staging.rel("state", n)), output.key(version_dir(vid), STATE_DIR, n))
                except (ObjectNotFoundError, S3AccessError) as exc:
                    raise BuildError(f"{exc} (the commit copying the staged {n}; nothing was switched)") from None
            # A copy cannot be checked against the sha256 staged.json names; staged.json unchanged
            # after them says no plan was staged anew meanwhile (a new one replaces it first).
            if staging.read_staged(output) != staged:
                raise staging.StagedStateError(
                    f"{output}/{staging.rel(STAGED_NAME)} changed while the commit copied the staged state (another "
                    "build of this output is staging anew?): nothing was switched; run the commit again")
        pause_point("publish:before-verify")
        for v, objs in sorted(expected.items()):
            s3_output.verify_before_switch(output, v, objs)
        if current is not None and current.version == vid and current.uses == uses:
            result.unchanged = True
            return result
        pause_point("publish:before-switch")
        claim.check()
        check_held(output, vid)
        # If-Match the ETag the plan saw: a pointer moved since the plan (a newer build published)
        # refuses the switch (``switch_pointer`` only steps over a change of its retired record).
        s3_output.switch_pointer(output, vid, manifest_rels, current, staged.pointer.etag, holder, now, uses=uses)
    return result


def refuse_if_moved(output: S3Output, staged: Staged, current: VersionPointer | None) -> None:
    """``PublishRaceError`` unless the pointer still names the version the staged plan was cut
    against: a commit never moves the pointer back over a build published after the plan."""
    now_there = current.version if current else None
    if now_there == staged.pointer.version:
        return
    was = f"version {staged.pointer.version}" if staged.pointer.version else "no version (a first publish)"
    by = f" by {current.built_by}" if current is not None and current.built_by else ""
    raise PublishRaceError(
        f"{output}/{POINTER_NAME} names {f'version {now_there}' if now_there else 'no version'}{by}, published after "
        f"the plan staged in {output}/{staging.rel(STAGED_NAME)} was cut against {was}: committing it would move "
        "readers back over that build; nothing was switched. Run `pid-shard plan` again (then the tasks and the "
        "commit) to build on top of what is current now")
