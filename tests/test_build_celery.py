"""A source's build through Dagster's Celery executor, on real Celery workers.

Real parts: Redis (broker and results), PostgreSQL (the Dagster instance's storage, via
dagster-postgres), SeaweedFS (raw source and output, s3 -> s3), and Celery worker processes,
each in its own empty folder with its own ``HOME``, ``DAGSTER_HOME`` and ``PID_WORK_ROOT``, sharing
nothing but Postgres, Redis and the bucket. The run's orchestration (``dagster.execute_job``)
runs in the test process, as it would in a run worker.

The steps of an ``s3://`` output's build (``sample_set`` -> ``twin_tar_shards``: plan, write
tasks, collect -> ``key_indexes`` -> ``wdinfo_manifests``, and the checks between them) meet in the
bucket, not on a disk (``sharding/tasks/``), so two workers on one queue share the run's
steps, write tasks side by side: the run builds the single-process bytes. A worker killed with
``kill -9`` in the middle of a write task leaves the step unacknowledged; the broker delivers it
again to the other worker, which keeps the shards the killed one had sent, and the run ends with
the same bytes; a reader never sees a version that is not complete.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.definitions.reconstruct import ReconstructableRepository

from pid_platform.defs.partitions import SOURCES
from pid_platform.sharding.tasks.outcomes import SHARD_DONE_POINT
from tests.support.celery_workers import CeleryWorkers, celery_settings, celery_workers  # noqa: F401
from tests.support.dagster_runs import dagster_instance, load_defs, step_node
from tests.support.postgres import dagster_pg_home, postgres_server  # noqa: F401
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401
from tests.support.s3_objects import objects
from tests.support.seaweedfs import SeaweedS3, upload_tree

# A run of several worker-side steps, then its checks: past the default per-test timeout on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
REPO = Path(__file__).resolve().parents[1]
SOURCE = "photos"
SHARDING = {"num_workers": 1, "max_shard_size_mb": 0.25}
TASKS = {**SHARDING, "write_tasks": 3}  # the bytes do not depend on it
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
QUEUE = "pid-build"  # both workers consume it
WAIT_S = 600  # for a step of the run to get somewhere: a bound on a stuck run, not a speed target


def _setup_bucket(s3: SeaweedS3, template: Path) -> str:
    bucket = s3.make_bucket(f"celery-{uuid.uuid4().hex[:10]}")
    upload_tree(s3.client(), template, bucket, "drops")
    return bucket


def _published(s3: SeaweedS3, bucket: str, prefix: str) -> dict[str, Any]:
    """Every object under ``prefix``: bytes, but the pointer as JSON without ``built_by`` (which
    process switched it) and without the claims folder (which holders were active)."""
    found: dict[str, Any] = {}
    for key, body in objects(s3.client(), bucket, prefix).items():
        if key.startswith(".pid-claims/"):
            continue
        if key == "pid-current.json":
            doc = json.loads(body)
            doc.pop("built_by", None)
            found[key] = doc
        else:
            found[key] = body
    return found


def _single_process_build(monkeypatch: pytest.MonkeyPatch, s3: SeaweedS3, bucket: str, tmp_path: Path) -> dict:
    """The reference: the same job, every step in the test process."""
    monkeypatch.setenv("PID_RAW_ROOT", f"s3://{bucket}/drops")
    monkeypatch.setenv("PID_OUTPUT_ROOT", f"s3://{bucket}/single")
    monkeypatch.setenv("PID_WORK_ROOT", str(tmp_path / "single-work"))
    with dagster_instance() as instance:
        instance.add_dynamic_partitions(SOURCES, [SOURCE])
        result = load_defs().resolve_job_def("source_build").execute_in_process(
            instance=instance, partition_key=SOURCE, raise_on_error=False,
            run_config={**QUIET, "execution": {"config": {"in_process": {}}},
                        "resources": {"sharding": {"config": SHARDING}}})
    assert result.success
    published = _published(s3, bucket, f"single/{SOURCE}")
    assert any(k.endswith(".tar") for k in published) and "pid-current.json" in published
    return published


def _worker_env(s3: SeaweedS3, bucket: str, **extra: str) -> dict[str, str]:
    return {**s3.env(), "PID_RAW_ROOT": f"s3://{bucket}/drops", "PID_OUTPUT_ROOT": f"s3://{bucket}/celery",
            **extra}


def _celery_run_config(redis: RedisServer, queue: str, **settings: Any) -> dict:
    return {**QUIET, "execution": {"config": {"celery": celery_settings(redis, queue, **settings)}},
            "resources": {"sharding": {"config": TASKS}}}


def _source_build_job() -> Any:
    # Loaded by module name, as the workers load it from the task they are sent.
    repo = ReconstructableRepository.for_module("pid_platform.definitions", "defs", working_directory=str(REPO))
    return repo.get_reconstructable_job("source_build")


def _execute(home: Path, run_config: dict) -> tuple[bool, str]:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        if SOURCE not in instance.get_dynamic_partitions(SOURCES):
            instance.add_dynamic_partitions(SOURCES, [SOURCE])
        with dg.execute_job(_source_build_job(), instance, run_config=run_config,
                            tags={"dagster/partition": SOURCE}) as result:
            return result.success, result.run_id


def _step_workers(home: Path, run_id: str) -> dict[str, list[str]]:
    """Step -> the Celery workers that executed it, from the run's engine events."""
    seen: dict[str, list[str]] = {}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for record in instance.all_logs(run_id):
            event = record.dagster_event
            if event is None or not event.is_engine_event or not record.step_key:
                continue
            entries = event.engine_event_data.metadata if event.engine_event_data else {}
            worker = entries.get("Celery worker")
            if worker is not None:
                seen.setdefault(record.step_key, []).append(str(worker.value).split("@")[0])
    return seen


def _use_worker_roots(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    # The orchestrating process loads the same code location as the workers.
    for name in ("PID_RAW_ROOT", "PID_OUTPUT_ROOT"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.setenv("PID_WORK_ROOT", "/nonexistent/the-orchestrator-builds-nothing")


def test_two_celery_workers_sharing_only_the_servers_build_the_single_process_bytes(
    s3_env: SeaweedS3, photo_drop_template: Path, redis_server: RedisServer,  # noqa: F811
    celery_workers: CeleryWorkers, dagster_pg_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    bucket = _setup_bucket(s3_env, photo_drop_template)
    reference = _single_process_build(monkeypatch, s3_env, bucket, tmp_path)
    env = _worker_env(s3_env, bucket)
    # Each worker holds its first write task once a shard is sent, until both are inside one: a
    # worker runs one step at a time, so the second task must go to the other worker.
    pauses = {name: tmp_path / f"pause-{name}" for name in ("a", "b")}
    workers = {}
    for name, folder in pauses.items():
        folder.mkdir()
        workers[name] = celery_workers.start(
            name, [QUEUE], {**env, "PID_PAUSE_AT": SHARD_DONE_POINT, "PID_PAUSE_DIR": str(folder)})
    _use_worker_roots(monkeypatch, env)

    outcome: dict[str, Any] = {}

    def orchestrate() -> None:
        try:
            outcome["ok"], outcome["run_id"] = _execute(dagster_pg_home, _celery_run_config(redis_server, QUEUE))
        except BaseException as e:  # reported by the assertions below
            outcome["error"] = repr(e)

    run = threading.Thread(target=orchestrate, daemon=True)
    run.start()
    stem = SHARD_DONE_POINT.replace(":", "-")
    # Generous: on a loaded 2-core machine the steps before the write tasks (intake, plan, each a
    # process start on a worker) took over 300 s once; a bound, not a speed target.
    started, deadline = time.monotonic(), time.monotonic() + WAIT_S
    while not all((f / f"{stem}.reached").exists() for f in pauses.values()):
        assert run.is_alive() and time.monotonic() < deadline, (
            f"both workers never wrote at once ({time.monotonic() - started:.0f} s; reached: "
            f"{sorted(n for n, f in pauses.items() if (f / f'{stem}.reached').exists())}): {outcome}")
        time.sleep(0.1)
    for folder in pauses.values():
        (folder / f"{stem}.go").write_text("")
    run.join(timeout=WAIT_S)
    assert not run.is_alive() and outcome.get("ok"), outcome
    steps = _step_workers(dagster_pg_home, outcome["run_id"])
    assert {"sample_set", "twin_tar_shards", "key_indexes", "wdinfo_manifests"} <= {step_node(s) for s in steps}
    writers = {w for key, ws in steps.items() if "write_task" in key for w in ws}
    assert len([k for k in steps if "write_task" in k]) == 3
    # So some write task ran where the plan did not, from the bucket alone.
    assert writers == {"a", "b"}, steps
    assert _published(s3_env, bucket, f"celery/{SOURCE}") == reference  # byte for byte
    for worker in workers.values():  # no tar left on either worker's disk: they went to the bucket
        assert not any(worker.work_root.rglob("*.tar"))


def _poll_reader(s3: SeaweedS3, bucket: str, prefix: str, stop: threading.Event, seen: list[str]) -> None:
    """A reader following the pointer while the build runs: it records what it could read."""
    from loader.wds.pipeline import build_dataset

    while not stop.is_set():
        client = s3.client()
        try:
            doc = json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/pid-current.json")["Body"].read())
        except client.exceptions.NoSuchKey:
            seen.append("none")
        else:
            # The whole version the pointer names must be there: every sample of every tar.
            n = sum(1 for _ in build_dataset(f"s3://{bucket}/{prefix}", decode=None, shuffle=False))
            seen.append(f"{doc['version']}:{n}")
        time.sleep(0.2)


def test_kill_9_of_a_worker_mid_write_task_ends_with_the_same_bytes(
    s3_env: SeaweedS3, photo_drop_template: Path, redis_server: RedisServer,  # noqa: F811
    celery_workers: CeleryWorkers, dagster_pg_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    bucket = _setup_bucket(s3_env, photo_drop_template)
    reference = _single_process_build(monkeypatch, s3_env, bucket, tmp_path)
    samples = sum(json.loads(v)["total_key_count"] for k, v in reference.items() if k.endswith("wdinfo.json"))
    pause_dir = tmp_path / "pause"
    pause_dir.mkdir()
    env = _worker_env(s3_env, bucket)
    # Redelivery of a step whose worker vanished: after the broker's visibility timeout, which
    # must exceed the longest step (a step still running past it would be delivered twice).
    config = _celery_run_config(redis_server, QUEUE, visibility_timeout_s=30)
    worker_settings = config["execution"]["config"]["celery"]
    # Worker a runs the steps alone until it stops in a write task once one shard is in the bucket;
    # only then does b start. With both consuming from the start, which worker takes each write
    # task is a race: b took all three in one CI run (a, never writing, never paused).
    a = celery_workers.start("a", [QUEUE], {**env, "PID_PAUSE_AT": SHARD_DONE_POINT, "PID_PAUSE_DIR": str(pause_dir)},
                             worker_settings)
    _use_worker_roots(monkeypatch, env)

    stop, seen = threading.Event(), []
    reader = threading.Thread(target=_poll_reader, args=(s3_env, bucket, f"celery/{SOURCE}", stop, seen), daemon=True)
    outcome: dict[str, Any] = {}

    def orchestrate() -> None:
        try:
            outcome["ok"], outcome["run_id"] = _execute(dagster_pg_home, config)
        except BaseException as e:  # reported by the assertions below
            outcome["error"] = repr(e)

    run = threading.Thread(target=orchestrate, daemon=True)
    reader.start()
    run.start()
    reached = pause_dir / f"{SHARD_DONE_POINT.replace(':', '-')}.reached"
    deadline = time.monotonic() + WAIT_S
    while not reached.exists():
        assert run.is_alive() and time.monotonic() < deadline, f"never reached {SHARD_DONE_POINT}: {outcome}"
        time.sleep(0.1)
    celery_workers.start("b", [QUEUE], env, worker_settings)
    a.kill()  # kill -9 of the worker, its pool process with it, one shard of its write task sent

    # The broker delivers the unacknowledged step again, to b, which keeps what a had sent.
    run.join(timeout=WAIT_S)
    stop.set()
    reader.join(timeout=30)
    assert not run.is_alive() and outcome["ok"], outcome
    assert _published(s3_env, bucket, f"celery/{SOURCE}") == reference
    steps = _step_workers(dagster_pg_home, outcome["run_id"])
    assert ["a", "b"] in [ws for key, ws in steps.items() if "write_task" in key]  # a's task, then b's
    # The reader saw no version until the switch, then only the complete one.
    assert seen and set(seen) <= {"none", f"{reference['pid-current.json']['version']}:{samples}"}
    assert seen[-1] != "none"
