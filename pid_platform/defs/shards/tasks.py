"""The steps ``twin_tar_shards`` runs as: plan -> one write task per range of shards -> collect.

A source's tars are written by ``N`` write-task steps (``DynamicOut``, one mapped step per task),
so the run's executor places them: processes on this machine (``multiprocess``), Celery workers,
ECS tasks (``defs/executors.py``). Each step is ``pid_platform.sharding.tasks.run``'s task of the
same name, which ``pid-shard plan | task --index I --of N`` runs without Dagster; the bytes do not
depend on ``N``.

* ``plan``: the run's sharding settings, then ``plan.parquet`` and ``sharding.json`` cut from the
  samples ``sample_set`` staged (or the committed ones, re-sharded); it emits one write task per
  ``ShardingResource.write_tasks_for(shards)`` (``write_tasks`` / ``shards_per_write_task``).
* ``write_task[I_of_N]``: task ``I`` of ``N`` (its tars, stamps and digests; a folder's key indexes
  stay ``key_indexes``' step, after the blocking checks on the tars), in the ``pid_build`` pool
  (its limit caps how many run at once, across runs), retried by ``TASK_RETRY`` on a transient
  error. It logs its shards as they are written and ends with its completion record; a task
  step that finds its record does nothing, so "re-execute from failure" redoes only unfinished
  tasks. ``plan`` clears the records of an earlier run: a new run's tasks check every shard
  again (keeping those still up to date) and report what they wrote themselves.
* ``collect``: once every task step is done, checks that every shard of the plan lies in a
  finished task (``StagedShards.unfinished``) and records ``twin_tar_shards``' materialization,
  metadata and data version as the one-step asset did. The version is committed later, by
  ``wdinfo_manifests``.

The steps meet in the source's staging folder (and pass one small value, the plan's summary,
from ``plan`` to ``collect`` through the run's IO manager); a local output on storage every
worker mounts fans out. For an ``s3://`` output they meet in the bucket instead
(``sharding/tasks/``): ``plan`` takes the samples ``sample_set`` staged there and
stages the plan there, each write task sends its shards into the version's folder from the
work folder of whichever machine runs it, and ``collect`` reads the tasks' records: no step
needs another's disk.
"""


import hashlib
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import dagster as dg

from pid_platform.defs.automation.builds import last_committed_build
from pid_platform.defs.automation.run_holds import holding_output
from pid_platform.defs.groups import BUILD_POOL
from pid_platform.defs.intake.assets import ratio_label
from pid_platform.defs.metadata import bucket_label, human_bytes, row_count, table
from pid_platform.defs.plots import png_markdown, shard_sizes_png
from pid_platform.defs.resources import ShardingResource, SourceStoreResource
from pid_platform.defs.retries import IO_RETRY, retry_only_transient
from pid_platform.defs.settings import RunSettings, settings_for_run, settings_metadata
from pid_platform.defs.step_errors import step_failure
from pid_platform.sharding.commit import versions
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.commit.state import SAMPLES, state_dir
from pid_platform.sharding.layout import final_dir
from pid_platform.sharding.output_lock import build_lock
from pid_platform.sharding.pipeline import summarize
from pid_platform.sharding.plan.columnar import ShardRef
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.tasks.commit import staged_shards
from pid_platform.sharding.tasks.outcomes import TaskOrderError, TasksUnfinishedError, Unfinished
from pid_platform.sharding.tasks.plan import stage_plan, stage_plan_in_bucket
from pid_platform.sharding.tasks.published import pull_committed_intake
from pid_platform.sharding.tasks.staging import INTAKE_STATE, pull_staged_intake
from pid_platform.sharding.tasks.write import run_write_task
from pid_platform.sharding.write.tars import ShardResult


def nothing_to_finish(context: dg.OpExecutionContext, source: str) -> str:
    """What a step of a re-executed run says when the build it would finish is gone: the source
    was built and committed by another run since (the sensor's, the schedule's, an operator's),
    so this run has nothing left to do and changes nothing."""
    committed = last_committed_build(context.instance, source)
    by = f"run {committed.run_id}" if committed is not None and committed.run_id else "another run"
    return (f"nothing to finish: {source} was rebuilt by {by} since this run's plan; its committed build "
            "stands and this run changes nothing (launch a new run to build it again)")


# What an operator in the UI does when the sharding layer finds no plan staged or write tasks
# unfinished; its own messages advise `pid-shard` commands, which the UI's user does not type.
NO_PLAN_ADVICE = "launch the source_build job for this partition (sample_set stages what the plan needs)"
UNFINISHED_ADVICE = ("re-execute the run with all steps (Re-execute -> All steps), or launch the source_build "
                     "job for this partition")


@contextmanager
def ui_advice() -> Iterator[None]:
    """Inside a step: a ``TaskOrderError`` of the sharding layer, raised again with the UI's advice
    (its CLI wording left out of the chain, so the run view never shows a `pid-shard` command)."""
    try:
        yield
    except TaskOrderError as exc:
        raise TaskOrderError(exc.facts, NO_PLAN_ADVICE) from None


def unfinished_failure(what: str, problem: Unfinished) -> TasksUnfinishedError:
    """``what``'s write tasks unfinished, worded for the UI."""
    return TasksUnfinishedError(f"{what}: {problem.worded(UNFINISHED_ADVICE)}")


def _no_sample_set(source: str) -> dg.Failure:
    return step_failure(
        f"twin_tar_shards of {source} has no sample set to cut: no build of it is staged or committed. "
        "Select sample_set with it (sample_set, twin_tar_shards and what follows them), or launch the "
        f"source_build job for partition {source!r}")


def s3_sample_set_to_cut(target: S3Output, out: Path, source: str) -> str:
    """``sample_set_to_cut`` for an s3 output, from the bucket alone (whichever machine this
    step runs on): the samples ``sample_set`` staged there, else those the published version
    carries, into this machine's staging folder."""
    if pull_staged_intake(target, out):
        return "staged"
    if pull_committed_intake(target, out):
        return "committed"
    raise _no_sample_set(source)


def sample_set_to_cut(out: Path, source: str) -> str:
    """Where this step's samples come from: ``staged`` (this build's intake), or ``committed``
    (nothing staged: the committed build's sample set is copied into a new staging folder and
    re-sharded with the source's current settings). Refuses at once when there is neither."""
    if (state_dir(versions.staging_dir(out)) / SAMPLES).is_file():
        return "staged"
    committed = state_dir(final_dir(out))
    if not (committed / SAMPLES).is_file():
        raise _no_sample_set(source)
    with build_lock(out):
        staged = state_dir(versions.begin(out))
        staged.mkdir(exist_ok=True)
        for name in INTAKE_STATE:
            if (committed / name).is_file():
                shutil.copy2(committed / name, staged / name)
    return "committed"


# A write task redoes only its unfinished shards (finished ones are kept), so a retry is cheap.
TASK_RETRY = IO_RETRY


@dataclass(frozen=True)
class Planned:
    """What ``plan`` hands ``collect``: where the samples came from, the run's settings, the
    plan's digest (the asset's data version) and how many write tasks were emitted."""

    samples_from: str  # "staged" or "committed" (``sample_set_to_cut``)
    run_settings: RunSettings
    data_version: str
    shards: int
    tasks: int


def task_key(index: int, of: int) -> str:
    """The mapping key of write task ``index`` of ``of`` (the UI shows ``write_task[2_of_8]``)."""
    return f"{index}_of_{of}"


def parse_task_key(key: str) -> tuple[int, int]:
    index, sep, of = key.partition("_of_")
    if not (sep and index.isdigit() and of.isdigit()):
        raise ValueError(f"write task mapping key {key!r}: expected '<index>_of_<tasks>', e.g. {task_key(0, 1)!r}")
    return int(index), int(of)


def plans_digest(config_version: str, plans: list[ShardRef]) -> str:
    # A plan's digest covers its keys, files and place; together they name the bytes on disk.
    h = hashlib.sha256(config_version.encode())
    for p in plans:
        h.update(p.digest().encode())
    return h.hexdigest()[:16]


@dg.op(
    name="plan",
    ins={"after": dg.In(dg.Nothing)},
    out={"tasks": dg.DynamicOut(dg.Nothing), "planned": dg.Out(Planned)},
    retry_policy=IO_RETRY,
)
def plan_write_tasks(
    context: dg.OpExecutionContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> Iterator[dg.Output | dg.DynamicOutput]:
    """Cut the staged samples into shards with the run's settings; one write task per range."""
    source = context.partition_key
    with holding_output(context, source, source_store):  # the run holds the source to its end (run_holds.py)
        out = source_store.source_out(source)
        target = source_store.source_target(source)
        with retry_only_transient():
            run_settings = settings_for_run(context, source_store, sharding, source)
            # sample_set may have run on another machine: an s3 output's samples come from the bucket.
            samples_from = sample_set_to_cut(out, source) if target is None else s3_sample_set_to_cut(target, out, source)
            # A new run's tasks check their shards again (retries and re-execution keep the records).
            if target is not None:
                plans, version = stage_plan_in_bucket(source_store.open(), source, target, out, run_settings.config)
                context.log.info(f"{source}: the plan of version {version} is staged in {target}; the write tasks "
                                 "send their shards there from any machine")
            else:
                plans = stage_plan(source_store.open(), source, out, run_settings.config, fresh_tasks=True)
        if samples_from == "committed":
            context.log.info(f"{source}: no intake staged; re-sharding the committed sample set of {source} (key "
                             "indexes and manifests follow once materialized; the published version stays until then)")
        tasks = sharding.write_tasks_for(len(plans))
        context.log.info(f"{source}: {len(plans)} shards in {tasks} write task{'s' if tasks != 1 else ''}")
        yield dg.Output(
            Planned(samples_from, run_settings, plans_digest(run_settings.config.version(), plans), len(plans), tasks),
            output_name="planned", metadata={"shards": len(plans), "write_tasks": tasks},
        )
        for index in range(tasks):
            yield dg.DynamicOutput(None, mapping_key=task_key(index, tasks), output_name="tasks")


@dg.op(
    name="write_task",
    ins={"after": dg.In(dg.Nothing)},
    out=dg.Out(dg.Nothing),
    pool=BUILD_POOL,
    retry_policy=TASK_RETRY,
)
def write_task(
    context: dg.OpExecutionContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> Iterator[dg.Output]:
    """Write task ``I`` of ``N``: its range of the plan's shards (tars, stamps, digests), then
    its completion record; nothing at all when the record is already there."""
    index, of = parse_task_key(context.get_mapping_key() or "")
    source = context.partition_key
    with holding_output(context, source, source_store):  # the run holds the source to its end (run_holds.py)
        out = source_store.source_out(source)
        name = f"{source}: write task {index} of {of}"

        def progress(done: int, total: int) -> None:
            if done == total or done % max(1, total // 10) == 0:
                context.log.info(f"{name}: {done}/{total} shards")

        target = source_store.source_target(source)
        with retry_only_transient(), ui_advice():
            # Shard by shard into the staging folder or the bucket; the later steps read what this
            # task recorded. A bucket's task checks each shard and sends its key index, where its
            # bytes are; a folder's key indexes stay key_indexes' job, after the blocking checks on
            # these tars (a kept tar damaged in place fails its check, not this task).
            outcome = run_write_task(source_store.open(), source, out if target is None else target, index, of,
                                     work_root=source_store.work_root or None, num_workers=sharding.num_workers,
                                     progress=progress, key_indexes=target is not None)
        if outcome.nothing_staged:
            context.log.info(f"{name}: {nothing_to_finish(context, source)}")
        elif outcome.already_done:
            context.log.info(f"{name}: already done ({outcome.record} is there); nothing written")
        yield dg.Output(None, metadata={
            "task": index, "of": of, "shards": outcome.items, "first_shard": outcome.first,
            "written": outcome.done, "reused": outcome.reused, "already_done": outcome.already_done,
            "nothing_staged": outcome.nothing_staged,
            "record": dg.MetadataValue.path(str(outcome.record)),
        })


def shards_metadata(source: str, output: str, config: ShardingConfig, planned: Planned,
                    results: list[ShardResult]) -> dict:
    """The metadata of a ``twin_tar_shards`` materialization: its shards by bucket, sizes against the bound."""
    buckets = summarize(results)
    written = sum(int(r.written) for r in results)
    by_bucket = table(
        (("bucket", "string"), ("shards", "int"), ("samples", "int"), ("bytes", "int"), ("size", "string"),
         ("written", "int"), ("reused", "int")),
        [(bucket_label(b.bucket), b.shards, b.samples, b.bytes, human_bytes(b.bytes), b.written, b.shards - b.written)
         for b in buckets.values()],
    )
    # MB as the bound counts them (max_shard_size_mb), so the line and the bars share one unit.
    mb = config.max_shard_bytes / config.max_shard_size_mb
    ordered = sorted(results, key=lambda r: (r.bucket, r.index))
    plot = shard_sizes_png(
        [sum(r.bytes.values()) / mb for r in ordered], [ratio_label(r.bucket) for r in ordered],
        None if config.shard_size > 0 else config.max_shard_size_mb,
        title=f"{source}: shard sizes" + (f" ({config.shard_size} samples each)" if config.shard_size > 0 else ""),
    )
    return {
        "shards": len(results),
        "samples": sum(b.samples for b in buckets.values()),
        "bytes": sum(b.bytes for b in buckets.values()),
        "size": human_bytes(sum(b.bytes for b in buckets.values())),
        "buckets": len(buckets),
        "written": written,
        "reused": len(results) - written,
        "write_tasks": planned.tasks,
        "config_version": config.version(),
        "sharding": dg.MetadataValue.json(asdict(config)),
        "sample_set": planned.samples_from,
        **settings_metadata(planned.run_settings),
        "shards_by_bucket": by_bucket,
        **row_count(sum(b.samples for b in buckets.values())),
        "shard_sizes_plot": png_markdown(plot, f"shard sizes of {source} against the bound"),
        # Staged until wdinfo_manifests commits them; this is where they are from then on.
        "output": dg.MetadataValue.path(output),
    }


# Optional: a re-execution that finds the source rebuilt since ends here, materializing nothing
# (what follows in the run is skipped, not failed, and the committed build's state stands).
@dg.op(name="collect", ins={"planned": dg.In(Planned), "tasks": dg.In(dg.Nothing)},
       out=dg.Out(dg.Nothing, is_required=False), retry_policy=IO_RETRY)
def collect_write_tasks(
    context: dg.OpExecutionContext, source_store: SourceStoreResource, planned: Planned
) -> Iterator[dg.Output]:
    """Every write task done: ``twin_tar_shards``' materialization, from the staged shards."""
    source = context.partition_key
    with holding_output(context, source, source_store):  # the run holds the source to its end (run_holds.py)
        out = source_store.source_out(source)
        target = source_store.source_target(source)
        with retry_only_transient(), ui_advice():
            shards = staged_shards(out if target is None else target, source_store.work_root or None, "collect")
            if shards is None:
                # Nothing of this run's plan is staged any more, over a committed build: another run
                # built and committed the source after this run's plan (a re-execution found it so).
                context.log.info(f"{source}: {nothing_to_finish(context, source)}")
                return
            problem = shards.unfinished()
            if problem is not None:
                raise unfinished_failure(f"twin_tar_shards of {source}", problem)
            config, results = shards.config, shards.results()
            shards.discard()
        metadata = shards_metadata(source, source_store.output_location(source), config, planned, results)
        with warnings.catch_warnings():
            # An op's data_version is "beta" in 1.13; the one-op asset set the same version through
            # MaterializeResult, and the UI's staleness depends on it.
            warnings.simplefilter("ignore", dg.BetaWarning)
            out = dg.Output(None, metadata=metadata, tags=planned.run_settings.tags,
                            data_version=dg.DataVersion(planned.data_version))
        yield out
