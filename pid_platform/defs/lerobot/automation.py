"""The LeRobot job, and the sensor that finds datasets under ``PID_LEROBOT_ROOT``."""

import hashlib
import json

import dagster as dg

from loader.io import roots as fs
from pid_platform.defs.lerobot.assets import SIDECAR_CODE_VERSION
from pid_platform.defs.lerobot.partitions import LEROBOT_DATASETS, lerobot_datasets_partitions
from pid_platform.defs.lerobot.pools import apply_pool_limits
from pid_platform.defs.lerobot.resources import LeRobotResource

LEROBOT_ASSETS = ("mp4_sidecar", "published_mp4_sidecar")

# Checks of the selected assets come along: the blocking one gates the publish.
lerobot_sidecar_job = dg.define_asset_job(
    "lerobot_sidecar_build",
    selection=dg.AssetSelection.assets(*LEROBOT_ASSETS),
    description="Build one LeRobot dataset's MP4 sidecar, check it, publish it (one partition).",
)


def dataset_fingerprint(lerobot: LeRobotResource, dataset: str) -> str:
    """Changes when the dataset's metadata files or its pinned revision do (a listing and a few
    stats, no reads). A video rewritten in place with unchanged metadata is caught by the check
    and by training's own validation, not here: listing every video each minute costs too much."""
    root = lerobot.data_root(dataset)
    h = hashlib.sha256(str(lerobot.revision(dataset)[0]).encode())
    rels = ["meta/info.json", "meta/tasks.parquet"]
    for chunk in fs.list_dir(root, "meta/episodes"):
        rels += [f"meta/episodes/{chunk}/{name}" for name in fs.list_dir(root, f"meta/episodes/{chunk}")]
    for rel, ident in sorted(fs.file_identities(root, [r for r in rels if fs.exists(root, r)]).items()):
        h.update(f"\0{rel}\0{ident.size}\0{ident.fingerprint}".encode())
    return h.hexdigest()[:16]


# On by default: it reads metadata listings only; a build replaces the sidecar atomically, and
# nothing is published unless PID_LEROBOT_PUBLISH says where (publishes go one at a time).
@dg.sensor(job=lerobot_sidecar_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING)
def lerobot_datasets_sensor(context: dg.SensorEvaluationContext, lerobot: LeRobotResource) -> dg.SensorResult:
    """Lists the LeRobot v3 datasets under ``PID_LEROBOT_ROOT`` (each folder with ``meta/info.json``),
    adds each new one as a partition of ``lerobot_datasets``, and requests a sidecar build for every
    dataset that is new or whose metadata or revision changed. Also gives the ``lerobot_publish``
    pool its limit of 1 where none is set. The cursor holds each dataset's last run key."""
    limits = apply_pool_limits(context.instance)
    seen: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
    known = set(context.instance.get_dynamic_partitions(LEROBOT_DATASETS))
    new: list[str] = []
    requests: list[dg.RunRequest] = []
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
        # A reused run_key is dropped forever: it changes with the inputs and the sidecar schema.
        run_key = f"{dataset}:{SIDECAR_CODE_VERSION}:{fingerprint}"
        if seen.get(dataset) != run_key:
            seen[dataset] = run_key
            requests.append(dg.RunRequest(run_key=run_key, partition_key=dataset, tags={"pid/lerobot_dataset": dataset}))
    if limits:
        context.log.debug(f"pool limits: {limits}")
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[lerobot_datasets_partitions.build_add_request(new)] if new else [],
        cursor=json.dumps(seen, sort_keys=True),
    )
