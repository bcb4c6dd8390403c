"""Write task ``I`` of ``N``: shard range ``slice_bounds(shards, I, N)`` of the staged plan, then
its completion record, for a folder and an ``s3://`` output: one body (``run_write_task``) over a
``WriteTarget``, the seam below which a folder and a bucket differ.

For a folder, its shards' tars (hard-linked from the committed version when unchanged), key
indexes, stamps and digests go into the staging folder; write tasks run side by side (no build
lock; each touches only its own shards' files). For a bucket, each shard's tars are written into
a scratch folder of the machine, hashed, checked (twin keys, size bound, key index: the checks
run where the bytes are), sent to ``versions/<id>/`` (copied inside the bucket when the current
version holds the same bytes) with the key index, then a per-shard marker; a killed task run
again keeps every shard whose marker and objects are there. The record, with every shard's
digests and sizes (a bucket's, also its check findings), comes last.

A task that finds its own record for the same plan does nothing; one killed half way leaves only
files under temporary names or complete files, and run again writes the same bytes.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from loader.formats.twin_tar import tar_path
from loader.formats.version_pointer import version_dir
from loader.io.errors import ObjectNotFoundError
from loader.io.s3_client import S3AccessError
from pid_platform.sharding import pipeline
from pid_platform.sharding.commit import s3_output, versions
from pid_platform.sharding.commit.lease import check_held
from pid_platform.sharding.commit.manifests import write_key_index_of
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.commit.verify_output import (
    planned_key_index_mismatches,
    size_bound_violations,
    twin_key_mismatches,
)
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.intake.task import slice_bounds
from pid_platform.sharding.layout import final_dir
from pid_platform.sharding.pause_points import pause_point
from pid_platform.sharding.plan.add_modality import load_plan_cut
from pid_platform.sharding.plan.columnar import ShardRef
from pid_platform.sharding.plan.plan_files import (
    PlanSource,
    iter_shard_range,
    load_shards,
    shards_identity,
)
from pid_platform.sharding.plan.shard_plan import ShardingConfig, ShardPlan
from pid_platform.sharding.storage import SourceStore
from pid_platform.sharding.tasks import staging
from pid_platform.sharding.tasks.outcomes import (
    PLAN_ID,
    SHARD_DONE_POINT,
    SHARD_FIELDS,
    TaskOutcome,
    check_task,
    is_write_record_of,
    shard_done_point,
)
from pid_platform.sharding.tasks.published import current_manifests
from pid_platform.sharding.tasks.records import (
    WRITE,
    Staging,
    bucket_staging,
    folder_staging,
    get_doc,
    read_record,
    record_name,
    record_path,
    write_record,
)
from pid_platform.sharding.tasks.staging import (
    Staged,
    key_index_rel,
    scratch_dir,
    shard_homes,
    shard_marker,
    shard_objects,
    staged_folder_plan,
    staged_or_refuse,
    tar_rel,
)
from pid_platform.sharding.write.early_sync import sync_soon
from pid_platform.sharding.write.tar_digests import tar_digests
from pid_platform.sharding.write.tars import ShardResult, shard_files, write_shards


def shard_record(folder: Path, plan: ShardPlan, key_index: bool = True) -> dict:
    """What a write task's record says of one shard whose tars are in ``folder``: their sha256
    and sizes, and the size of its key index, written here from their headers (``key_index``;
    else None: any size)."""
    tars = tar_digests(folder, plan)
    if key_index:
        write_key_index_of(folder, plan)
    return {"digest": plan.digest(), "tars": tars,
            "key_index_bytes": (folder / key_index_rel(plan)).stat().st_size if key_index else None,
            "bytes": {m: (folder / tar_rel(plan, m)).stat().st_size for m in plan.modalities}}


class WriteTarget:
    """Where one write task puts its shards, and all that differs there between a folder and a
    bucket: the folder its tars are written into, what is already there (``kept``), what happens
    to a shard once its tars are in place (``finish``: a bucket sends it), how a tar equal to the
    committed version's is reused (a folder: ``previous``, hard links; a bucket: a copy inside
    it), and where the record goes. ``run_write_task`` does the rest, once for both."""

    folder: Path  # the shards' tars are written here
    records: Staging  # the task's record is here
    identity: dict  # what the record was done against: a record naming another plan is not this one's
    config: ShardingConfig
    previous: Path | None = None  # a committed folder: its tars up to date are hard-linked (``write_shards``)
    reuse: tuple[str, ...] | None = None  # the committed plan's modalities (``write_shards``)
    fields = SHARD_FIELDS  # the record's per-shard fields
    about: dict = {}  # the record's other fields
    counts: Counter[str]  # "copied", "repaired"

    def open(self) -> Iterator[tuple[list[ShardRef], PlanSource | None]]:
        """A context: the plan's shards (and plan file) while the output is set up to take them."""
        raise NotImplementedError

    def kept(self, plan: ShardPlan) -> dict | None:
        """The record's entry of a shard already in place that is not written again; None: written."""
        return None

    def finish(self, plan: ShardPlan, result: ShardResult) -> tuple[dict, bool]:
        """Once ``plan``'s tars are in ``folder`` (on the writer's worker): its record entry, and
        whether it counts as written."""
        raise NotImplementedError



class FolderTarget(WriteTarget):
    """The staging folder of a folder output (``staged``): tars up to date in the committed
    folder are hard-linked there, and an unchanged shard's stamp keeps it (``write_shards``)."""

    def __init__(self, out: Path, staged: Path, key_indexes: bool = True) -> None:
        self.out, self.folder, self.key_indexes = out, staged, key_indexes
        self.records = folder_staging(staged)
        self.config = pipeline.load_sharding_config(staged)
        self.shards = load_shards(staged, self.config)
        self.identity = {PLAN_ID: shards_identity(self.shards)}
        self.previous = final_dir(out)
        cut = load_plan_cut(staged)
        self.reuse = cut.reused_modalities if cut else None
        self.counts = Counter()

    @contextmanager
    def open(self) -> Iterator[tuple[list[ShardRef], PlanSource | None]]:
        versions.begin(self.out)
        yield self.shards, None

    def finish(self, plan: ShardPlan, result: ShardResult) -> tuple[dict, bool]:
        if result.written:
            # The disk starts on these bytes now, while later shards are written; the commit's
            # fsync of the whole staging folder stays the guarantee (``early_sync``).
            for m in plan.modalities:
                sync_soon(tar_path(self.folder, plan.bucket, m, plan.relpath))
        # Hashed while the bytes are in the page cache and the other workers copy.
        return shard_record(self.folder, plan, self.key_indexes), result.written


# The checks a write task runs on each shard's tars before it sends them (``verify_output``).
TWIN_KEYS, SIZE_BOUND, KEY_INDEX = "twin_keys", "size_bound", "key_index"


class BucketTarget(WriteTarget):
    """The version folder of a bucket output: each shard is written into a scratch folder of this
    machine, checked there, then sent (copied inside the bucket when the current version holds the
    same bytes; never onto itself) with its key index, then its marker. A shard whose marker and
    objects are there, or that the served version holds whole (a repair), is kept. ``repair``:
    each tar of the served version is read back, and sent again where its sha256 is not its
    manifest's."""

    def __init__(self, output: S3Output, staged: Staged, index: int, of: int, work_root: str | Path | None,
                 repair: bool) -> None:
        self.output, self.staged, self.work_root, self.repair = output, staged, work_root, repair
        self.what, self.scratch = f"write task {index} of {of}", f"write-{index}-of-{of}"
        self.records = self.markers = bucket_staging(output)
        self.identity, self.about = {"plan_sha256": staged.plan_sha256}, {"version": staged.version}
        self.fields = {**SHARD_FIELDS, "etags": "etags", "problems": "problems"}
        self.counts = Counter()
        self.damaged: set[str] = set()  # tars of the served version read back with another sha256

    @contextmanager
    def open(self) -> Iterator[tuple[list[ShardRef], PlanSource | None]]:
        output, staged = self.output, self.staged
        self.folder = staging.pull_plan_state(output, staged, scratch_dir(output, self.work_root, self.scratch),
                                              staging.TASK_STATE)
        self.config = pipeline.load_sharding_config(self.folder)
        self.cut = load_plan_cut(self.folder)
        check_held(output, staged.version)  # a leased build's lease says which version it publishes
        with s3_output.publish_claims(output, {staged.version, staged.home(True)}):
            self.there = {v: s3_output.list_sizes(output, version_dir(v)) for v in {staged.version, staged.home(True)}}
            pointer = s3_output.read_pointer(output)
            # Copies come only from a version whose folder holds its tars; the checksums vouch for
            # the tars an in-place version leaves where they are, wherever they are.
            self.current = pointer.version if pointer is not None and not pointer.uses else None
            self.sha: dict[str, str] = {}
            if pointer is not None:
                with suppress(ValueError):  # an unreadable manifest only costs the copies
                    self.sha = s3_output.checksums_of(current_manifests(output, pointer))
            if self.current is not None and self.current not in self.there:  # listed once: copies only from what is there
                self.there[self.current] = s3_output.list_sizes(output, version_dir(self.current))
            with staging.staged_plan(output, staged, self.folder) as plan_file:
                yield load_shards(self.folder, self.config, plan_file), plan_file
        shutil.rmtree(self.folder, ignore_errors=True)

    def kept(self, plan: ShardPlan) -> dict | None:
        staged, vdir = self.staged, version_dir(self.staged.version)
        if self.repair and staged.version == self.current:
            self.damaged.update(r for r in (tar_rel(plan, m) for m in plan.modalities)
                                if self.sha.get(r) != s3_output.object_sha256(self.output, f"{vdir}/{r}"))
        marker = get_doc(self.markers, shard_marker(plan))
        # A marker of an older pid-shard (no tar sizes) is not kept: its shard is sent again.
        if (marker is not None and marker.get("digest") == plan.digest() and isinstance(marker.get("bytes"), dict)
                and all(self.there[v].get(r) == n
                        for v, objs in shard_homes(staged, plan, marker.get("key_index_bytes")).items()
                        for r, n in objs.items())):
            return marker  # sent by an earlier run of this task
        return self._served(plan)  # whole in the served version: nothing to write or send

    def _served(self, plan: ShardPlan) -> dict | None:
        """The marker of a shard that the served version holds whole (a plan of the version the
        pointer names, staged again to repair it): every tar with the planned size and the checksum
        its manifest lists (none read back ``damaged``), and its key index."""
        if self.staged.version != self.current or self.staged.base is not None:
            return None
        if any(tar_rel(plan, m) in self.damaged for m in plan.modalities):
            return None
        listed = self.there[self.staged.version]
        index_bytes = listed.get(key_index_rel(plan))
        if index_bytes is None or any(listed.get(r) != n for r, n in shard_objects(plan, index_bytes).items()):
            return None
        shas = {m: self.sha.get(tar_rel(plan, m)) for m in plan.modalities}
        if not all(shas.values()):
            return None
        return {"digest": plan.digest(), "tars": shas, "key_index_bytes": index_bytes, "problems": {},
                "bytes": {m: plan.tar_bytes(m) for m in plan.modalities}}

    def finish(self, plan: ShardPlan, result: ShardResult) -> tuple[dict, bool]:
        output, staged, scratch, there, sha, current = (self.output, self.staged, self.folder, self.there, self.sha,
                                                        self.current)
        marker = {**shard_record(scratch, plan), "etags": {}, "problems": {
            TWIN_KEYS: twin_key_mismatches(scratch, [plan]),
            SIZE_BOUND: size_bound_violations(scratch, [plan], self.config, self.cut.plan_modalities if self.cut else None),
            KEY_INDEX: planned_key_index_mismatches(scratch, [plan])}}
        shas, bucket, home = marker["tars"], output.store(), staged.home(True)
        try:
            for m in plan.modalities:
                r = tar_rel(plan, m)
                if m in staged.reused:  # in place already: checked, never sent
                    if sha.get(r) != shas[m]:
                        raise BuildError(f"{output}: the current version does not list {r} with the bytes this "
                                         f"plan gives it (sha256 {shas[m]}): the pointer moved since the plan; run "
                                         "`pid-shard plan` again (nothing was published)")
                elif home != staged.version and r in there[home]:
                    pass  # put there by an earlier run of this version (its MARKER): never replaced, checked below
                elif home == current and there[home].get(r) == plan.tar_bytes(m) and sha.get(r) == shas[m] \
                        and r not in self.damaged:
                    pass  # the served version's own object (a repair): never copied onto itself
                elif current not in (None, home) and sha.get(r) == shas[m] and there[current].get(r) == plan.tar_bytes(m):
                    bucket.copy(output.key(version_dir(current), r), output.key(version_dir(home), r))
                    self.counts["copied"] += 1
                else:
                    self.counts["repaired"] += staged.version == current  # a repair of the served version
                    marker["etags"][m] = bucket.put(output.key(version_dir(home), r), scratch / r, sha256=shas[m])
            bucket.put(output.key(version_dir(staged.version), key_index_rel(plan)), scratch / key_index_rel(plan))
            # Last: the marker vouches for the shard's objects (a rerun keeps them).
            self.markers.put(shard_marker(plan), json.dumps(marker, sort_keys=True).encode(), self.what)
        except (S3AccessError, ObjectNotFoundError) as exc:
            raise BuildError(f"{exc} ({self.what}, shard {plan.relpath}; nothing was published)") from None
        for f in shard_files(scratch, plan):
            f.unlink(missing_ok=True)
        return marker, True


def run_write_task(
    store: SourceStore, source: str, out: Path | S3Output, index: int, of: int, *, num_workers: int = 1,
    progress: Callable[[int, int], None] | None = None, key_indexes: bool = True,
    work_root: str | Path | None = None, repair: bool = False,
) -> TaskOutcome:
    """Write task ``index`` of ``of``: its range of the staged plan's shards (tars and key
    indexes), then its record, naming each shard's tar digests and sizes and key index size
    (``shard_record``), for a folder (``FolderTarget``) as for a bucket (``BucketTarget``:
    ``work_root``, ``repair``): the commit takes its checksums from them.
    ``progress(done, total)`` after each of its shards is in place. ``key_indexes`` False (a
    folder's Dagster steps): the key indexes are left to the ``key_indexes`` step, after the
    blocking checks on the tars (a kept tar damaged in place fails its check, not this task).

    Takes no build lock: the write tasks of one plan run side by side, each writing only its own
    shards' files (and clearing only their temporary leftovers). Start them after the plan and
    finish them before the commit, which hold the lock (a bucket's: its lease and claims).
    """
    check_task(index, of)
    what = f"write task {index} of {of}"
    target: WriteTarget | None
    if isinstance(out, S3Output):
        staged = staged_or_refuse(out, what)
        target = None if staged is None else BucketTarget(out, staged, index, of, work_root, repair)
        where = bucket_staging(out).url(record_name(WRITE, index, of))
    else:
        found = staged_folder_plan(Path(out), what)
        target = None if found is None else FolderTarget(Path(out), found[0], key_indexes)
        where = str(record_path(versions.staging_dir(Path(out)), WRITE, index, of))
    if target is None:
        return TaskOutcome(WRITE, index, of, where, True, nothing_staged=True)
    rec = read_record(target.records, WRITE, index, of)
    if rec is not None and is_write_record_of(rec, target.identity):
        first, stop = rec["shards"]
        return TaskOutcome(WRITE, index, of, rec["path"], True, stop - first, first)
    with target.open() as (shards, plan_file):
        first, stop = slice_bounds(len(shards), index, of)
        entries, written = write_range(store, source, target, shards, first, stop, plan_file, num_workers=num_workers,
                                       progress=progress, pause=(index, of))
        # Last: the record says every output of these shards is in place, with each tar's sha256.
        path = write_record(target.records, WRITE, index, of, {
            **target.identity, **target.about, "shards": [first, stop], "written": written,
            **{name: {str(i): m.get(key, {}) for i, m in sorted(entries.items())} for name, key in target.fields.items()}})
    return TaskOutcome(WRITE, index, of, path, False, stop - first, first, len(written), stop - first - len(written),
                       copied=target.counts["copied"], repaired=target.counts["repaired"])


def write_range(store: SourceStore, source: str, target: WriteTarget, shards: list[ShardRef], first: int,
                stop: int, plan_file: PlanSource | None = None, *, num_workers: int,
                progress: Callable[[int, int], None] | None, pause: tuple[int, int] | None = None,
                ) -> tuple[dict[int, dict], list[int]]:
    """Shards ``first`` .. ``stop`` of the plan into ``target``, a row group of the plan at a time
    (``plan_files.iter_shard_range``): the writer holds one row group's samples as objects.
    ``progress(done, total)`` after each shard written; ``pause`` (task index, of): its pause
    points after each. Each shard's record entry by position, and the positions written."""
    position = {(p.bucket, p.index): i for i, p in enumerate(shards)}
    found: dict[int, dict] = {}
    written: list[int] = []
    finished = 0

    def then(plan: ShardPlan, result: ShardResult) -> None:
        i = position[(plan.bucket, plan.index)]
        found[i], wrote = target.finish(plan, result)
        if wrote:
            written.append(i)
        if pause is not None:
            pause_point(SHARD_DONE_POINT)
            pause_point(shard_done_point(*pause))

    def step(_result: ShardResult) -> None:
        nonlocal finished
        finished += 1
        if progress is not None:
            progress(finished, stop - first)

    for batch in iter_shard_range(target.folder, target.config, shards, first, stop, plan_file):
        todo = []
        for plan in batch:
            if (entry := target.kept(plan)) is not None:
                found[position[(plan.bucket, plan.index)]] = entry
                finished += 1
            else:
                todo.append(plan)
        write_shards(store, source, target.folder, todo, previous=target.previous, num_workers=num_workers,
                     progress=step, then=then, reuse=target.reuse)
    return found, sorted(written)
