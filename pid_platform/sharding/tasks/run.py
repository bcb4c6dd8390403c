"""The stages of a build as separate tasks: intake tasks, plan, write tasks, commit.

Each runs in any process on any machine that sees the output folder (and the source); they
meet only in the staging folder beside the output (``versions.staging_dir``):

* intake task ``I`` of ``N``: validates slice ``I`` of the source's complete samples (cut from
  the basename order, balanced by file bytes: ``intake.task.balanced_slices``) and writes their file outcomes as ``tasks/intake-I-of-N.parquet``, then its
  record. Optional: the plan validates whatever no intake task covered.
* plan: the intake over the whole source (every outcome an intake task found is reused, so it
  reads only files no task covered), ``samples.parquet``, the report, then ``plan.parquet``
  and ``sharding.json``. It holds the output's build lock.
* write task ``I`` of ``N``: the shards ``slice_bounds(shards, I, N)`` of the plan, in plan order:
  their tars (hard-linked from the committed version when unchanged), key indexes, stamps and
  digests, then its record. Write tasks run side by side (no build lock; each touches only
  its own shards' files).
* commit: refuses unless every shard of the plan is covered by a write task's record and its
  tars match their stamps; then the manifests and the folder swap (``run_manifests``).

A task that finds its own record (for the same plan) does nothing; one killed half way leaves
only files under temporary names or complete files, and run again writes the same bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loader.formats.twin_tar import key_index_relpath
from loader.formats.wdinfo import root_base
from pid_platform.sharding import pipeline
from pid_platform.sharding.commit import versions
from pid_platform.sharding.commit.manifest_roots import rewrite_manifest_roots
from pid_platform.sharding.commit.state import REPORT, SAMPLES, load_intake_settings, state_dir
from pid_platform.sharding.commit.verify_output import damaged_shards
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.intake.cache import CACHE_NAME, IntakeCache
from pid_platform.sharding.intake.file_checks import VALIDATE_FULL, check_validate_level
from pid_platform.sharding.intake.task import (
    SLICING,
    IntakeReport,
    intake_slice,
    slice_bounds,
)
from pid_platform.sharding.layout import bucket_dir, final_dir, stamp_path
from pid_platform.sharding.output_lock import build_lock
from pid_platform.sharding.pause_points import pause_point
from pid_platform.sharding.plan.add_modality import (
    refuse_keep_for_positional_readers,
)
from pid_platform.sharding.plan.columnar import ShardRef
from pid_platform.sharding.plan.plan_files import (
    load_shards,
    shards_identity,
)
from pid_platform.sharding.plan.shard_plan import ShardingConfig, ShardPlan
from pid_platform.sharding.state_doc import load_state_doc
from pid_platform.sharding.storage import SourceStore
from pid_platform.sharding.tasks.records import (
    INTAKE,
    WRITE,
    clear_records,
    intake_part_path,
    read_record,
    record_path,
    records,
    tasks_dir,
    write_record,
)
from pid_platform.sharding.write.tars import ShardResult, shard_up_to_date

# Held (PID_PAUSE_AT) once a write task has put one shard's outputs in place: tests kill it there.
SHARD_DONE_POINT = "write-task:shard-done"


def shard_done_point(index: int, of: int) -> str:
    """The same point in write task ``index`` of ``of`` only: a test holds (or fails) one task."""
    return f"write-task-{index}-of-{of}:shard-done"


class TaskOrderError(BuildError):
    """A task ran before the one it needs (a write task or commit before the plan). Its message is
    the raiser's (the sharding layer's: ``facts``, then which ``pid-shard`` command to run); a
    Dagster step raises it again with its own advice after ``facts``: an operator in the UI types
    no command."""

    def __init__(self, facts: str, advice: str) -> None:
        super().__init__(f"{facts}; {advice}")
        self.facts = facts


@dataclass(frozen=True)
class Unfinished:
    """Why a staged plan cannot be committed yet: the facts (which tasks, where their records are
    missing) and what a ``pid-shard`` user runs next. ``str()`` is the CLI's wording; a Dagster
    step uses ``worded`` with its own advice (re-execute, materialize)."""

    facts: str
    cli_advice: str

    def worded(self, advice: str) -> str:
        return f"{self.facts}: {advice}; nothing was published"

    def __str__(self) -> str:
        return self.worded(self.cli_advice)


class TasksUnfinishedError(BuildError):
    """The commit found write tasks without a completion record (or with damaged shards)."""


@dataclass
class TaskOutcome:
    stage: str
    index: int
    of: int
    record: Path
    already_done: bool  # the record was there: nothing was read or written
    items: int = 0  # samples (intake) or shards (write) in the task's slice
    first: int = 0  # position of its first shard (write; an intake slice is not contiguous)
    done: int = 0  # files validated (intake) or shards written (write)
    reused: int = 0  # outcomes reused (intake) or shards kept / hard-linked (write)
    nothing_staged: bool = False  # no plan staged, over a committed build: the plan found it up to date
    copied: int = 0  # tars an s3 write task copied inside the bucket from the current version
    repaired: int = 0  # tars of the served version an s3 write task found missing or damaged and sent again
    nbytes: int = 0  # bytes of the intake slice's files


@dataclass
class PlanOutcome:
    out: Path
    report: IntakeReport
    shards: int
    samples: int
    up_to_date: bool  # the committed build is what this one would publish: nothing staged
    files_validated: int = 0
    outcomes_reused: int = 0
    buckets: dict[str, int] = field(default_factory=dict)  # bucket -> shards
    damaged_shards: int = 0  # with ``repair``: committed shards whose tars were missing or damaged


# In a write record: the plan it wrote shards of (``plan_files.shards_identity``).
PLAN_ID = "plan_shards_sha256"


def _check_task(index: int, of: int) -> None:
    slice_bounds(0, index, of)  # raises ValueError naming the range


def run_intake_task(
    store: SourceStore, source: str, out: Path, index: int, of: int, *, trust_pickle: bool = False,
    num_workers: int = 1, validate: str = VALIDATE_FULL, revalidate: bool = False, force: bool = False,
    progress: Callable | None = None,
) -> TaskOutcome:
    """Intake task ``index`` of ``of``: the outcomes of its slice's files, then its record."""
    _check_task(index, of)
    check_validate_level(validate)
    staged = versions.staging_dir(out)
    settings = {"validate": validate, "trust_pickle": trust_pickle}
    rec = read_record(staged, INTAKE, index, of)
    if rec is not None and rec.get("settings") == settings and rec.get("slicing") == SLICING:
        return TaskOutcome(INTAKE, index, of, record_path(staged, INTAKE, index, of), True,
                           rec.get("samples", 0), nbytes=rec.get("bytes", 0))
    staging = versions.begin(out, first_step=True, force=force)
    final = final_dir(out)
    caches = [state_dir(final) / CACHE_NAME, state_dir(staging) / CACHE_NAME]
    cache = IntakeCache(validate) if revalidate else IntakeCache.load(caches, validate)
    part = intake_slice(store, source, index, of, trust_pickle=trust_pickle, num_workers=num_workers,
                        validate=validate, cache=cache, progress=progress)
    part.outcomes.save(intake_part_path(staging, index, of))
    path = write_record(staging, INTAKE, index, of, {
        "settings": settings, "slicing": SLICING, "samples": part.samples, "bytes": part.nbytes,
        "files_validated": part.files_validated, "outcomes_reused": part.outcomes_reused,
        "part": intake_part_path(staging, index, of).name,
    })
    return TaskOutcome(INTAKE, index, of, path, False, part.samples, 0, part.files_validated,
                       part.outcomes_reused, nbytes=part.nbytes)


@pipeline.build_step
def run_plan(
    store: SourceStore, source: str, out: Path, config: ShardingConfig, *, trust_pickle: bool = False,
    num_workers: int = 1, force: bool = False, validate: str = VALIDATE_FULL, revalidate: bool = False,
    progress: Callable | None = None, committed: Path | None = None, repair: bool = False,
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
                                 progress=progress, force=force, validate=validate, revalidate=revalidate,
                                 stop_if_up_to_date=True)
    r, up_to_date = result.report, result.up_to_date
    # The intake's samples, an object each, go before the plan is cut from the table it wrote:
    # the plan step's peak is the larger of the two, not their sum.
    del result
    if up_to_date:
        plans = load_shards(final_dir(out), pipeline.load_sharding_config(final_dir(out)))
        return PlanOutcome(out, r, len(plans), r.samples, True, r.files_validated, r.outcomes_reused,
                           dict(Counter(p.bucket for p in plans)), damaged)
    plans = pipeline.stage_plan_files(store, source, out, config, committed)
    return PlanOutcome(out, r, len(plans), r.samples, False, r.files_validated, r.outcomes_reused,
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
        clear_records(versions.staging_dir(out), WRITE)
    return pipeline.stage_plan_files(store, source, out, config, committed)


def staged_results(staging: Path, *, plans: list[ShardRef] | None = None,
                   ) -> tuple[ShardingConfig, list[ShardRef], list[ShardResult]]:
    """The staged plan's shards as the write tasks left them: each shard's planned sizes, and
    ``written`` where a write task's record for this plan says it wrote the shard (rather than
    kept or hard-linked it). ``plans``: the staged plan's shards, when the caller has read them."""
    config = pipeline.load_sharding_config(staging)
    if plans is None:
        plans = load_shards(staging, config)
    plan_id = shards_identity(plans)
    written = {i for r in records(staging, WRITE) if r.get(PLAN_ID) == plan_id for i in r.get("written", [])}
    return config, plans, pipeline.planned_results(plans, written.__contains__)


def _staged_plan(out: Path, what: str) -> tuple[Path, Path] | None:
    """(staging folder, its plan) ; None when nothing is staged over a committed build."""
    staged = versions.staging_dir(out)
    plan = state_dir(staged) / pipeline.PLAN
    if plan.is_file():
        return staged, plan
    if (state_dir(final_dir(out)) / SAMPLES).is_file() and not staged.exists():
        return None
    raise TaskOrderError(f"{what} of {out}: no plan is staged in {staged}",
                         "run `pid-shard plan` (the same --input-dir, --output-dir and settings) first")


def run_write_task(
    store: SourceStore, source: str, out: Path, index: int, of: int, *, num_workers: int = 1,
    progress: Callable[[int, int], None] | None = None, key_indexes: bool = True,
) -> TaskOutcome:
    """Write task ``index`` of ``of``: its range of the staged plan's shards, then its record.
    ``progress(done, total)`` after each of its shards is in place. ``key_indexes``: also each
    shard's key index (the Dagster assets leave them to ``key_indexes``, after the blocking
    checks on the tars).

    Takes no build lock: the write tasks of one plan run side by side, each writing only its own
    shards' files (and clearing only their temporary leftovers). Start them after the plan and
    finish them before the commit, which hold the lock.
    """
    _check_task(index, of)
    out = Path(out)
    found = _staged_plan(out, f"write task {index} of {of}")
    if found is None:
        return TaskOutcome(WRITE, index, of, record_path(versions.staging_dir(out), WRITE, index, of), True,
                           nothing_staged=True)
    staged, _plan_file = found
    config = pipeline.load_sharding_config(staged)
    shards = load_shards(staged, config)
    plan_id = shards_identity(shards)
    rec = read_record(staged, WRITE, index, of)
    if rec is not None and rec.get(PLAN_ID) == plan_id:
        first, stop = rec["shards"]
        return TaskOutcome(WRITE, index, of, record_path(staged, WRITE, index, of), True, stop - first, first)
    staging = versions.begin(out)
    first, stop = slice_bounds(len(shards), index, of)
    after = pipeline.after_shard(staging, key_indexes=key_indexes)

    def then(plan: ShardPlan, result: ShardResult) -> None:
        after(plan, result)
        pause_point(SHARD_DONE_POINT)
        pause_point(shard_done_point(index, of))

    # Its own samples, no others, a row group's shards at a time.
    results = pipeline.write_range(store, source, out, config, shards, first, stop, num_workers=num_workers,
                                   progress=progress, then=then)
    written = [first + i for i, r in enumerate(results) if r.written]
    # Last: the record says every output of these shards is in place.
    path = write_record(staging, WRITE, index, of, {
        PLAN_ID: plan_id, "shards": [first, stop], "written": written,
    })
    return TaskOutcome(WRITE, index, of, path, False, len(results), first, len(written), len(results) - len(written))


def _shard_complete(staging: Path, plan: ShardRef, key_indexes: bool) -> bool:
    key_index = bucket_dir(staging, plan.bucket) / key_index_relpath(plan.relpath)
    return shard_up_to_date(staging, plan) and (not key_indexes or key_index.is_file())


def spans_text(positions: list[int]) -> str:
    spans, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            spans.append(f"{start}" if start == p else f"{start}-{p}")
            start = None
    return ", ".join(spans)


def unfinished_write_tasks(out: Path, *, key_indexes: bool = True, plans: list[ShardRef] | None = None,
                           ) -> Unfinished | None:
    """Why the staged plan of ``out`` cannot be committed yet (None: every write task is done).

    Done means: every shard of the plan lies in the range of a write task's record for this plan,
    and its tars match their stamps and (``key_indexes``) its key index exists. A record whose shards are not all
    complete (a tar deleted since, or lost in a power cut after the record) is removed, so the
    task runs again when started. ``plans``: the staged plan, when the caller has read it already.
    """
    staging = versions.staging_dir(out)
    if plans is None:
        plans = load_shards(staging, pipeline.load_sharding_config(staging))
    plan_id = shards_identity(plans)
    recs = [r for r in records(staging, WRITE) if r.get(PLAN_ID) == plan_id]
    covered = [False] * len(plans)
    damaged: list[dict] = []
    for r in recs:
        try:
            start, stop = slice_bounds(len(plans), r["index"], r["of"])
        except (KeyError, TypeError, ValueError):
            continue
        if r.get("shards") != [start, stop]:
            continue
        if all(_shard_complete(staging, p, key_indexes) for p in plans[start:stop]):
            covered[start:stop] = [True] * (stop - start)
        else:
            damaged.append(r)
            Path(r["path"]).unlink(missing_ok=True)
    missing = [i for i, c in enumerate(covered) if not c]
    if not missing:
        return None
    ofs = sorted({r["of"] for r in recs} | {r["of"] for r in damaged})
    where = tasks_dir(staging)
    if len(ofs) == 1:
        n = ofs[0]
        unfinished = [i for i in range(n) if not all(covered[slice(*slice_bounds(len(plans), i, n))])]
        return Unfinished(
            f"write task{'s' if len(unfinished) > 1 else ''} {', '.join(map(str, unfinished))} of {n} "
            f"{'have' if len(unfinished) > 1 else 'has'} not finished (no completion record in {where}"
            f"{'; some had a shard missing or damaged since, and must run again' if damaged else ''})",
            f"run `pid-shard task --index I --of {n}` for each, then commit again")
    if not ofs:
        return Unfinished(
            f"no write task has finished for the staged plan of {out} ({len(plans)} shards; no completion "
            f"record in {where})",
            "run `pid-shard task --index I --of N` for I = 0 .. N-1, then commit again")
    return Unfinished(
        f"shards {spans_text(missing)} of {len(plans)} lie in no finished write task (records for --of "
        f"{', '.join(map(str, ofs))} in {where})",
        "run the missing tasks of one N, then commit again"
    )


def report_from_json(doc: dict) -> IntakeReport:
    """The intake report a plan staged (``intake_report.json``), for the commit's summary."""
    return IntakeReport(
        doc["source"], modalities=list(doc["modalities"]), empty_modalities=list(doc["empty_modalities"]),
        image_modality=doc["image_modality"], files_seen=dict(doc["files_seen"]), orphans=dict(doc["orphans"]),
        skipped_files=Counter(doc["skipped_files"]), dropped=Counter(doc["dropped"]),
        examples={k: list(v) for k, v in doc["examples"].items()}, key_collisions=doc["key_collisions"],
        samples=doc["samples"],
    )


def _validate_of(folder: Path) -> str:
    return (load_intake_settings(folder) or {}).get("validate", VALIDATE_FULL)


@pipeline.build_step
def run_commit(out: Path, *, num_workers: int = 1, manifest_root: str = "relative") -> pipeline.BuildSummary:
    """Commit the staged plan of ``out`` once every write task is done: manifests, state, swap.

    Refuses (``TasksUnfinishedError``, naming the tasks) while any shard lacks a finished task.
    With nothing staged over a committed build (the plan found it up to date) it only rewrites
    the manifests' roots if asked otherwise and reports the committed build.
    """
    out = Path(out)
    root_base(manifest_root, final_dir(out))  # a bad root is refused before anything is written
    found = _staged_plan(out, "commit")
    if found is None:
        final = final_dir(out)
        rewrite_manifest_roots(out, manifest_root)
        report = report_from_json(load_state_doc((state_dir(final) / REPORT).read_bytes(), state_dir(final) / REPORT))
        results, manifests = pipeline.committed_results(out)
        return pipeline.BuildSummary(report.source, out, report, pipeline.summarize(results), manifests, [],
                                     _validate_of(final), up_to_date=True)
    staging, _plan = found
    # One row per shard, read once for the checks, the manifests and the summary.
    plans = load_shards(staging, pipeline.load_sharding_config(staging))
    problem = unfinished_write_tasks(out, plans=plans)
    if problem is not None:
        raise TasksUnfinishedError(f"commit of {out}: {problem}")
    report = report_from_json(load_state_doc((state_dir(staging) / REPORT).read_bytes(), state_dir(staging) / REPORT))
    _config, _plans, results = staged_results(staging, plans=plans)
    validate = _validate_of(staging)
    _, manifests, removed = pipeline.run_manifests(out, report.source, num_workers=num_workers,
                                                   manifest_root=manifest_root, plans=plans)
    return pipeline.BuildSummary(report.source, out, report, pipeline.summarize(results),
                                 [m.path for m in manifests], removed, validate)


def run_build(
    store: SourceStore, source: str, out: Path, config: ShardingConfig, *, num_workers: int = 1,
    trust_pickle: bool = False, progress: Callable[[int, int], None] | None = None, force: bool = False,
    validate: str = VALIDATE_FULL, revalidate: bool = False, manifest_root: str = "relative",
    repair: bool = False,
) -> pipeline.BuildSummary:
    """``pid-shard`` of a folder output: the tasked build in one process, holding the build lock
    throughout: ``run_plan``, write task 0 of 1, ``run_commit`` (the functions ``pid-shard
    plan|task|commit`` and the Dagster steps run; ``s3_tasks.run_s3_build`` for an s3 output).

    A rebuild validates only new or changed files (``revalidate``: all of them), and one that
    finds nothing changed writes nothing (``BuildSummary.up_to_date``). A missing tar, or one of
    the wrong size, is seen by every rebuild (its stamp) and written again; ``repair`` also reads
    every tar and replaces those whose sha256 differs from their manifest's.
    """
    out = Path(out)
    root_base(manifest_root, final_dir(out))  # bad settings are refused before any work
    refuse_keep_for_positional_readers(manifest_root, str(final_dir(out)), config=config)
    with build_lock(out):
        plan = run_plan(store, source, out, config, trust_pickle=trust_pickle, num_workers=num_workers, force=force,
                        validate=validate, revalidate=revalidate, repair=repair)
        if not plan.up_to_date:
            run_write_task(store, source, out, 0, 1, num_workers=num_workers, progress=progress)
        summary = run_commit(out, num_workers=num_workers, manifest_root=manifest_root)
    # This run's intake (files validated, outcomes reused), not the staged report's copy of it.
    summary.report, summary.damaged_shards = plan.report, plan.damaged_shards
    return summary
