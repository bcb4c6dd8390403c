"""A whole build in one process: the plan, write task 0 of 1 and the commit (``pid-shard``
without a subcommand), for a folder (``run_build``) and an ``s3://`` output (``run_s3_build``).
The bytes are those of the same stages run as separate tasks, whatever ``N``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from loader.formats.wdinfo import root_base
from pid_platform.sharding import pipeline
from pid_platform.sharding.commit import s3_output, versions
from pid_platform.sharding.commit.lease import build_lease
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.commit.state import load_intake_settings
from pid_platform.sharding.intake.file_checks import VALIDATE_FULL
from pid_platform.sharding.layout import final_dir
from pid_platform.sharding.output_lock import build_lock
from pid_platform.sharding.plan.add_modality import refuse_keep_for_positional_readers
from pid_platform.sharding.plan.plan_files import load_shards
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import SourceStore
from pid_platform.sharding.tasks.commit import run_commit, run_s3_commit
from pid_platform.sharding.tasks.plan import run_plan, run_s3_plan
from pid_platform.sharding.tasks.plan import (
    stage_plan as stage_plan,  # bench/bench_build_scale.py imports it here
)
from pid_platform.sharding.tasks.write import run_s3_write_task, run_write_task


def run_build(
    store: SourceStore, source: str, out: Path, config: ShardingConfig, *, num_workers: int = 1,
    trust_pickle: bool = False, progress: Callable[[int, int], None] | None = None, force: bool = False,
    validate: str = VALIDATE_FULL, revalidate: bool = False, manifest_root: str = "relative",
    repair: bool = False,
) -> pipeline.BuildSummary:
    """``pid-shard`` of a folder output: the tasked build in one process, holding the build lock
    throughout: ``run_plan``, write task 0 of 1, ``run_commit`` (the functions ``pid-shard
    plan|task|commit`` and the Dagster steps run; ``run_s3_build`` for an s3 output).

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
