"""The LeRobot job, and the sensor that finds datasets under ``PID_LEROBOT_ROOT``."""

import json

import dagster as dg

from pid_platform.defs.automation.builds import (
    build_run_key,
    is_current,
    last_materialized_build,
    run_in_progress,
)
from pid_platform.defs.lerobot.assets import SIDECAR_CODE_VERSION
from pid_platform.defs.lerobot.datasets import dataset_fingerprint, dataset_observations
from pid_platform.defs.lerobot.partitions import LEROBOT_DATASETS, lerobot_datasets_partitions
from pid_platform.defs.lerobot.pools import apply_pool_limits
from pid_platform.defs.lerobot.resources import LeRobotResource

LEROBOT_ASSETS = ("mp4_sidecar", "published_mp4_sidecar")
_SIDECAR = dg.AssetKey("mp4_sidecar")
_SIDECAR_KEYS = {dg.AssetKey(a) for a in LEROBOT_ASSETS}

# Checks of the selected assets come along: the blocking one gates the publish.
lerobot_sidecar_job = dg.define_asset_job(
    "lerobot_sidecar_build",
    selection=dg.AssetSelection.assets(*LEROBOT_ASSETS),
    description="Build one LeRobot dataset's MP4 sidecar, check it, publish it (one partition).",
)


# On by default: it reads metadata listings only; a build replaces the sidecar atomically, and
# nothing is published unless PID_LEROBOT_PUBLISH says where (publishes go one at a time).
@dg.sensor(
    job=lerobot_sidecar_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING,
    description="Every 60 s: lists the LeRobot v3 datasets under PID_LEROBOT_ROOT, adds new ones as partitions, "
                "records a changed dataset's fingerprint on lerobot_dataset and requests a sidecar build for "
                "every new or changed dataset (published only where PID_LEROBOT_PUBLISH says).",
)
def lerobot_datasets_sensor(context: dg.SensorEvaluationContext, lerobot: LeRobotResource) -> dg.SensorResult:
    """Lists the LeRobot v3 datasets under ``PID_LEROBOT_ROOT`` (each folder with ``meta/info.json``),
    adds each new one as a partition of ``lerobot_datasets``, and requests a sidecar build for every
    dataset whose fingerprint (metadata and revision) or sidecar code version differs from those its
    last sidecar build recorded, recording a changed fingerprint as an observation of
    ``lerobot_dataset``. A dataset with a queued or running build is left for a later tick. Also
    gives the ``lerobot_publish`` pool its limit of 1 where none is set. The cursor holds each
    dataset's last run key."""
    limits = apply_pool_limits(context.instance)
    seen: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
    known = set(context.instance.get_dynamic_partitions(LEROBOT_DATASETS))
    new: list[str] = []
    requests: list[dg.RunRequest] = []
    observations: list[dg.AssetObservation] = []
    for dataset in lerobot.datasets():
        if "..." in dataset or any(ord(c) < 32 for c in dataset):  # Dagster refuses such keys
            context.log.warning(f"dataset folder {dataset!r} skipped: rename it (no '...', no control characters)")
            continue
        try:
            fingerprint = dataset_fingerprint(lerobot, dataset)
        except OSError as exc:
            context.log.warning(f"dataset {dataset!r} skipped: {exc}")
            continue
        if dataset not in known:
            new.append(dataset)
        # Also for a new dataset (recorded before its partition is added; Dagster takes it): a
        # first observation after the sidecar's build would show the sidecar stale.
        observations += dataset_observations(context.instance, lerobot, dataset, fingerprint)
        if dataset in known:
            running = run_in_progress(context.instance, dataset, lerobot_sidecar_job.name, _SIDECAR_KEYS)
            if running is not None:
                context.log.info(f"dataset {dataset!r}: run {running.run_id} is building it; checked again next tick")
                continue
        # As raw_sources_sensor does: compared with the last build, not with the last request,
        # so a sidecar built by hand or by pid-demo is not built again, and the run key moves on
        # after every build (a dataset set back to an earlier state, A -> B -> A, is rebuilt).
        built = (last_materialized_build(context.instance, _SIDECAR, dataset, "sidecar_code_version")
                 if dataset in known else None)
        if is_current(built, SIDECAR_CODE_VERSION, fingerprint):
            continue
        run_key = build_run_key(dataset, SIDECAR_CODE_VERSION, fingerprint, built)
        if seen.get(dataset) != run_key:
            seen[dataset] = run_key
            requests.append(dg.RunRequest(run_key=run_key, partition_key=dataset, tags={"pid/lerobot_dataset": dataset}))
    if limits:
        context.log.debug(f"pool limits: {limits}")
    return dg.SensorResult(
        run_requests=requests,
        asset_events=observations,
        dynamic_partitions_requests=[lerobot_datasets_partitions.build_add_request(new)] if new else [],
        cursor=json.dumps(seen, sort_keys=True),
    )
