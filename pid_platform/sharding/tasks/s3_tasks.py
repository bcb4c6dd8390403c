"""The build's tasks for an ``s3://`` output: they meet in the bucket, not in a shared folder.

Each task runs on any machine that reaches the source and the bucket, in a work folder of its
own (``PID_WORK_ROOT``) that nothing else reads; the staged build lives under
``<output>/.pid-build/staged/`` (``s3_staging.py``):

* ``pid-shard plan``: the intake and the plan in this machine's work folder (as the one-process
  build: ``tasks.run.run_plan``, reusing what intake tasks uploaded), then the plan's state and,
  last, ``staged.json`` naming the version (``s3_output.version_id``: a digest of the plan,
  known before any tar is written). The Dagster ``plan`` step does the same from the samples
  ``sample_set`` staged in the bucket (``stage_plan_from_intake``).
* intake task ``I`` of ``N``: its slice's file outcomes and record into ``staged/tasks/``; the
  plan downloads every finished one.
* write task ``I`` of ``N``: shard range ``slice_bounds(shards, I, N)`` of the plan, one shard at
  a time: its tars are written into a scratch folder, hashed, checked (twin keys, size bound,
  key index: the checks run where the bytes are), sent to ``versions/<id>/`` (copied inside
  the bucket instead when the current version holds the same bytes) with the key index, then a
  per-shard marker, and the scratch files are deleted: the task holds only the shards in flight.
  A killed task run again keeps every shard whose marker and objects are there; its record
  (every shard's digests and check findings) comes last.
* ``pid-shard commit``: the manifests, from the plan and the records' digests (no tar is read),
  sent after every object is checked in one listing, then the pointer switch
  (``s3_output.switch_pointer``), only from the pointer the plan saw (``staged.json``);
  then ``staged/`` is deleted.

Nothing staged is taken on trust: ``staged.json`` is checked field by field (a version id that
is not one is refused), the plan is read pinned to the ETag it names, a plan that lost its lease
stages nothing, and ``staged/`` holding anything without a ``staged.json`` is never "up to date".

The bytes of the version (its id included) are those of the one-process ``pid-shard`` build
of the same source and settings, whatever ``N`` and however many machines.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from loader.formats.atomic import atomic_write_bytes
from loader.formats.errors import FormatError
from loader.formats.twin_tar import key_index_relpath, tar_path
from loader.formats.version_pointer import (
    POINTER_NAME,
    VersionPointer,
    sibling_version,
    version_dir,
)
from loader.formats.wdinfo import WdinfoManifest, parse_wdinfo
from loader.io.errors import ObjectNotFoundError
from loader.io.s3_client import S3AccessError
from pid_platform.sharding import pipeline
from pid_platform.sharding.commit import s3_output, versions
from pid_platform.sharding.commit.claims import (
    this_process,
)
from pid_platform.sharding.commit.in_place import MARKER, InPlace, decide_in_place
from pid_platform.sharding.commit.in_place import published_manifests as published_in_place
from pid_platform.sharding.commit.lease import build_lease, check_held
from pid_platform.sharding.commit.manifests import (
    BucketManifest,
    write_key_index_of,
    write_manifests,
)
from pid_platform.sharding.commit.s3_output import (
    CARRIED_STATE,
    PublishedVersion,
    PublishRaceError,
    S3Output,
)
from pid_platform.sharding.commit.state import (
    FINGERPRINT,
    INTAKE_SETTINGS,
    REPORT,
    SAMPLES,
    load_intake_settings,
    state_dir,
)
from pid_platform.sharding.commit.verify_output import (
    planned_key_index_mismatches,
    size_bound_violations,
    twin_key_mismatches,
)
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.intake.cache import CACHE_NAME
from pid_platform.sharding.intake.file_checks import VALIDATE_FULL
from pid_platform.sharding.intake.task import SLICING, slice_bounds
from pid_platform.sharding.layout import STATE_DIR, bucket_dir, final_dir
from pid_platform.sharding.output_lock import build_lock
from pid_platform.sharding.pause_points import pause_point
from pid_platform.sharding.plan.add_modality import load_plan_cut
from pid_platform.sharding.plan.columnar import Shard, ShardRef
from pid_platform.sharding.plan.plan_files import iter_shard_range, load_shards
from pid_platform.sharding.plan.shard_plan import ShardingConfig, ShardPlan
from pid_platform.sharding.state_doc import load_state_doc
from pid_platform.sharding.storage import SourceStore
from pid_platform.sharding.tasks import records as local_records
from pid_platform.sharding.tasks import s3_staging as staging
from pid_platform.sharding.tasks.records import INTAKE, RECORD_FORMAT, WRITE
from pid_platform.sharding.tasks.run import (
    SHARD_DONE_POINT,
    PlanOutcome,
    TaskOrderError,
    TaskOutcome,
    TasksUnfinishedError,
    Unfinished,
    report_from_json,
    run_intake_task,
    run_plan,
    shard_done_point,
    spans_text,
    stage_plan,
)
from pid_platform.sharding.tasks.s3_staging import STAGED_NAME, SeenPointer, Staged
from pid_platform.sharding.write.tar_digests import tar_digests
from pid_platform.sharding.write.tars import ShardResult, shard_files, write_shards

# Held (PID_PAUSE_AT) by ``pid-shard plan`` of an s3 output once its plan is cut, before it stages
# anything in the bucket: tests stall a plan there (SIGSTOP) past its lease.
PLAN_BEFORE_STAGING_POINT = "s3-plan:before-staging"

# The checks a write task runs on each shard's tars before it sends them (``verify_output``).
TWIN_KEYS, SIZE_BOUND, KEY_INDEX = "twin_keys", "size_bound", "key_index"
SHARD_CHECKS = (TWIN_KEYS, SIZE_BOUND, KEY_INDEX)


def scratch_dir(output: S3Output, work_root: str | Path | None, name: str) -> Path:
    """A folder of this machine's own for one task (beside the one-process build's work folder)."""
    return _beside(s3_output.work_dir(output, work_root), name)


def _beside(work: Path, name: str) -> Path:
    return work.parent / f"{work.name}.tasks" / name


def staged_or_refuse(output: S3Output, what: str) -> Staged | None:
    """The staged plan; None when nothing is staged over a published version (the plan found it
    up to date and left ``staged/`` empty); a ``TaskOrderError`` when nothing was ever planned,
    or when ``staged/`` holds what a plan or intake began and no ``staged.json`` (a plan killed
    while staging, an intake staged since): the source changed, so never "up to date"."""
    staged = staging.read_staged(output)  # a damaged staged.json: StagedStateError, naming it
    if staged is not None:
        return staged
    left = staging.leftovers(output)
    if s3_output.read_pointer(output) is not None and not left:
        return None
    why = (f"{output}/{staging.rel(STAGED_NAME)} is missing beside {', '.join(left)}{' ...' if len(left) > 2 else ''} "
           "(a plan was killed while staging, or an intake was staged since)") if left else (
        f"{output}/{staging.rel(STAGED_NAME)} is missing")
    raise TaskOrderError(f"{what} of {output}: no plan is staged ({why})",
                         "run `pid-shard plan` (the same --input-dir, --output-dir and settings) first")


def run_s3_intake_task(
    store: SourceStore, source: str, output: S3Output, index: int, of: int, *, work_root: str | Path | None = None,
    trust_pickle: bool = False, num_workers: int = 1, validate: str = VALIDATE_FULL, revalidate: bool = False,
    force: bool = False,
) -> TaskOutcome:
    """Intake task ``index`` of ``of`` (``tasks.run.run_intake_task``) in a scratch folder of this
    machine; its outcomes and record then go to the bucket, where the plan finds them."""
    scratch = scratch_dir(output, work_root, f"intake-{index}-of-{of}")
    shutil.rmtree(scratch, ignore_errors=True)
    settings = {"validate": validate, "trust_pickle": trust_pickle}
    rel = staging.record_rel(INTAKE, index, of)
    rec = staging.get_json(output, rel)
    if (rec is not None and rec.get("format") == RECORD_FORMAT and rec.get("settings") == settings
            and rec.get("slicing") == SLICING):
        return TaskOutcome(INTAKE, index, of, Path(rel), True, rec.get("samples", 0), nbytes=rec.get("bytes", 0))
    res = run_intake_task(store, source, scratch, index, of, trust_pickle=trust_pickle, num_workers=num_workers,
                          validate=validate, revalidate=revalidate, force=force)
    staged = versions.staging_dir(scratch)
    part = local_records.intake_part_path(staged, index, of)
    what = f"intake task {index} of {of}"
    staging.put(output, staging.rel("tasks", part.name), part, what)
    staging.put(output, rel, local_records.record_path(staged, INTAKE, index, of).read_bytes(), what)
    shutil.rmtree(scratch, ignore_errors=True)
    return TaskOutcome(INTAKE, index, of, Path(rel), False, res.items, 0, res.done, res.reused, nbytes=res.nbytes)


def _pull_intake_parts(output: S3Output, work: Path) -> None:
    """Every finished intake task's outcomes, beside this machine's staging of the build."""
    names = set(staging.names_under(output, staging.rel("tasks")))
    for name in sorted(n for n in names if n.startswith(f"{INTAKE}-") and n.endswith(".json")):
        part = name[: -len(".json")] + ".parquet"
        data = s3_output.get_bytes(output, staging.rel("tasks", part)) if part in names else None
        if data is None:
            continue
        tasks = local_records.tasks_dir(versions.begin(work, first_step=True))
        tasks.mkdir(parents=True, exist_ok=True)
        (tasks / part).write_bytes(data)


def _already_served(output: S3Output, folder: Path, vid: str, uses: list[str], config: ShardingConfig) -> bool:
    """Whether the pointer names version ``vid`` (reading from ``uses``) or one cut with
    ``config`` from the very samples staged in ``folder``, and every object its manifests list
    is there with its size: a commit would change nothing. A damaged served version is staged
    again: its write tasks send what is missing (``published_problems``: one listing)."""
    pointer = s3_output.read_pointer(output)
    if pointer is None:
        return False
    if pointer.version == vid and pointer.uses == uses:
        return not published_problems(output)
    return published_intake_matches(output, folder, config)


def pull_committed_plan(output: S3Output, folder: Path) -> Path | None:
    """The plan state the published version carries (``s3_output.CARRIED_STATE``) into
    ``folder``'s state folder, for ``plan/add_modality.plan_build`` on a machine that never held
    the build; None (nothing pulled) when no published version carries its plan."""
    shutil.rmtree(folder, ignore_errors=True)
    found = {n: _published_state(output, n) for n in staging.PLAN_STATE}
    if found.get("plan.parquet") is None or found.get("sharding.json") is None:
        return None
    state = state_dir(folder)
    state.mkdir(parents=True)
    for name, data in found.items():
        if data is not None:
            atomic_write_bytes(state / name, data)
    return folder


def tar_rel(plan: Shard, modality: str) -> str:
    return tar_path(Path(), plan.bucket, modality, plan.relpath).as_posix()


def current_manifests(output: S3Output, pointer: VersionPointer) -> dict[str, bytes]:
    """The manifests the pointer lists, as published (an unreadable one as ``{}``)."""
    return {m: s3_output.get_bytes(output, f"{pointer.version_dir()}/{m}") or b"{}" for m in pointer.manifests}


def in_place_of(output: S3Output, folder: Path, staged_id: str) -> InPlace | None:
    """How the plan staged in ``folder`` (version id ``staged_id``) is published in place
    (``commit/in_place.py``): when it extends the published plan (``plan_cut.json``) whose tars
    of the reused modalities the current manifests list; decided before any tar is written,
    from the plan alone."""
    cut = load_plan_cut(folder)
    current = s3_output.read_pointer(output)
    if cut is None or not cut.reused_modalities or current is None:
        return None
    docs = current_manifests(output, current)
    try:
        old_sha = s3_output.checksums_of(docs)
    except (FormatError, ValueError):
        return None
    plans = load_shards(folder, pipeline.load_sharding_config(folder))
    modality_of = {tar_rel(p, m): m for p in plans for m in p.modalities}
    reused = frozenset(r for r, m in modality_of.items() if m in cut.reused_modalities)
    if not reused <= old_sha.keys():
        return None  # the current version is not the one the plan extends
    return decide_in_place(current, docs, reused, modality_of, staged_id,
                           lambda r: s3_output.get_bytes(output, r), lambda r: s3_output.list_sizes(output, r))


def published_as(staged_id: str, in_place: InPlace | None) -> tuple[str, list[str]]:
    """(version id, the pointer's ``uses``) of the plan with id ``staged_id`` once published."""
    if in_place is None:
        return staged_id, []
    return in_place.version_id(staged_id), [in_place.base]


def seen_pointer(output: S3Output) -> SeenPointer:
    """The pointer as a plan reads it before it cuts: what its commit may switch from."""
    pointer, etag = s3_output.read_pointer_tagged(output)
    return SeenPointer(pointer.version if pointer else None, etag)


def _stage_in_bucket(output: S3Output, folder: Path, source: str, staged_id: str,
                     in_place: InPlace | None, seen: SeenPointer) -> Staged:
    """The plan of ``folder`` (version id ``staged_id``: a digest of the plan, computed once),
    cut against the pointer ``seen``, staged for the write tasks; published in place when
    ``in_place`` (its ``MARKER`` first, before any task puts a tar into another version's
    folder). A plan that lost the build lease (stalled past its TTL while another build took
    it) stops here and before ``staged.json``, staging nothing a task would take; earlier write
    records go (this plan's tasks report what they did themselves)."""
    pause_point(PLAN_BEFORE_STAGING_POINT)
    check_held(output)  # before the first object of the staging changes
    staging.clear_write_records(output)
    vid, _uses = published_as(staged_id, in_place)
    if in_place is None:
        return staging.stage_plan_state(output, folder, source, seen, version=vid,
                                        before_marker=lambda: check_held(output))
    if in_place.placed and s3_output.get_bytes(output, f"{version_dir(vid)}/{MARKER}") is None:
        staging.put(output, f"{version_dir(vid)}/{MARKER}", in_place.marker(), "staging the plan")
    return staging.stage_plan_state(output, folder, source, seen, version=vid, base=in_place.base,
                                    reused=load_plan_cut(folder).reused_modalities,
                                    before_marker=lambda: check_held(output))


def run_s3_plan(
    store: SourceStore, source: str, output: S3Output, config: ShardingConfig, *, work_root: str | Path | None = None,
    trust_pickle: bool = False, num_workers: int = 1, force: bool = False, validate: str = VALIDATE_FULL,
    revalidate: bool = False, repair: bool = False,
) -> tuple[PlanOutcome, str | None]:
    """The plan, staged in the bucket; ``(outcome, version)``, version None when the pointer
    already names the version this plan builds (nothing staged: the tasks have nothing to do).
    ``repair``: staged even then, for write tasks that read the served tars back."""
    work = s3_output.work_dir(output, work_root)
    with build_lease(output):
        seen = seen_pointer(output)  # before anything is read of the published version
        _pull_intake_parts(output, work)
        seed_intake_cache(output, work)  # the published outcomes: validate only what changed since
        committed = pull_committed_plan(output, scratch_dir(output, work_root, "committed"))
        plan = run_plan(store, source, work, config, trust_pickle=trust_pickle, num_workers=num_workers, force=force,
                        validate=validate, revalidate=revalidate, committed=committed)
        folder = final_dir(work) if plan.up_to_date else versions.staging_dir(work)
        staged_id = s3_output.version_id(folder)
        in_place = in_place_of(output, folder, staged_id)
        vid, uses = published_as(staged_id, in_place)
        if committed is not None:
            shutil.rmtree(committed, ignore_errors=True)
        if not repair and _already_served(output, folder, vid, uses, config):
            _delete_staged(output)
            return plan, None
        return plan, _stage_in_bucket(output, folder, source, staged_id, in_place, seen).version


def pull_staged_intake(output: S3Output, work: Path) -> bool:
    """The samples ``sample_set`` staged in the bucket, into this machine's staging of the build
    (so the Dagster ``plan`` step cuts them wherever it runs); False when none are staged."""
    files = staging.staged_intake(output)
    if files is None:
        return False
    staging.pull_intake(output, files, versions.begin(work, first_step=True))
    return True


def stage_plan_in_bucket(store: SourceStore, source: str, output: S3Output, work: Path,
                         config: ShardingConfig) -> tuple[list[ShardRef], str]:
    """The Dagster ``plan`` step of an s3 output: the samples staged in this machine's work
    folder (``pull_staged_intake``, or the committed ones copied there), cut with ``config``
    and staged in the bucket for the write tasks; ``(shards, version)``. Earlier write records
    are forgotten, so this run's tasks report what they did themselves (every shard still in
    the bucket is kept). It holds the build lease as ``pid-shard plan`` does, and checks it right
    before it stages (``_stage_in_bucket``): a step that lost it stages nothing."""
    with build_lease(output):
        seen = seen_pointer(output)
        committed = pull_committed_plan(output, _beside(work, "committed"))
        plans = stage_plan(store, source, work, config, fresh_tasks=True, committed=committed)
        if committed is not None:
            shutil.rmtree(committed, ignore_errors=True)
        folder = versions.staging_dir(work)
        staged_id = s3_output.version_id(folder)
        in_place = in_place_of(output, folder, staged_id)
        return plans, _stage_in_bucket(output, folder, source, staged_id, in_place, seen).version


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


def run_s3_write_task(
    store: SourceStore, source: str, output: S3Output, index: int, of: int, *, work_root: str | Path | None = None,
    num_workers: int = 1, progress: Callable[[int, int], None] | None = None, repair: bool = False,
) -> TaskOutcome:
    """Write task ``index`` of ``of`` of the plan staged in the bucket: its shards' tars and key
    indexes into ``versions/<id>/``, shard by shard, then its record. ``repair``: each tar of
    the served version is read back, and sent again where its sha256 is not its manifest's."""
    slice_bounds(0, index, of)  # raises ValueError naming the range
    rel = staging.record_rel(WRITE, index, of)
    staged = staged_or_refuse(output, f"write task {index} of {of}")
    if staged is None:
        return TaskOutcome(WRITE, index, of, Path(rel), True, nothing_staged=True)
    rec = staging.get_json(output, rel)
    if rec is not None and rec.get("plan_sha256") == staged.plan_sha256:
        first, stop = rec["shards"]
        return TaskOutcome(WRITE, index, of, Path(rel), True, stop - first, first)
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
            shas = tar_digests(scratch, plan)
            write_key_index_of(scratch, plan)
            index_rel = key_index_rel(plan)
            marker = {"digest": plan.digest(), "tars": shas, "key_index_bytes": (scratch / index_rel).stat().st_size,
                      "problems": _shard_problems(scratch, plan, config, cut.plan_modalities if cut else None),
                      "bytes": {m: (scratch / tar_rel(plan, m)).stat().st_size for m in plan.modalities}, "etags": {}}
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
                bucket.put(output.key(staging.shard_marker_rel(plan)), json.dumps(marker, sort_keys=True).encode())
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
                    marker = staging.get_json(output, staging.shard_marker_rel(plan))
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
        staging.put(output, rel, json.dumps({
            "format": RECORD_FORMAT, "stage": WRITE, "index": index, "of": of, "plan_sha256": staged.plan_sha256,
            "version": staged.version, "shards": [first, stop], "written": sorted(sent),
            "digests": {str(i): m["tars"] for i, m in sorted(found.items())},
            "key_index_bytes": {str(i): m["key_index_bytes"] for i, m in sorted(found.items())},
            "tar_sizes": {str(i): m["bytes"] for i, m in sorted(found.items())},
            "etags": {str(i): m.get("etags", {}) for i, m in sorted(found.items())},
            "problems": {str(i): m.get("problems", {}) for i, m in sorted(found.items())},
        }, sort_keys=True, indent=1).encode(), f"write task {index} of {of}")
        shutil.rmtree(scratch, ignore_errors=True)
        return TaskOutcome(WRITE, index, of, Path(rel), False, stop - first, first, len(sent), counts["kept"],
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


def key_index_rel(plan: Shard) -> str:
    return (bucket_dir(Path(), plan.bucket) / key_index_relpath(plan.relpath)).as_posix()


def shard_objects(plan: Shard, key_index_bytes: object) -> dict[str, int]:
    """Each object of ``plan``'s shard in its version folder -> its size."""
    found = {tar_rel(plan, m): plan.tar_bytes(m) for m in plan.modalities}
    found[key_index_rel(plan)] = key_index_bytes if isinstance(key_index_bytes, int) else -1
    return found


def shard_homes(staged: Staged, plan: Shard, key_index_bytes: object) -> dict[str, dict[str, int]]:
    """``shard_objects`` by the version whose folder holds them (``Staged.home``)."""
    found: dict[str, dict[str, int]] = {}
    index = key_index_rel(plan)
    for r, n in shard_objects(plan, key_index_bytes).items():
        found.setdefault(staged.home(r != index), {})[r] = n
    return found


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
        if not self.cov.missing:
            return None
        return Unfinished(f"shards {spans_text(self.cov.missing)} of {len(self.plans)} lie in no finished write task "
                          f"(no completion record under {output}/{staging.rel('tasks')}/)",
                          "run `pid-shard task --index I --of N` for each unfinished I of one N, then commit again")

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
                        staging.coverage(plans, staging.write_records(output, staged.plan_sha256)))


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
        _delete_staged(output)
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


def run_s3_commit(output: S3Output, *, work_root: str | Path | None = None, num_workers: int = 1,
                  now: Callable[[], float] = time.time) -> pipeline.BuildSummary | None:
    """``pid-shard commit`` of an s3 output (``commit_staged``), summed up as the build's summary."""
    done = commit_staged(output, work_root=work_root, num_workers=num_workers, now=now)
    if done is None:
        return None
    folder = done.shards.folder
    report = report_from_json(load_state_doc((state_dir(folder) / REPORT).read_bytes(), state_dir(folder) / REPORT))
    validate = (load_intake_settings(folder) or {}).get("validate", VALIDATE_FULL)
    summary = pipeline.BuildSummary(done.shards.staged.source, folder, report, pipeline.summarize(done.shards.results()),
                                    [m.path for m in done.manifests], [], validate,
                                    up_to_date=done.published.unchanged, published=done.published.url)
    shutil.rmtree(folder, ignore_errors=True)
    return summary


def run_s3_build(
    store: SourceStore, source: str, output: S3Output, config: ShardingConfig, *, work_root: str | Path | None = None,
    trust_pickle: bool = False, num_workers: int = 1, force: bool = False, validate: str = VALIDATE_FULL,
    revalidate: bool = False, repair: bool = False, progress: Callable[[int, int], None] | None = None,
) -> pipeline.BuildSummary:
    """``pid-shard`` of an s3 output: the tasked build in one process, holding the build lease
    throughout: ``run_s3_plan``, write task 0 of 1, ``run_s3_commit`` (the functions ``pid-shard
    plan|task|commit`` and the Dagster steps run). ``repair``: the served version's tars are read
    back, and those whose sha256 is not their manifest's are sent again."""
    with build_lease(output):
        plan, vid = run_s3_plan(store, source, output, config, work_root=work_root, trust_pickle=trust_pickle,
                                num_workers=num_workers, force=force, validate=validate, revalidate=revalidate,
                                repair=repair)
        if vid is None:  # the bucket serves what this build would publish, whole
            folder = final_dir(plan.out) if plan.up_to_date else versions.staging_dir(plan.out)
            pointer = s3_output.read_pointer(output)
            results = pipeline.planned_results(load_shards(folder, pipeline.load_sharding_config(folder)))
            return pipeline.BuildSummary(source, folder, plan.report, pipeline.summarize(results),
                                         [folder / m for m in pointer.manifests], [],
                                         (load_intake_settings(folder) or {}).get("validate", VALIDATE_FULL),
                                         up_to_date=True, published=f"{output}/{pointer.version_dir()}")
        task = run_s3_write_task(store, source, output, 0, 1, work_root=work_root, num_workers=num_workers,
                                 progress=progress, repair=repair)
        summary = run_s3_commit(output, work_root=work_root, num_workers=num_workers)
        summary.repaired = task.repaired
        summary.up_to_date = summary.up_to_date and not task.repaired
        return summary


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
            staging.put(output, f"{version_dir(vid)}/{r}", body, "the commit")
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


def _delete_staged(output: S3Output) -> None:
    staging.delete(output, staging.rel(STAGED_NAME), staging.rel(staging.INTAKE_NAME))  # first: no task takes the rest
    staging.delete_under(output, staging.STAGED)


def published_manifests(output: S3Output) -> list[tuple[str, WdinfoManifest]]:
    """The manifests of the version ``output``'s pointer names (path in its folder, manifest); []
    when there is no pointer."""
    pointer = s3_output.read_pointer(output)
    if pointer is None:
        return []
    found = []
    for rel in pointer.manifests:
        origin = f"{output}/{pointer.version_dir()}/{rel}"
        data = s3_output.get_bytes(output, f"{pointer.version_dir()}/{rel}")
        if data is None:
            raise BuildError(f"{origin}: listed by {output}/{POINTER_NAME} but missing; rebuild the source")
        found.append((rel, parse_wdinfo(load_state_doc(data, origin), rel.rpartition("/")[0] or ".", origin)))
    return found


def published_problems(output: S3Output) -> list[str]:
    """What the published version's objects lack against its manifests (a listing per version
    folder): each tar the manifests list, with its size, and each key index they name."""
    pointer = s3_output.read_pointer(output)
    if pointer is None:
        return [f"{output}/{POINTER_NAME}: missing (nothing is published)"]
    listings: dict[str, dict[str, int]] = {}
    problems = []
    for rel, man in published_manifests(output):
        leaf = rel.rpartition("/")[0]
        # A sibling root (section 9c): the tars are at the same paths in that version's folder.
        home = pointer.version if man.root == "." else sibling_version(man.root) or pointer.version
        for vid in {home, pointer.version}:
            if vid not in listings:
                listings[vid] = s3_output.list_sizes(output, version_dir(vid))
        for t in man.tars:
            for m in man.data_keys:
                tar = "/".join(p for p in (leaf, m, t.path) if p)
                if listings[home].get(tar) != t.bytes.get(m):
                    problems.append(f"{output}/{version_dir(home)}/{tar}: {listings[home].get(tar, 'missing')} in the "
                                    f"bucket, {rel} lists {t.bytes.get(m)} bytes")
            index = "/".join(p for p in (leaf, t.key_index or "") if p)
            if t.key_index is None or index not in listings[pointer.version]:
                problems.append(f"{output}/{pointer.version_dir()}/{rel}: the key index of {t.path} is missing")
    return problems


def published_config(output: S3Output) -> ShardingConfig:
    """The settings the published version was cut with (its ``.pid-build/sharding.json``)."""
    pointer = s3_output.read_pointer(output)
    data = s3_output.get_bytes(output, f"{pointer.version_dir()}/{STATE_DIR}/sharding.json") if pointer else None
    if data is None:
        raise BuildError(f"{output}: no published version with its settings (.pid-build/sharding.json); rebuild it")
    return ShardingConfig(**load_state_doc(data, f"{output}/{pointer.version_dir()}/{STATE_DIR}/sharding.json"))


def _published_state(output: S3Output, name: str) -> bytes | None:
    pointer = s3_output.read_pointer(output)
    return s3_output.get_bytes(output, f"{pointer.version_dir()}/{STATE_DIR}/{name}") if pointer else None


def pull_committed_intake(output: S3Output, work: Path) -> bool:
    """The intake the published version carries (samples, report, validation level, outcomes)
    as this machine's staged samples, replacing any it had: a re-shard of the published samples
    on any machine. False when nothing is published, or its version carries no samples."""
    found = {n: _published_state(output, n) for n in staging.INTAKE_STATE if n != FINGERPRINT}
    if found.get(SAMPLES) is None:
        return False
    with build_lock(work):
        state = state_dir(versions.begin(work, first_step=True))
        state.mkdir(parents=True, exist_ok=True)
        for name in staging.INTAKE_STATE:
            (state / name).unlink(missing_ok=True)  # a stale intake of this machine's goes
        for name, data in found.items():
            if data is not None:
                atomic_write_bytes(state / name, data)
    return True


def seed_intake_cache(output: S3Output, work: Path) -> bool:
    """The published version's file outcomes as this machine's staged intake cache, unless it
    has one: an intake here validates only the files changed since, on a fresh machine too."""
    with build_lock(work):
        cache = state_dir(versions.staging_dir(work)) / CACHE_NAME
        if cache.is_file():
            return False
        data = _published_state(output, CACHE_NAME)
        if data is None:
            return False
        state = state_dir(versions.begin(work, first_step=True))
        state.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cache, data)
    return True


def published_intake_matches(output: S3Output, staging_folder: Path, config: ShardingConfig) -> bool:
    """Whether the version the pointer names was cut with ``config`` from exactly the samples
    staged in ``staging_folder`` (the same samples, report and validation level), and every
    object its manifests list is there: a rebuild would publish that version again."""
    state = state_dir(staging_folder)
    for name in (SAMPLES, REPORT, INTAKE_SETTINGS):
        published = _published_state(output, name)
        if published is None or not (state / name).is_file() or (state / name).read_bytes() != published:
            return False
    try:
        if published_config(output) != config:
            return False
    except BuildError:
        return False
    return not published_problems(output)


def discard_staging(work: Path) -> None:
    """Remove this machine's staging of the build (the bucket serves what it would publish)."""
    with build_lock(work):
        shutil.rmtree(versions.staging_dir(work), ignore_errors=True)
