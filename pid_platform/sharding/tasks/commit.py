"""The commit, for a folder and an ``s3://`` output alike (``commit_staged``): every shard of the
staged plan must lie in a finished write task's record; each record is checked against the
objects (a record whose shard lost an object, or whose object changed size, is removed and its
task sent back; one that names a size or checksum its tar does not have is refused); the
manifests come from the plan and the records' digests (no tar is read); then the output's
switch: a folder's swap (``versions.commit``), or a bucket's pointer, switched only from the one
the plan saw (``staged.json``), after which ``staged/`` is deleted.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from loader.formats.atomic import remove_stale_temp_files
from loader.formats.version_pointer import (
    POINTER_NAME,
    VersionPointer,
    version_dir,
)
from loader.formats.wdinfo import WDINFO_NAME, root_base
from loader.io.errors import ObjectNotFoundError
from loader.io.objects import LocalObjects, ObjectInfo, ObjectStore
from loader.io.s3_client import S3AccessError
from pid_platform.sharding import pipeline
from pid_platform.sharding.commit import s3_output, versions
from pid_platform.sharding.commit.claims import this_process
from pid_platform.sharding.commit.in_place import published_manifests as published_in_place
from pid_platform.sharding.commit.lease import build_lease, check_held
from pid_platform.sharding.commit.manifest_roots import rewrite_manifest_roots
from pid_platform.sharding.commit.manifests import (
    BucketManifest,
    remove_unplanned,
    write_manifests,
)
from pid_platform.sharding.commit.s3_output import (
    CARRIED_STATE,
    PublishedVersion,
    PublishRaceError,
    S3Output,
)
from pid_platform.sharding.commit.state import save_outputs
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.intake.task import IntakeReport
from pid_platform.sharding.layout import STATE_DIR, bucket_dir, final_dir
from pid_platform.sharding.output_lock import build_lock
from pid_platform.sharding.pause_points import pause_point
from pid_platform.sharding.plan.add_modality import (
    load_plan_cut,
    refuse_keep_for_positional_readers,
)
from pid_platform.sharding.plan.columnar import Shard, ShardRef
from pid_platform.sharding.plan.plan_files import load_shards, shards_identity
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.tasks import staging
from pid_platform.sharding.tasks.outcomes import (
    PLAN_ID,
    TasksUnfinishedError,
    Unfinished,
    is_write_record_of,
    report_of,
    unfinished_write,
    validate_of,
)
from pid_platform.sharding.tasks.records import (
    TASKS_DIR,
    WRITE,
    Staging,
    bucket_staging,
    folder_staging,
    record_name,
    records,
)
from pid_platform.sharding.tasks.staging import (
    STAGED_NAME,
    Staged,
    delete_staged,
    key_index_rel,
    scratch_dir,
    shard_homes,
    staged_folder_plan,
    staged_or_refuse,
    tar_rel,
)
from pid_platform.sharding.tasks.write import KEY_INDEX
from pid_platform.sharding.write.tar_digests import tar_digests
from pid_platform.sharding.write.tars import ShardResult


def run_commit(out: Path | S3Output, *, num_workers: int = 1, manifest_root: str = "relative",
               work_root: str | Path | None = None) -> pipeline.BuildSummary | None:
    """``pid-shard commit``: ``commit_staged``, and its summary. With nothing staged over a
    committed build (the plan found it up to date), a folder's manifests only get their roots
    rewritten if asked otherwise and the committed build is reported; a bucket's: None."""
    done = commit_staged(out, work_root=work_root, num_workers=num_workers, manifest_root=manifest_root)
    if done is None and isinstance(out, S3Output):
        return None
    if done is None:
        with build_lock(out):
            final = final_dir(out)
            rewrite_manifest_roots(out, manifest_root)
            report, plans = report_of(final), load_shards(final, pipeline.load_sharding_config(final))
            manifests = [Path(out) / bucket_dir(Path(), b) / WDINFO_NAME for b in sorted({p.bucket for p in plans})]
            return pipeline.BuildSummary(report.source, Path(out), report, pipeline.summarize(pipeline.planned_results(
                plans)), manifests, [], validate_of(final), up_to_date=True)
    shards, published = done.shards, done.published
    summary = pipeline.BuildSummary(
        shards.source, shards.folder if published else Path(out), done.report, pipeline.summarize(shards.results()),
        [m.path for m in done.manifests], done.removed, done.validate, up_to_date=bool(published and published.unchanged),
        published=published.url if published else None)
    shards.discard()
    return summary


@dataclass
class StagedShards:
    """The plan staged for an output, as its write tasks left it: in a folder output's staging
    folder, or read from the bucket's ``staged/`` into a scratch folder."""

    staged: Staged | None  # a bucket's ``staged.json``; None for a folder output
    folder: Path  # the plan's state: the staging folder, or the scratch folder holding the bucket's
    config: ShardingConfig
    plans: list[ShardRef]  # one row per shard (``plan_files.load_shards``): no sample is read
    recs: list[dict]  # the write records of this plan
    records_at: Staging  # where the write records are
    cov: staging.Coverage

    @cached_property
    def source(self) -> str:
        return self.staged.source if self.staged is not None else report_of(self.folder).source

    def results(self) -> list[ShardResult]:
        return pipeline.planned_results(self.plans, self.cov.written.__contains__)

    def unfinished(self, damaged: bool = False) -> Unfinished | None:
        return unfinished_write(len(self.plans), self.cov.ofs, self.cov.missing,
                                self.records_at.url(TASKS_DIR) + "/", damaged=damaged)

    def discard(self) -> None:
        """Remove the scratch folder a bucket's staged plan was read into (a folder's stays)."""
        if self.staged is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def objects(self, out: Path | S3Output, version: str) -> tuple[ObjectStore, str]:
        """The store and key prefix of ``version``'s objects: the staging folder's own files, or
        the bucket's ``versions/<version>/``."""
        if self.staged is None:
            return LocalObjects(self.folder), ""
        return out.store(), out.key(version_dir(version)) + "/"  # type: ignore[union-attr]

    def tars(self, out: Path | S3Output, plan: Shard) -> dict[str, tuple[str, ObjectInfo | None]]:
        """Where each of ``plan``'s tars is, and what is there now with its sha256 where one is
        kept: a bucket's server keeps one of an object put in one request; a folder, its tar
        digest cache (``tar_digests``, read once for the shard's tars: a file changed since it
        was hashed is hashed again)."""
        store, prefix = self.objects(out, self.staged.home(True) if self.staged is not None else "")
        found: dict[str, tuple[str, ObjectInfo | None]] = {}
        for m in plan.modalities:
            key = prefix + tar_rel(plan, m)
            try:
                info = store.head(key)
            except (ObjectNotFoundError, OSError):
                info = None
            found[m] = (store.url(key), info)
        if self.staged is None and all(info is not None for _url, info in found.values()):
            try:
                digests = tar_digests(self.folder, plan)
            except OSError:  # a tar gone since its head
                return {m: (url, None) for m, (url, _info) in found.items()}
            found = {m: (url, replace(info, sha256=digests[m])) for m, (url, info) in found.items()}
        return found

    def unlike_listed(self, out: Path | S3Output) -> Iterator[tuple[int, str, str, int | None, int]]:
        """Each object of a recorded shard that the listing of its folder (one per folder) does
        not show with the size the plan and the record give it: (position, version, its path
        there, its size there, that size)."""
        listings: dict[str, dict[str, int]] = {}
        for i, plan in enumerate(self.plans):
            if i in self.cov.missing:
                continue
            kib = self.cov.key_index_bytes[i]
            any_size = key_index_rel(plan) if kib is None else None  # only there (``shard_record``)
            for v, objs in shard_homes(self.staged, plan, kib).items():
                if v not in listings:
                    store, prefix = self.objects(out, v)
                    listings[v] = {o.key[len(prefix):]: o.size for o in store.list(prefix)}
                there = listings[v]
                yield from ((i, v, r, there.get(r), n) for r, n in objs.items()
                            if there.get(r) != n and not (r == any_size and r in there))

    def problems(self, output: S3Output, check: str) -> list[str]:
        """What the write tasks' ``check`` found in their shards, and every shard object the
        bucket does not hold with the size the task sent."""
        return [p for i in range(len(self.plans)) for p in self.cov.problems.get(i, {}).get(check, [])] + [
            f"{output}/{version_dir(v)}/{r}: {'missing' if got is None else got} in the bucket, {n} bytes sent"
            for _i, v, r, got, n in self.unlike_listed(output) if (check == KEY_INDEX) == r.endswith(".parquet")]


def staged_shards(out: Path | S3Output, work_root: str | Path | None, what: str,
                  state: tuple[str, ...] | None = staging.TASK_STATE, *,
                  skip: tuple[str, ...] = ()) -> StagedShards | None:
    """The staged plan and its write records; None when nothing is staged over a published
    version. A bucket's: its ``state`` files (None: all, but not ``skip``) read into a scratch
    folder of this machine."""
    if not isinstance(out, S3Output):
        found = staged_folder_plan(Path(out), what)
        if found is None:
            return None
        folder, config, kept = found[0], pipeline.load_sharding_config(found[0]), folder_staging(found[0])
        plan_id = shards_identity(plans := load_shards(folder, config))
        recs = [r for r in records(kept, WRITE) if is_write_record_of(r, {PLAN_ID: plan_id})]
        return StagedShards(None, folder, config, plans, recs, kept, staging.coverage(plans, recs))
    staged = staged_or_refuse(out, what)
    if staged is None:
        return None
    folder = scratch_dir(out, work_root, what.replace(" ", "-"))
    shutil.rmtree(folder, ignore_errors=True)
    staging.pull_plan_state(out, staged, folder, state, skip=skip)
    config = pipeline.load_sharding_config(folder)
    with staging.staged_plan(out, staged, folder) as plan:
        plans = load_shards(folder, config, plan)
    kept = bucket_staging(out)
    recs = [r for r in records(kept, WRITE) if is_write_record_of(r, {"plan_sha256": staged.plan_sha256})]
    return StagedShards(staged, folder, config, plans, recs, kept, staging.coverage(plans, recs))


@dataclass
class Committed:
    shards: StagedShards
    manifests: list[BucketManifest]  # at the folder's published paths; in ``shards.folder`` for a bucket
    report: IntakeReport
    validate: str
    removed: list[Path]  # a folder's: the build files of the previous version the new one dropped
    published: PublishedVersion | None = None  # a bucket's


def commit_staged(out: Path | S3Output, *, work_root: str | Path | None = None, num_workers: int = 1,
                  manifest_root: str = "relative", now: Callable[[], float] = time.time) -> Committed | None:
    """Commit the plan staged for ``out`` once every write task's record is there: each record
    checked against the objects, manifests from the plan and the records, then the switch.
    None when nothing is staged over a published version (the plan found it up to date).

    ``manifest_root`` (a folder's): ``"relative"`` roots (``"."``), ``"absolute"`` (the
    published folder's absolute path, which PiD's reader needs) or the URL the output is
    published at (``s3://...``); a bucket's manifests keep relative roots."""
    on_s3 = isinstance(out, S3Output)
    base = None if on_s3 else root_base(manifest_root, final_dir(out))  # refused before anything is written
    with build_lease(out) if on_s3 else build_lock(out):
        shards = staged_shards(out, work_root, "commit", state=None, skip=staging.COPIED_STATE)
        if shards is None:
            return None
        damaged = drop_damaged_records(out, shards)
        problem = shards.unfinished(damaged)
        if problem is not None:
            raise TasksUnfinishedError(f"commit of {out}: {problem}")
        refuse_altered_records(out, shards)
        folder, plans, cov = shards.folder, shards.plans, shards.cov
        cut = load_plan_cut(folder)
        if not on_s3:
            refuse_keep_for_positional_readers(manifest_root, str(final_dir(out)), cut=cut)
        position = {(p.bucket, p.index): i for i, p in enumerate(plans)}
        manifests = write_manifests(
            folder, shards.source, plans, num_workers=num_workers, root_base=base,
            tar_sha256=lambda _out, p: cov.digests[position[(p.bucket, p.index)]],
            plan_modalities=cut.plan_modalities if cut else None)
        done = Committed(shards, manifests, report_of(folder), validate_of(folder), [])
        if on_s3:
            done.published = _publish_staged(out, shards, manifests, now)
        else:
            done.manifests, done.removed = _swap(Path(out), shards, manifests)
        return done


def _swap(out: Path, shards: StagedShards, manifests: list[BucketManifest]) -> tuple[list[BucketManifest], list[Path]]:
    """A folder's switch: the staging folder holds only what the plan names, then replaces the
    output folder (``versions.commit``). Returns the manifests at their published paths and the
    files of the previous version the new one dropped."""
    folder = shards.folder
    remove_unplanned(folder, shards.plans)  # an earlier, unfinished build may have left other shards
    remove_stale_temp_files(folder)  # and temporary files (every write task is done: none is being written)
    save_outputs(folder, shards.plans)  # what a later no-op rebuild checks the published files against
    removed = versions.commit(out)
    return [replace(m, path=out / m.path.relative_to(folder)) for m in manifests], removed


def _publish_staged(output: S3Output, shards: StagedShards, manifests: list[BucketManifest],
                    now: Callable[[], float]) -> PublishedVersion:
    """A bucket's switch: the manifests and state into the version folder, every object
    checked where it lives, the pointer switched; then ``staged/`` goes."""
    folder, staged, cov = shards.folder, shards.staged, shards.cov
    assert staged is not None
    expected: dict[str, dict[str, int]] = {}  # version folder -> object -> size
    for i, p in enumerate(shards.plans):
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
    return published


def drop_damaged_records(out: Path | S3Output, shards: StagedShards) -> bool:
    """Remove each write record one of whose shards' objects is missing now, or not of the size
    the plan and the record give it (a tar deleted since, lost in a power cut after the record):
    its task runs again when started, and the shards it covered are unfinished. True when one was."""
    damaged = {shards.cov.record[i] for i, *_ in shards.unlike_listed(out)}
    gone = [r for r in shards.recs if r["path"] in damaged]
    if gone:
        shards.records_at.delete(*(record_name(WRITE, r["index"], r["of"]) for r in gone))
        shards.recs = [r for r in shards.recs if r["path"] not in damaged]
        # The removed records' --of still says which tasks to run.
        shards.cov = replace(staging.coverage(shards.plans, shards.recs), ofs=shards.cov.ofs)
    return bool(gone)


def refuse_altered_records(out: Path | S3Output, shards: StagedShards, threads: int = 16) -> None:
    """``StagedStateError`` naming the record and the tar unless each tar every write record
    names is there with the size the plan gives it and the record says, and with the record's
    sha256 where one of the whole object is kept (a bucket's server keeps the ``ChecksumSHA256``
    a put in one request sent, which it checked against the bytes; a folder, its tar digest
    cache), else with the ETag its put got: the manifests take their checksums from the records,
    so an altered record would publish checksums no tar has. On threads, before anything is sent."""
    cov = shards.cov
    todo = [(i, p) for i, p in enumerate(shards.plans) if i not in cov.missing]

    def check(item: tuple[int, Shard]) -> str | None:
        i, plan = item
        for m, (url, info) in shards.tars(out, plan).items():
            said_bytes, said_sha = cov.tar_bytes[i].get(m), cov.digests[i].get(m)
            said_etag = cov.etags[i].get(m)
            if info is None:
                there = "no object"
            elif said_bytes != plan.tar_bytes(m) or info.size != said_bytes:
                there = f"{info.size} bytes there, {plan.tar_bytes(m)} planned"
            elif info.sha256 is not None and info.sha256 != said_sha:
                there = f"sha256 {info.sha256} there"
            elif info.sha256 is None and said_etag is not None and info.etag != said_etag:
                there = f"ETag {info.etag} there, {said_etag} at its put"
            else:
                continue
            return (f"{cov.record[i]}: names {url} with {said_bytes} bytes and sha256 "
                    f"{said_sha}; {there}: the record was altered, or the tar replaced, after its task; nothing was "
                    "published. Run `pid-shard plan` again (then the tasks and the commit)")
        return None

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
    result = PublishedVersion(str(output), vid)
    holder = this_process()
    check_held(output, vid)
    with s3_output.publish_claims(output, {vid}, now=now, holder=holder) as (claim,):
        for r, body in bodies.items():
            bucket_staging(output, "").put(f"{version_dir(vid)}/{r}", body, "the commit")
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
