"""A source's tars through Dagster's fan-out (``twin_tar_shards``: plan -> write_task[I_of_N] ->
collect), run as the UI runs it: a real sqlite instance, the code location loaded by module, the
launchpad's config with the multiprocess executor, every step its own process.

The bytes equal the one-process ``pid-shard`` build; the run shows one step per write task; the
pool caps how many run at once; a task that fails once is retried and the bytes are the same; a
task that fails for good leaves the others' records, and "re-execute from failure" runs only it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.definitions.reconstruct import ReconstructableRepository

from pid_platform.defs.groups import BUILD_POOL
from pid_platform.defs.partitions import SOURCES
from pid_platform.defs.pools import apply_pool_limits
from pid_platform.defs.resources import ShardingResource
from pid_platform.defs.small_sources import IN_PROCESS_BELOW_ENV
from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.intake.task import slice_bounds
from pid_platform.sharding.pause_points import PAUSE_AT_ENV, PAUSE_DIR_ENV, PAUSE_TIMEOUT_ENV
from pid_platform.sharding.settings import SETTINGS_NAME
from pid_platform.sharding.tasks.outcomes import shard_done_point
from pid_platform.sharding.tasks.records import WRITE, folder_staging, records, tasks_dir
from tests.support.build_data import SOURCE, output_files

REPO = Path(__file__).resolve().parents[1]
PID_SHARD = str(Path(sys.executable).parent / "pid-shard")
TASKS = 3
# The source's own settings file (as the launchpad would have written it), and the same settings
# given to pid-shard: 0.25 MiB cuts the 32 photos into a dozen shards or so.
SETTINGS_FILE = "max_shard_size_mb: 0.25\npart_size: 2\nshuffle: true\nseed: 3\n"
PID_SHARD_SETTINGS = ["--max-shard-size-mb", "0.25", "--part-size", "2", "--shuffle", "--seed", "3"]
WRITE_STEP = "twin_tar_shards.write_task"
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def _launchpad_config(**sharding: Any) -> dict:
    """What an operator launches: the multiprocess executor (room for every task at once, so only
    the pool can hold them back) and the number of write tasks."""
    return {**QUIET, "execution": {"config": {"multiprocess": {"max_concurrent": TASKS + 1}}},
            "resources": {"sharding": {"config": {"num_workers": 1, "write_tasks": TASKS, **sharding}}}}


def _job() -> Any:
    # Loaded by module name, as each step's process loads it.
    repo = ReconstructableRepository.for_module("pid_platform.definitions", "defs", working_directory=str(REPO))
    return repo.get_reconstructable_job("source_build")


@pytest.fixture
def instance(raw_root: Path, out_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dg.DagsterInstance]:
    """A persistent (sqlite) instance, as ``dagster dev`` keeps; the source registered. The
    source is small: it would build in one process (``defs/small_sources.py``); these tests are
    about the fan-out, so every source fans out here."""
    monkeypatch.setenv(IN_PROCESS_BELOW_ENV, "0")
    (raw_root / SOURCE / SETTINGS_NAME).write_text(SETTINGS_FILE)
    with dg.instance_for_test() as inst:
        inst.add_dynamic_partitions(SOURCES, [SOURCE])
        yield inst


def _execute(instance: dg.DagsterInstance, config: dict | None = None, assets: list[str] | None = None,
             reexecution: dg.ReexecutionOptions | None = None) -> tuple[bool, str]:
    # A re-execution keeps its parent's partition (the UI copies the parent run's tags).
    kwargs: dict[str, Any] = {"reexecution_options": reexecution} if reexecution else {
        "run_config": config, "asset_selection": [dg.AssetKey(a) for a in assets] if assets else None,
    }
    with dg.execute_job(_job(), instance, tags={"dagster/partition": SOURCE}, **kwargs) as result:
        return result.success, result.run_id


def _events(instance: dg.DagsterInstance, run_id: str, kind: dg.DagsterEventType) -> list[dg.EventLogEntry]:
    return [r for r in instance.all_logs(run_id, of_type=kind) if r.step_key]


def _steps(instance: dg.DagsterInstance, run_id: str, kind: dg.DagsterEventType) -> list[str]:
    return sorted(r.step_key for r in _events(instance, run_id, kind) if r.step_key)


def _task_steps(instance: dg.DagsterInstance, run_id: str, kind: dg.DagsterEventType) -> list[str]:
    return [s for s in _steps(instance, run_id, kind) if s.startswith(WRITE_STEP)]


def _most_at_once(instance: dg.DagsterInstance, run_id: str) -> int:
    """The most write-task steps that were executing at one moment (from start to end of each try)."""
    ends = (dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.STEP_UP_FOR_RETRY)
    edges = []
    for r in instance.all_logs(run_id):
        if not (r.step_key or "").startswith(WRITE_STEP) or r.dagster_event is None:
            continue
        if r.dagster_event.event_type in (dg.DagsterEventType.STEP_START, dg.DagsterEventType.STEP_RESTARTED):
            edges.append((r.timestamp, 1))
        elif r.dagster_event.event_type in ends:
            edges.append((r.timestamp, -1))
    running = most = 0
    for _t, d in sorted(edges, key=lambda e: (e[0], e[1])):  # an end before a start at the same instant
        running += d
        most = max(most, running)
    return most


def _reference(raw_root: Path, tmp_path: Path) -> Path:
    ref = tmp_path / "reference"
    res = subprocess.run([PID_SHARD, "--input-dir", str(raw_root / SOURCE), "--output-dir", str(ref),
                          *PID_SHARD_SETTINGS, "--num-workers", "2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return ref


def _task_metadata(instance: dg.DagsterInstance, run_id: str) -> dict[str, dict[str, Any]]:
    """Write-task step -> the metadata of its output."""
    found = {}
    for r in _events(instance, run_id, dg.DagsterEventType.STEP_OUTPUT):
        if r.step_key and r.step_key.startswith(WRITE_STEP):
            data = r.dagster_event.step_output_data
            found[r.step_key] = {k: getattr(v, "value", v) for k, v in data.metadata.items()}
    return found


def _release_after_retry(instance: dg.DagsterInstance, pause_dir: Path, step: str, point: str) -> threading.Thread:
    """Let ``point`` time out once (the step fails), then let it through: ``.go`` is created as
    soon as the instance records the step as up for retry, before its next try reaches the point."""

    def release() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            for run in instance.get_runs():
                if any(r.step_key == step for r in instance.all_logs(
                        run.run_id, of_type=dg.DagsterEventType.STEP_UP_FOR_RETRY)):
                    (pause_dir / f"{point.replace(':', '-')}.go").write_text("")
                    return
            time.sleep(0.1)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_fanout_equals_pid_shard_and_a_task_failing_once_is_retried(
    raw_root: Path, out_root: Path, tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference = _reference(raw_root, tmp_path)
    # One task at a time, across every run on the instance (the UI: Deployment > Concurrency).
    assert apply_pool_limits(instance, {BUILD_POOL: 1}) == {BUILD_POOL: 1}
    # Task 1 of 3 fails after its first shard (the pause point times out), once.
    pause_dir = tmp_path / "pause"
    pause_dir.mkdir()
    point = shard_done_point(1, TASKS)
    monkeypatch.setenv(PAUSE_AT_ENV, point)
    monkeypatch.setenv(PAUSE_DIR_ENV, str(pause_dir))
    monkeypatch.setenv(PAUSE_TIMEOUT_ENV, "1")
    failing = f"{WRITE_STEP}[1_of_{TASKS}]"
    releaser = _release_after_retry(instance, pause_dir, failing, point)

    ok, run_id = _execute(instance, _launchpad_config())
    releaser.join(timeout=5)
    assert ok
    src_out = out_root / SOURCE
    assert output_files(src_out) == output_files(reference)  # byte for byte, every tar and manifest
    assert not staging_dir(src_out).exists()

    # One step per task, each done once; the failing one was retried and then succeeded.
    tasks = [f"{WRITE_STEP}[{i}_of_{TASKS}]" for i in range(TASKS)]
    assert _task_steps(instance, run_id, dg.DagsterEventType.STEP_SUCCESS) == tasks
    assert _task_steps(instance, run_id, dg.DagsterEventType.STEP_UP_FOR_RETRY) == [failing]
    assert _task_steps(instance, run_id, dg.DagsterEventType.STEP_RESTARTED) == [failing]
    assert _most_at_once(instance, run_id) == 1  # the pool held them to one at a time
    # Each task's progress is in its step's log, and its outcome in its output's metadata.
    shards = sum(1 for p in output_files(reference) if p.startswith("aspect_ratio_") and "/image/" in p
                 and p.endswith(".tar"))
    ranges = [slice_bounds(shards, i, TASKS) for i in range(TASKS)]
    progress = [r.user_message for r in instance.all_logs(run_id)
                if r.step_key == tasks[0] and r.user_message.startswith(f"{SOURCE}: write task 0 of {TASKS}: ")]
    n = ranges[0][1]
    assert progress[-1].endswith(f": {n}/{n} shards") and len(progress) == n, progress
    meta = _task_metadata(instance, run_id)
    assert [(meta[t]["first_shard"], meta[t]["first_shard"] + meta[t]["shards"]) for t in tasks] == ranges
    assert not any(meta[t]["already_done"] for t in tasks)
    # The retry kept the shard its first try had finished (stamp intact) and wrote the rest.
    assert [meta[t]["reused"] for t in tasks] == [0, 1, 0]
    assert sum(meta[t]["written"] for t in tasks) == shards - 1

    # The asset is what it was: one materialization, its metadata from the collect step.
    mats = instance.fetch_materializations(dg.AssetKey("twin_tar_shards"), limit=10).records
    assert len(mats) == 1 and mats[0].partition_key == SOURCE
    shown = {k: getattr(v, "value", v) for k, v in mats[0].asset_materialization.metadata.items()}
    assert (shown["shards"], shown["written"], shown["reused"], shown["write_tasks"]) == (shards, shards - 1, 1, TASKS)
    assert shown["samples"] == 32 and shown["dagster/row_count"] == 32
    assert shown["bytes"] == sum(len(b) for p, b in output_files(reference).items() if p.endswith(".tar"))
    # The version records which tasks made it.
    assert sorted(p.name for p in tasks_dir(src_out).glob(f"{WRITE}-*.json")) == [
        f"write-{i:06d}-of-{TASKS:06d}.json" for i in range(TASKS)]


def _a_file_of(raw_root: Path) -> Path:
    return sorted((raw_root / SOURCE / "image").iterdir())[0]


@pytest.mark.slow
def test_reexecute_from_failure_runs_only_the_unfinished_task(
    raw_root: Path, out_root: Path, tmp_path: Path, instance: dg.DagsterInstance,
) -> None:
    reference = _reference(raw_root, tmp_path)
    config = _launchpad_config()
    # The samples first; then one image goes missing before the tars are written: the task
    # holding it fails for good (a missing file is no transient error), the other two finish.
    assert _execute(instance, config, ["sample_set"])[0]
    victim = _a_file_of(raw_root)
    # Hidden without touching any file's identity (renaming the file itself moves its ctime,
    # which a write task refuses as a source changed since the plan): the image folder becomes
    # links to every other file of the real one, moved aside under a name no listing takes.
    image = victim.parent
    real = image.rename(image.with_name("_image"))
    image.mkdir()
    for f in sorted(real.iterdir()):
        if f.name != victim.name:
            (image / f.name).symlink_to(f)
    ok, failed_run = _execute(instance, config, ["twin_tar_shards", "key_indexes", "wdinfo_manifests"])
    assert not ok
    failed = _task_steps(instance, failed_run, dg.DagsterEventType.STEP_FAILURE)
    assert len(failed) == 1 and not _task_steps(instance, failed_run, dg.DagsterEventType.STEP_UP_FOR_RETRY)
    staged = folder_staging(staging_dir(out_root / SOURCE))
    done = {r["index"]: Path(r["path"]).stat().st_mtime_ns for r in records(staged, WRITE)}
    unfinished = int(failed[0].removeprefix(f"{WRITE_STEP}[").split("_")[0])
    assert sorted(done) == sorted(set(range(TASKS)) - {unfinished})
    assert not (out_root / SOURCE).exists()  # nothing was published

    # A finished task run again finds its record and does nothing.
    finished = f"{WRITE_STEP}[{min(done)}_of_{TASKS}]"
    ok, again = _execute(instance, reexecution=dg.ReexecutionOptions(parent_run_id=failed_run,
                                                                     step_selection=[finished]))
    assert ok and _task_steps(instance, again, dg.DagsterEventType.STEP_SUCCESS) == [finished]
    assert _task_metadata(instance, again)[finished]["already_done"] is True
    assert {r["index"]: Path(r["path"]).stat().st_mtime_ns for r in records(staged, WRITE)} == done

    # The file is back: re-executed from failure, only the unfinished task runs, then what follows.
    shutil.rmtree(image)
    real.rename(image)
    ok, rerun = _execute(instance, reexecution=dg.ReexecutionOptions.from_failure(failed_run, instance))
    assert ok
    assert _task_steps(instance, rerun, dg.DagsterEventType.STEP_START) == failed
    ran = set(_steps(instance, rerun, dg.DagsterEventType.STEP_SUCCESS))
    assert {"twin_tar_shards.collect", "key_indexes", "wdinfo_manifests"} <= ran
    assert "twin_tar_shards.plan" not in ran
    # The finished tasks' records were left as they were; the version holds all three.
    src_out = out_root / SOURCE
    kept = records(folder_staging(src_out), WRITE)
    assert {r["index"]: Path(r["path"]).stat().st_mtime_ns for r in kept if r["index"] in done} == done
    assert sorted(r["index"] for r in kept) == list(range(TASKS))
    assert output_files(src_out) == output_files(reference)


def test_the_number_of_write_tasks_is_a_checked_setting() -> None:
    # Default: at most shards_per_write_task shards a task, one task for a small source.
    assert [ShardingResource().write_tasks_for(n) for n in (0, 1, 64, 65, 1000)] == [1, 1, 1, 2, 16]
    assert ShardingResource(shards_per_write_task=4).write_tasks_for(9) == 3
    # Asked for: that many, but never more tasks than shards.
    assert ShardingResource(write_tasks=3).write_tasks_for(15) == 3
    assert ShardingResource(write_tasks=8).write_tasks_for(2) == 2
    with pytest.raises(ValueError, match="write_tasks=-1: give a number of tasks >= 1, or 0"):
        ShardingResource(write_tasks=-1)
    with pytest.raises(ValueError, match="shards_per_write_task=0: a write task holds at least one shard"):
        ShardingResource(shards_per_write_task=0)


def test_a_bad_number_of_tasks_in_the_launchpad_fails_the_run_naming_it(
    raw_root: Path, out_root: Path, instance: dg.DagsterInstance,
) -> None:
    from tests.support.dagster_runs import load_defs

    result = load_defs().resolve_job_def("source_build").execute_in_process(
        instance=instance, partition_key=SOURCE, raise_on_error=False,
        run_config={**QUIET, "resources": {"sharding": {"config": {"num_workers": 1, "write_tasks": -2}}}})
    assert not result.success
    refused = [e.event_specific_data.error.message for e in result.all_events
               if e.event_type == dg.DagsterEventType.RESOURCE_INIT_FAILURE]
    assert len(refused) == 1 and "write_tasks=-2: give a number of tasks >= 1, or 0" in refused[0], refused
    assert not result.get_step_success_events() and not (out_root / SOURCE).exists()
