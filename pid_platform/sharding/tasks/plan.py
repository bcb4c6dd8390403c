"""The plan stage, and the optional intake tasks before it, for a folder and an ``s3://`` output.

* intake task ``I`` of ``N``: validates slice ``I`` of the source's complete samples (cut from
  the basename order, balanced by file bytes: ``intake.task.balanced_slices``) and writes their
  file outcomes as ``tasks/intake-I-of-N.parquet``, then its record; for a bucket, in a scratch
  folder of its machine, then sent to ``staged/tasks/``. Optional: the plan validates whatever
  no intake task covered.
* plan: the intake over the whole source (every outcome an intake task found is reused, so it
  reads only files no task covered), ``samples.parquet``, the report, then ``plan.parquet``
  and ``sharding.json``, in the staging folder beside a folder output, holding its build lock.
  For a bucket the same runs in the machine's work folder (``plan_in_folder``), holding the build
  lease; then the plan's state goes to ``staged/`` and, last, ``staged.json`` naming the
  version (``s3_output.version_id``: a digest of the plan, known before any tar is written) and
  the pointer the plan saw (``staging.py``). A plan that lost its lease stages nothing. The
  Dagster ``plan`` step does the same from the samples ``sample_set`` staged
  (``stage_plan``, ``stage_plan_in_bucket``).
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

from loader.formats.errors import FormatError
from loader.formats.version_pointer import version_dir
from pid_platform.sharding import pipeline
from pid_platform.sharding.commit import s3_output, versions
from pid_platform.sharding.commit.in_place import MARKER, InPlace, decide_in_place
from pid_platform.sharding.commit.lease import build_lease, check_held
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.commit.state import state_dir
from pid_platform.sharding.commit.verify_output import damaged_shards
from pid_platform.sharding.intake.cache import CACHE_NAME, IntakeCache
from pid_platform.sharding.intake.file_checks import VALIDATE_FULL, check_validate_level
from pid_platform.sharding.intake.task import (
    SLICING,
    intake_slice,
)
from pid_platform.sharding.layout import final_dir, stamp_path
from pid_platform.sharding.pause_points import pause_point
from pid_platform.sharding.plan.add_modality import load_plan_cut
from pid_platform.sharding.plan.columnar import ShardRef
from pid_platform.sharding.plan.plan_files import load_shards
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import SourceStore
from pid_platform.sharding.tasks import staging
from pid_platform.sharding.tasks.outcomes import PlanOutcome, TaskOutcome, check_task
from pid_platform.sharding.tasks.published import (
    current_manifests,
    published_intake_matches,
    published_problems,
    pull_committed_plan,
    seed_intake_cache,
)
from pid_platform.sharding.tasks.records import (
    INTAKE,
    WRITE,
    bucket_staging,
    clear_records,
    folder_staging,
    intake_part_name,
    intake_part_path,
    read_record,
    write_record,
)
from pid_platform.sharding.tasks.staging import (
    SeenPointer,
    Staged,
    beside,
    delete_staged,
    scratch_dir,
    tar_rel,
)


def run_intake_task(
    store: SourceStore, source: str, out: Path | S3Output, index: int, of: int, *, trust_pickle: bool = False,
    num_workers: int = 1, validate: str = VALIDATE_FULL, revalidate: bool = False, force: bool = False,
    work_root: str | Path | None = None,
) -> TaskOutcome:
    """Intake task ``index`` of ``of``: the outcomes of its slice's files, then its record, in
    the staging of ``out``; for a bucket, worked out in a scratch folder of this machine (in
    ``work_root``) and staged in the bucket, where the plan finds them."""
    check_task(index, of)
    check_validate_level(validate)
    on_s3 = isinstance(out, S3Output)
    work = scratch_dir(out, work_root, f"intake-{index}-of-{of}") if on_s3 else Path(out)
    kept = bucket_staging(out) if on_s3 else folder_staging(versions.staging_dir(work))
    settings = {"validate": validate, "trust_pickle": trust_pickle}
    rec = read_record(kept, INTAKE, index, of)
    if rec is not None and rec.get("settings") == settings and rec.get("slicing") == SLICING:
        return TaskOutcome(INTAKE, index, of, rec["path"], True, rec.get("samples", 0), nbytes=rec.get("bytes", 0))
    if on_s3:
        shutil.rmtree(work, ignore_errors=True)
    staging = versions.begin(work, first_step=True, force=force)
    caches = [state_dir(final_dir(work)) / CACHE_NAME, state_dir(staging) / CACHE_NAME]
    cache = IntakeCache(validate) if revalidate else IntakeCache.load(caches, validate)
    part = intake_slice(store, source, index, of, trust_pickle=trust_pickle, num_workers=num_workers,
                        validate=validate, cache=cache)
    part.outcomes.save(intake_part_path(staging, index, of))
    what = f"intake task {index} of {of}"
    if on_s3:
        kept.put(intake_part_name(index, of), intake_part_path(staging, index, of), what)
    path = write_record(kept, INTAKE, index, of, {
        "settings": settings, "slicing": SLICING, "samples": part.samples, "bytes": part.nbytes,
        "files_validated": part.files_validated, "outcomes_reused": part.outcomes_reused,
        "part": intake_part_path(staging, index, of).name,
    }, what)
    if on_s3:
        shutil.rmtree(work, ignore_errors=True)
    return TaskOutcome(INTAKE, index, of, path, False, part.samples, 0, part.files_validated,
                       part.outcomes_reused, nbytes=part.nbytes)


def run_plan(
    store: SourceStore, source: str, out: Path | S3Output, config: ShardingConfig, *,
    work_root: str | Path | None = None, trust_pickle: bool = False, num_workers: int = 1, force: bool = False,
    validate: str = VALIDATE_FULL, revalidate: bool = False, repair: bool = False,
) -> PlanOutcome:
    """The plan of a build of ``out``, staged for the write tasks: beside a folder
    (``plan_in_folder``), or in the bucket (``plan_in_bucket``)."""
    settings = dict(trust_pickle=trust_pickle, num_workers=num_workers, force=force, validate=validate,
                    revalidate=revalidate, repair=repair)
    if isinstance(out, S3Output):
        return plan_in_bucket(store, source, out, config, work_root=work_root, **settings)
    return plan_in_folder(store, source, out, config, **settings)


@pipeline.build_step
def plan_in_folder(
    store: SourceStore, source: str, out: Path, config: ShardingConfig, *, trust_pickle: bool = False,
    num_workers: int = 1, force: bool = False, validate: str = VALIDATE_FULL, revalidate: bool = False,
    committed: Path | None = None, repair: bool = False,
) -> PlanOutcome:
    """The plan of a build: the intake over the whole source (validating only what neither the
    caches nor the intake tasks vouch for), then ``plan.parquet`` and ``sharding.json``.

    Over a committed build that is already what this one would publish, nothing is staged
    (``PlanOutcome.up_to_date``); the write tasks and the commit then have nothing to do.
    ``committed``: the folder whose state holds the committed plan (default: ``out``'s committed
    build; an s3 output's plan passes the published version's, pulled from the bucket).
    ``repair``: every committed tar is read first; a shard with one missing or whose sha256 is
    not its manifest's is planned anew (``forget_damaged_shards``), so the write tasks write it.
    """
    out = Path(out)
    damaged = forget_damaged_shards(out) if repair else 0
    result = pipeline.run_intake(store, source, out, config, trust_pickle=trust_pickle, num_workers=num_workers,
                                 force=force, validate=validate, revalidate=revalidate, stop_if_up_to_date=True)
    r, up_to_date = result.report, result.up_to_date
    # The intake's samples, an object each, go before the plan is cut from the table it wrote:
    # the plan step's peak is the larger of the two, not their sum.
    del result
    plans = (load_shards(final_dir(out), pipeline.load_sharding_config(final_dir(out))) if up_to_date
             else pipeline.stage_plan_files(store, source, out, config, committed))
    return PlanOutcome(out, r, len(plans), r.samples, up_to_date, r.files_validated, r.outcomes_reused,
                       dict(Counter(p.bucket for p in plans)), damaged)


def forget_damaged_shards(out: Path) -> int:
    """Read every tar of the committed build of ``out``; a shard with one missing or whose sha256
    differs from its manifest's loses its stamp, so the plan does not count it up to date and a
    write task writes it again instead of reusing it. Returns how many."""
    final = final_dir(out)
    try:
        plans = load_shards(final, pipeline.load_sharding_config(final))
    except FileNotFoundError:
        return 0  # nothing committed: the build writes every shard anyway
    damaged = damaged_shards(final, plans)
    for plan, _tar in damaged:
        stamp_path(final, plan.bucket, plan.index).unlink(missing_ok=True)
    return len(damaged)


@pipeline.build_step
def stage_plan(store: SourceStore, source: str, out: Path, config: ShardingConfig, *,
               fresh_tasks: bool = False, committed: Path | None = None) -> list[ShardRef]:
    """The plan of the samples an intake staged for ``out`` (``samples.parquet``), cut with
    ``config``: ``plan.parquet`` and ``sharding.json`` into the staging folder; its shards.

    ``run_plan`` without the intake, for a scheduler that ran the intake as a step of its own
    (the Dagster assets: ``sample_set``, then this). ``fresh_tasks``: forget the write tasks an
    earlier run finished for this plan, so this run's tasks check their shards again (keeping
    every one still up to date) and report what they wrote themselves. ``committed``: as for
    ``run_plan``.
    """
    out = Path(out)
    if fresh_tasks:
        clear_records(folder_staging(versions.staging_dir(out)), WRITE)
    return pipeline.stage_plan_files(store, source, out, config, committed)


# Held (PID_PAUSE_AT) by ``pid-shard plan`` of an s3 output once its plan is cut, before it stages
# anything in the bucket: tests stall a plan there (SIGSTOP) past its lease.
PLAN_BEFORE_STAGING_POINT = "s3-plan:before-staging"


def _pull_intake_parts(output: S3Output, work: Path) -> None:
    """Every finished intake task's outcomes, beside this machine's staging of the build."""
    kept = bucket_staging(output)
    names = set(kept.names("tasks"))
    for name in sorted(n for n in names if n.startswith(f"{INTAKE}-") and n.endswith(".json")):
        part = name[: -len(".json")] + ".parquet"
        data = kept.get(f"tasks/{part}") if part in names else None
        if data is None:
            continue
        folder_staging(versions.begin(work, first_step=True)).put(f"tasks/{part}", data, "")


def already_served(output: S3Output, folder: Path, vid: str, uses: list[str], config: ShardingConfig) -> bool:
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


def seen_pointer(output: S3Output) -> SeenPointer:
    """The pointer as a plan reads it before it cuts: what its commit may switch from."""
    pointer, etag = s3_output.read_pointer_tagged(output)
    return SeenPointer(pointer.version if pointer else None, etag)


def _stage_in_bucket(output: S3Output, folder: Path, source: str, seen: SeenPointer,
                     config: ShardingConfig | None = None) -> Staged | None:
    """The plan of ``folder`` (its version id: a digest of the plan, computed once), cut against
    the pointer ``seen``, staged for the write tasks; published in place when it only adds
    modalities (``in_place_of``: its ``MARKER`` first, before any task puts a tar into another
    version's folder). ``config``: None (nothing staged) when the pointer already serves this
    plan's version whole (``already_served``). A plan that lost the build lease (stalled past its
    TTL while another build took it) stops here and before ``staged.json``, staging nothing a
    task would take; earlier write records go (this plan's tasks report what they did themselves)."""
    staged_id = s3_output.version_id(folder)
    in_place = in_place_of(output, folder, staged_id)
    # The version id and the pointer's ``uses`` once published.
    vid, uses = (staged_id, []) if in_place is None else (in_place.version_id(staged_id), [in_place.base])
    if config is not None and already_served(output, folder, vid, uses, config):
        delete_staged(output)
        return None
    pause_point(PLAN_BEFORE_STAGING_POINT)
    check_held(output)  # before the first object of the staging changes
    clear_records(bucket_staging(output), WRITE)
    if in_place is None:
        return staging.stage_plan_state(output, folder, source, seen, vid, lambda: check_held(output))
    if in_place.placed and s3_output.get_bytes(output, f"{version_dir(vid)}/{MARKER}") is None:
        bucket_staging(output, "").put(f"{version_dir(vid)}/{MARKER}", in_place.marker(), "staging the plan")
    return staging.stage_plan_state(output, folder, source, seen, vid, lambda: check_held(output),
                                    base=in_place.base, reused=load_plan_cut(folder).reused_modalities)


def plan_in_bucket(
    store: SourceStore, source: str, output: S3Output, config: ShardingConfig, *, work_root: str | Path | None = None,
    trust_pickle: bool = False, num_workers: int = 1, force: bool = False, validate: str = VALIDATE_FULL,
    revalidate: bool = False, repair: bool = False,
) -> PlanOutcome:
    """The plan, cut in this machine's work folder (``plan_in_folder``), staged in the bucket
    (``PlanOutcome.version``); ``up_to_date`` and no version when the pointer already names the
    version this plan builds (nothing staged: the tasks have nothing to do). ``repair``: staged
    even then, for write tasks that read the served tars back."""
    work = s3_output.work_dir(output, work_root)
    with build_lease(output):
        seen = seen_pointer(output)  # before anything is read of the published version
        _pull_intake_parts(output, work)
        seed_intake_cache(output, work)  # the published outcomes: validate only what changed since
        committed = pull_committed_plan(output, scratch_dir(output, work_root, "committed"))
        plan = plan_in_folder(store, source, work, config, trust_pickle=trust_pickle, num_workers=num_workers,
                              force=force, validate=validate, revalidate=revalidate, committed=committed)
        if committed is not None:
            shutil.rmtree(committed, ignore_errors=True)
        folder = final_dir(work) if plan.up_to_date else versions.staging_dir(work)
        staged = _stage_in_bucket(output, folder, source, seen, None if repair else config)
        return replace(plan, up_to_date=staged is None, version=staged.version if staged else None)


def stage_plan_in_bucket(store: SourceStore, source: str, output: S3Output, work: Path,
                         config: ShardingConfig) -> tuple[list[ShardRef], str]:
    """The Dagster ``plan`` step of an s3 output: the samples staged in this machine's work
    folder (``staging.pull_staged_intake``, or the committed ones copied there), cut with ``config``
    and staged in the bucket for the write tasks (``_stage_in_bucket``, holding the build lease as
    ``pid-shard plan`` does); ``(shards, version)``."""
    with build_lease(output):
        seen = seen_pointer(output)
        committed = pull_committed_plan(output, beside(work, "committed"))
        plans = stage_plan(store, source, work, config, fresh_tasks=True, committed=committed)
        if committed is not None:
            shutil.rmtree(committed, ignore_errors=True)
        return plans, _stage_in_bucket(output, versions.staging_dir(work), source, seen).version
