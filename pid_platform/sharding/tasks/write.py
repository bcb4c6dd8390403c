"""Write task ``I`` of ``N``: shard range ``slice_bounds(shards, I, N)`` of the staged plan, then
its completion record, for a folder and an ``s3://`` output.

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
from collections.abc import Callable
from pathlib import Path

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
from pid_platform.sharding.pause_points import pause_point
from pid_platform.sharding.plan.add_modality import load_plan_cut
from pid_platform.sharding.plan.plan_files import (
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
    TaskOutcome,
    check_task,
    shard_done_point,
)
from pid_platform.sharding.tasks.published import current_manifests
from pid_platform.sharding.tasks.records import (
    WRITE,
    bucket_staging,
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
from pid_platform.sharding.write.tar_digests import tar_digests
from pid_platform.sharding.write.tars import (
    ShardResult,
    shard_files,
    write_shards,
)


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


def record_fields(found: dict[int, dict]) -> dict:
    """A write record's per-shard fields (``staging.coverage`` reads them), by shard position."""
    return {"digests": {str(i): m["tars"] for i, m in sorted(found.items())},
            "key_index_bytes": {str(i): m["key_index_bytes"] for i, m in sorted(found.items())},
            "tar_sizes": {str(i): m["bytes"] for i, m in sorted(found.items())}}


def run_write_task(
    store: SourceStore, source: str, out: Path | S3Output, index: int, of: int, *, num_workers: int = 1,
    progress: Callable[[int, int], None] | None = None, key_indexes: bool = True,
    work_root: str | Path | None = None, repair: bool = False,
) -> TaskOutcome:
    """Write task ``index`` of ``of``: its range of the staged plan's shards (tars and key
    indexes), then its record, naming each shard's tar digests and sizes and key index size
    (``shard_record``), for a folder as for a bucket: the commit takes its checksums from them.
    ``progress(done, total)`` after each of its shards is in place. ``key_indexes`` False (a
    folder's Dagster steps): the key indexes are left to the ``key_indexes`` step, after the
    blocking checks on the tars (a kept tar damaged in place fails its check, not this task).
    For a bucket: ``write_into_bucket`` (``work_root``, ``repair``).

    Takes no build lock: the write tasks of one plan run side by side, each writing only its own
    shards' files (and clearing only their temporary leftovers). Start them after the plan and
    finish them before the commit, which hold the lock.
    """
    check_task(index, of)
    if isinstance(out, S3Output):
        return write_into_bucket(store, source, out, index, of, work_root=work_root, num_workers=num_workers,
                                 progress=progress, repair=repair)
    out = Path(out)
    found = staged_folder_plan(out, f"write task {index} of {of}")
    if found is None:
        return TaskOutcome(WRITE, index, of, str(record_path(versions.staging_dir(out), WRITE, index, of)), True,
                           nothing_staged=True)
    staged, _plan_file = found
    config = pipeline.load_sharding_config(staged)
    shards = load_shards(staged, config)
    plan_id = shards_identity(shards)
    rec = read_record(staged, WRITE, index, of)
    # A record of an older pid-shard (no digests) is not taken for done: its task runs again.
    if rec is not None and rec.get(PLAN_ID) == plan_id and "digests" in rec:
        first, stop = rec["shards"]
        return TaskOutcome(WRITE, index, of, rec["path"], True, stop - first, first)
    staging = versions.begin(out)
    first, stop = slice_bounds(len(shards), index, of)
    after = pipeline.after_shard(staging)
    position = {(p.bucket, p.index): i for i, p in enumerate(shards)}
    recorded: dict[int, dict] = {}  # shard position -> what its record says of it

    def then(plan: ShardPlan, result: ShardResult) -> None:
        after(plan, result)
        recorded[position[(plan.bucket, plan.index)]] = shard_record(staging, plan, key_indexes)
        pause_point(SHARD_DONE_POINT)
        pause_point(shard_done_point(index, of))

    # Its own samples, no others, a row group's shards at a time.
    results = pipeline.write_range(store, source, out, config, shards, first, stop, num_workers=num_workers,
                                   progress=progress, then=then)
    written = [first + i for i, r in enumerate(results) if r.written]
    # Last: the record says every output of these shards is in place.
    path = write_record(staging, WRITE, index, of, {
        PLAN_ID: plan_id, "shards": [first, stop], "written": written, **record_fields(recorded),
    })
    return TaskOutcome(WRITE, index, of, path, False, len(results), first, len(written), len(results) - len(written))


# The checks a write task runs on each shard's tars before it sends them (``verify_output``).
TWIN_KEYS, SIZE_BOUND, KEY_INDEX = "twin_keys", "size_bound", "key_index"


class _CurrentTars:
    """The sha256 of each tar the current version lists: a write task copies one with the same
    bytes inside the bucket instead of uploading it."""

    def __init__(self, output: S3Output) -> None:
        pointer = s3_output.read_pointer(output)
        # Copies come only from a version whose folder holds its tars; the checksums vouch for
        # the tars an in-place version leaves where they are, wherever they are.
        self.version = pointer.version if pointer is not None and not pointer.uses else None
        self.sha: dict[str, str] = {}
        if pointer is not None:
            try:
                self.sha = s3_output.checksums_of(current_manifests(output, pointer))
            except ValueError:
                self.sha = {}  # an unreadable manifest only costs the copies


def _shard_problems(folder: Path, plan: ShardPlan, config: ShardingConfig,
                    plan_modalities: tuple[str, ...] | None) -> dict[str, list[str]]:
    """What the checks on ``twin_tar_shards`` and ``key_indexes`` find in one shard's files."""
    return {
        TWIN_KEYS: twin_key_mismatches(folder, [plan]),
        SIZE_BOUND: size_bound_violations(folder, [plan], config, plan_modalities),
        KEY_INDEX: planned_key_index_mismatches(folder, [plan]),
    }


def write_into_bucket(
    store: SourceStore, source: str, output: S3Output, index: int, of: int, *, work_root: str | Path | None = None,
    num_workers: int = 1, progress: Callable[[int, int], None] | None = None, repair: bool = False,
) -> TaskOutcome:
    """Write task ``index`` of ``of`` of the plan staged in the bucket: its shards' tars and key
    indexes into ``versions/<id>/``, shard by shard, then its record. ``repair``: each tar of
    the served version is read back, and sent again where its sha256 is not its manifest's."""
    check_task(index, of)
    kept = bucket_staging(output)
    staged = staged_or_refuse(output, f"write task {index} of {of}")
    if staged is None:
        return TaskOutcome(WRITE, index, of, kept.url(record_name(WRITE, index, of)), True, nothing_staged=True)
    rec = read_record(kept, WRITE, index, of)
    if rec is not None and rec.get("plan_sha256") == staged.plan_sha256:
        first, stop = rec["shards"]
        return TaskOutcome(WRITE, index, of, rec["path"], True, stop - first, first)
    scratch = staging.pull_plan_state(output, staged, scratch_dir(output, work_root, f"write-{index}-of-{of}"),
                                      staging.TASK_STATE)
    config = pipeline.load_sharding_config(scratch)
    cut = load_plan_cut(scratch)
    check_held(output, staged.version)  # a leased build's lease says which version it publishes
    with s3_output.publish_claims(output, {staged.version, staged.home(True)}):
        vdir = version_dir(staged.version)
        there = {v: s3_output.list_sizes(output, version_dir(v)) for v in {staged.version, staged.home(True)}}
        current = _CurrentTars(output)
        if current.version is not None and current.version not in there:
            there[current.version] = s3_output.list_sizes(output, version_dir(current.version))

        def there_current() -> dict[str, int]:
            return there[current.version]  # listed once: a copy only from an object that is there

        bucket = output.store()
        counts: Counter[str] = Counter()
        found: dict[int, dict] = {}  # shard position -> its marker
        sent: list[int] = []  # positions of the shards this run wrote and sent
        position: dict[int, int] = {}  # id of a planned shard being written -> its position
        damaged: set[str] = set()  # tars of the served version read back with another sha256 (``repair``)

        def read_back(plan: ShardPlan) -> None:
            if repair and current.version is not None and staged.version == current.version:
                for m in plan.modalities:
                    r = tar_rel(plan, m)
                    if current.sha.get(r) != s3_output.object_sha256(output, f"{vdir}/{r}"):
                        damaged.add(r)

        def send(plan: ShardPlan, _result: ShardResult) -> None:
            i = position[id(plan)]
            marker = {**shard_record(scratch, plan), "etags": {},
                      "problems": _shard_problems(scratch, plan, config, cut.plan_modalities if cut else None)}
            shas, index_rel = marker["tars"], key_index_rel(plan)
            try:
                for m in plan.modalities:
                    rel_m, home = tar_rel(plan, m), staged.home(True)
                    if m in staged.reused:  # in place already: checked, never sent
                        if current.sha.get(rel_m) != shas[m]:
                            raise BuildError(f"{output}: the current version does not list {rel_m} with the bytes this "
                                             f"plan gives it (sha256 {shas[m]}): the pointer moved since the plan; run "
                                             "`pid-shard plan` again (nothing was published)")
                    elif home != staged.version and rel_m in there[home]:
                        pass  # put there by an earlier run of this version (its MARKER): never replaced, checked below
                    elif home == current.version and there[home].get(rel_m) == plan.tar_bytes(m) \
                            and current.sha.get(rel_m) == shas[m] and rel_m not in damaged:
                        pass  # the served version's own object (a repair): never copied onto itself
                    elif current.version not in (None, home) and current.sha.get(rel_m) == shas[m] \
                            and there_current().get(rel_m) == plan.tar_bytes(m):
                        bucket.copy(output.key(version_dir(current.version), rel_m), output.key(version_dir(home), rel_m))
                        counts["copied"] += 1
                    else:
                        counts["repaired"] += staged.version == current.version  # a repair of the served version
                        marker["etags"][m] = bucket.put(output.key(version_dir(home), rel_m), scratch / rel_m,
                                                        sha256=shas[m])
                bucket.put(output.key(vdir, index_rel), scratch / index_rel)
                # Last: the marker vouches for the shard's objects (a rerun keeps them).
                kept.put(shard_marker(plan), json.dumps(marker, sort_keys=True).encode(), f"write task {index} of {of}")
            except (S3AccessError, ObjectNotFoundError) as exc:
                raise BuildError(f"{exc} (write task {index} of {of}, shard {plan.relpath}; nothing was published)") from None
            found[i] = marker
            for f in shard_files(scratch, plan):
                f.unlink(missing_ok=True)
            pause_point(SHARD_DONE_POINT)
            pause_point(shard_done_point(index, of))

        with staging.staged_plan(output, staged, scratch) as plan_file:
            shards = load_shards(scratch, config, plan_file)
            first, stop = slice_bounds(len(shards), index, of)
            finished = 0
            at = first
            # Its own samples, no others, a row group's shards at a time.
            for batch in iter_shard_range(scratch, config, shards, first, stop, plan_file):
                todo = []
                for i, plan in enumerate(batch, start=at):
                    read_back(plan)
                    marker = get_doc(kept, shard_marker(plan))
                    # A marker of an older pid-shard (no tar sizes) is not kept: its shard is sent again.
                    if (marker is not None and marker.get("digest") == plan.digest()
                            and isinstance(marker.get("bytes"), dict) and all(
                            there[v].get(r) == n
                            for v, objs in shard_homes(staged, plan, marker.get("key_index_bytes")).items()
                            for r, n in objs.items())):
                        found[i] = marker
                        counts["kept"] += 1  # sent by an earlier run of this task
                        finished += 1
                    elif (served := _served_shard(staged, current, there, plan, damaged)) is not None:
                        found[i] = served
                        counts["kept"] += 1  # whole in the served version: nothing to write or send
                        finished += 1
                    else:
                        todo.append((i, plan))
                at += len(batch)
                position.clear()
                position.update({id(p): i for i, p in todo})

                def step(_res, total=stop - first) -> None:
                    nonlocal finished
                    finished += 1
                    if progress is not None:
                        progress(finished, total)

                write_shards(store, source, scratch, [p for _, p in todo], num_workers=num_workers, progress=step,
                             then=send)
                sent += [i for i, _ in todo]
        # Last: the record says every shard of the range is in the bucket, with each tar's sha256.
        path = write_record(kept, WRITE, index, of, {
            "plan_sha256": staged.plan_sha256, "version": staged.version, "shards": [first, stop], "written": sorted(sent),
            **record_fields(found), "etags": {str(i): m.get("etags", {}) for i, m in sorted(found.items())},
            "problems": {str(i): m.get("problems", {}) for i, m in sorted(found.items())},
        })
        shutil.rmtree(scratch, ignore_errors=True)
        return TaskOutcome(WRITE, index, of, path, False, stop - first, first, len(sent), counts["kept"],
                           copied=counts["copied"], repaired=counts["repaired"])


def _served_shard(staged: Staged, current: _CurrentTars, there: dict[str, dict[str, int]],
                  plan: ShardPlan, damaged: set[str]) -> dict | None:
    """The marker of a shard that the served version holds whole (a plan of the version the
    pointer names, staged again to repair it): every tar with the planned size and the checksum
    its manifest lists (none read back ``damaged``), and its key index. None: the shard is
    written (and what is missing or damaged sent)."""
    if staged.version != current.version or staged.base is not None:
        return None
    if any(tar_rel(plan, m) in damaged for m in plan.modalities):
        return None
    listed = there[staged.version]
    index_bytes = listed.get(key_index_rel(plan))
    if index_bytes is None or any(listed.get(r) != n for r, n in shard_objects(plan, index_bytes).items()):
        return None
    shas = {m: current.sha.get(tar_rel(plan, m)) for m in plan.modalities}
    if not all(shas.values()):
        return None
    return {"digest": plan.digest(), "tars": shas, "key_index_bytes": index_bytes, "problems": {},
            "bytes": {m: plan.tar_bytes(m) for m in plan.modalities}}
