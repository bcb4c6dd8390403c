"""A source's build through Dagster's Celery executor, on real Celery workers.

Real parts: Redis (broker and results), PostgreSQL (the Dagster instance's storage, via
dagster-postgres), SeaweedFS (raw source and output, s3 -> s3), and Celery worker processes,
each in its own empty folder with its own ``HOME``, ``DAGSTER_HOME`` and ``PID_WORK_ROOT``, sharing
nothing but Postgres, Redis and the bucket. The run's orchestration (``dagster.execute_job``)
runs in the test process, as it would in a run worker.

Today's build steps (``sample_set`` -> ``twin_tar_shards`` -> ``key_indexes`` ->
``wdinfo_manifests``) stage an ``s3://`` output in the *local* work folder of the machine that runs
them and publish it at the last step; a step on another machine would not see that staging. So a
run's steps are routed to one worker's queue (``task_default_queue`` in the executor's settings,
i.e. run configuration). Any worker builds the same bytes; a worker killed with ``kill -9`` in the
middle of the publish leaves the step to Celery, which delivers it again, and the run ends with the
same bytes; a reader never sees a version that is not complete.
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
from tests.support.celery_workers import CeleryWorkers, celery_settings, celery_workers  # noqa: F401
from tests.support.dagster_runs import dagster_instance, load_defs, step_node
from tests.support.postgres import dagster_pg_home, postgres_server  # noqa: F401
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401
from tests.support.s3_objects import objects
from tests.support.seaweedfs import SeaweedS3, upload_tree

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
SOURCE = "photos"
SHARDING = {"num_workers": 1, "max_shard_size_mb": 0.25}
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
PAUSE = "publish:before-switch"  # every object of the version is up and checked; the pointer not moved yet


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
            "resources": {"sharding": {"config": SHARDING}}}


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


def test_celery_workers_build_the_single_process_bytes(
    s3_env: SeaweedS3, photo_drop_template: Path, redis_server: RedisServer,  # noqa: F811
    celery_workers: CeleryWorkers, dagster_pg_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    bucket = _setup_bucket(s3_env, photo_drop_template)
    reference = _single_process_build(monkeypatch, s3_env, bucket, tmp_path)
    env = _worker_env(s3_env, bucket)
    a = celery_workers.start("a", ["pid-a"], env)
    b = celery_workers.start("b", ["pid-b"], env)
    _use_worker_roots(monkeypatch, env)

    ok, run_a = _execute(dagster_pg_home, _celery_run_config(redis_server, "pid-a"))
    assert ok
    steps = _step_workers(dagster_pg_home, run_a)
    assert {"sample_set", "twin_tar_shards", "key_indexes", "wdinfo_manifests"} <= {step_node(s) for s in steps}
    assert {w for ws in steps.values() for w in ws} == {"a"}  # every step ran on worker a
    assert _published(s3_env, bucket, f"celery/{SOURCE}") == reference  # byte for byte
    assert any(a.work_root.rglob("*.tar")) and not any(b.work_root.iterdir())

    # The other worker, with nothing local, builds the same version: the pointer stays.
    ok, run_b = _execute(dagster_pg_home, _celery_run_config(redis_server, "pid-b"))
    assert ok
    assert {w for ws in _step_workers(dagster_pg_home, run_b).values() for w in ws} == {"b"}
    assert _published(s3_env, bucket, f"celery/{SOURCE}") == reference


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


def test_kill_9_of_the_worker_mid_publish_ends_with_the_same_bytes(
    s3_env: SeaweedS3, photo_drop_template: Path, redis_server: RedisServer,  # noqa: F811
    celery_workers: CeleryWorkers, dagster_pg_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    bucket = _setup_bucket(s3_env, photo_drop_template)
    reference = _single_process_build(monkeypatch, s3_env, bucket, tmp_path)
    samples = sum(json.loads(v)["total_key_count"] for k, v in reference.items() if k.endswith("wdinfo.json"))
    pause_dir = tmp_path / "pause"
    pause_dir.mkdir()
    # The killed worker leaves its build lease on the output (commit/lease.py), which blocks the
    # step's redelivery until it expires: a TTL shorter than the visibility timeout, as deployed
    # (600 s against 3600 s in deploy/celery/executor.yaml).
    env = _worker_env(s3_env, bucket, PID_LEASE_TTL_S="10", PID_LEASE_RENEW_S="2")
    # Redelivery of a step whose worker vanished: after the broker's visibility timeout, which
    # must exceed the longest step (a step still running past it would be delivered twice).
    config = _celery_run_config(redis_server, "pid-a", visibility_timeout_s=30)
    worker_settings = config["execution"]["config"]["celery"]
    a = celery_workers.start("a", ["pid-a"], {**env, "PID_PAUSE_AT": PAUSE, "PID_PAUSE_DIR": str(pause_dir)},
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
    reached = pause_dir / f"{PAUSE.replace(':', '-')}.reached"
    deadline = time.monotonic() + 300
    while not reached.exists():
        assert run.is_alive() and time.monotonic() < deadline, f"never reached {PAUSE}: {outcome}"
        time.sleep(0.1)
    a.kill()  # kill -9 of the worker, its pool process with it, in the middle of the publish step

    # The same machine's worker comes back (its disk, its staging) without the pause; the broker
    # delivers the unacknowledged step again and the run goes on.
    a2 = celery_workers.start("a", ["pid-a"], {**env, "PID_WORK_ROOT": str(a.work_root)}, worker_settings)
    run.join(timeout=300)
    stop.set()
    reader.join(timeout=30)
    assert not run.is_alive() and outcome["ok"], outcome
    assert _published(s3_env, bucket, f"celery/{SOURCE}") == reference
    steps = _step_workers(dagster_pg_home, outcome["run_id"])
    assert steps["wdinfo_manifests"] == ["a", "a"]  # delivered twice: the killed worker, then its successor
    assert a2.process.poll() is None
    # The reader saw no version until the switch, then only the complete one.
    assert seen and set(seen) <= {"none", f"{reference['pid-current.json']['version']}:{samples}"}
    assert seen[-1] != "none"
