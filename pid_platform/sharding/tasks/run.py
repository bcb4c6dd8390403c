"""A whole build in one process: the plan, write task 0 of 1 and the commit (``pid-shard``
without a subcommand), for a folder or an ``s3://`` output. The bytes are those of the same
stages run as separate tasks, whatever ``N``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from loader.formats.wdinfo import root_base
from pid_platform.sharding import pipeline
from pid_platform.sharding.commit import s3_output, versions
from pid_platform.sharding.commit.lease import build_lease
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.intake.file_checks import VALIDATE_FULL
from pid_platform.sharding.layout import final_dir
from pid_platform.sharding.output_lock import build_lock
from pid_platform.sharding.plan.add_modality import refuse_keep_for_positional_readers
from pid_platform.sharding.plan.plan_files import load_shards
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import SourceStore
from pid_platform.sharding.tasks.commit import run_commit
from pid_platform.sharding.tasks.outcomes import validate_of
from pid_platform.sharding.tasks.plan import run_plan
from pid_platform.sharding.tasks.write import run_write_task


def run_build(
    store: SourceStore, source: str, out: Path | S3Output, config: ShardingConfig, *, num_workers: int = 1,
    trust_pickle: bool = False, progress: Callable[[int, int], None] | None = None, force: bool = False,
    validate: str = VALIDATE_FULL, revalidate: bool = False, manifest_root: str = "relative",
    repair: bool = False, work_root: str | Path | None = None,
) -> pipeline.BuildSummary:
    """``pid-shard``: the tasked build in one process, holding the output's build lock (a
    folder) or lease (a bucket) throughout: ``run_plan``, write task 0 of 1, ``run_commit``
    (the functions ``pid-shard plan|task|commit`` and the Dagster steps run).

    A rebuild validates only new or changed files (``revalidate``: all of them), and one that
    finds nothing changed writes nothing (``BuildSummary.up_to_date``). A missing tar, or one of
    the wrong size, is seen by every rebuild and written again; ``repair`` also reads every tar
    back and replaces those whose sha256 differs from their manifest's.
    """
    on_s3 = isinstance(out, S3Output)
    if not on_s3:
        out = Path(out)
        root_base(manifest_root, final_dir(out))  # bad settings are refused before any work
        refuse_keep_for_positional_readers(manifest_root, str(final_dir(out)), config=config)
    with build_lease(out) if on_s3 else build_lock(out):
        plan = run_plan(store, source, out, config, work_root=work_root, trust_pickle=trust_pickle,
                        num_workers=num_workers, force=force, validate=validate, revalidate=revalidate, repair=repair)
        if on_s3 and plan.up_to_date:  # the bucket serves what this build would publish, whole
            return _served(out, source, plan.out, plan.report)
        task = None if plan.up_to_date else run_write_task(
            store, source, out, 0, 1, num_workers=num_workers, progress=progress, work_root=work_root, repair=repair)
        summary = run_commit(out, num_workers=num_workers, manifest_root=manifest_root, work_root=work_root)
    assert summary is not None  # a plan was staged, or (a folder) the committed build is reported
    if on_s3:
        summary.repaired = task.repaired
        summary.up_to_date = summary.up_to_date and not task.repaired
    else:  # this run's intake (files validated, outcomes reused), not the staged report's copy of it
        summary.report, summary.damaged_shards = plan.report, plan.damaged_shards
    return summary


def _served(output: S3Output, source: str, work: Path, report) -> pipeline.BuildSummary:
    """The summary of a build whose version the bucket already serves (its plan in ``work``)."""
    staged = versions.staging_dir(work)
    folder = staged if staged.exists() else final_dir(work)
    pointer = s3_output.read_pointer(output)
    results = pipeline.planned_results(load_shards(folder, pipeline.load_sharding_config(folder)))
    return pipeline.BuildSummary(source, folder, report, pipeline.summarize(results),
                                 [folder / m for m in pointer.manifests], [], validate_of(folder),
                                 up_to_date=True, published=f"{output}/{pointer.version_dir()}")
