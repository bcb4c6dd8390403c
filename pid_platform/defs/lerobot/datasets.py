"""``lerobot_dataset``: each LeRobot v3 dataset as an observable source asset, upstream of its
sidecar. Its data version is the dataset's fingerprint (metadata files and pinned revision);
``lerobot_datasets_sensor`` records it when it changes, so the sidecar shows stale until rebuilt.
"""

from __future__ import annotations

import hashlib

import dagster as dg

from loader.io import roots as fs
from pid_platform.defs.lerobot.partitions import (
    LEROBOT_DATASETS,
    LEROBOT_GROUP,
    lerobot_datasets_partitions,
)
from pid_platform.defs.lerobot.resources import LeRobotResource
from pid_platform.defs.observations import latest_observed_version, versioned_observation
from pid_platform.defs.ownership import domain_tags

LEROBOT_DATASET_ASSET = "lerobot_dataset"


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


def dataset_observations(instance: dg.DagsterInstance, lerobot: LeRobotResource, dataset: str,
                         fingerprint: str) -> list[dg.AssetObservation]:
    """The observation of ``dataset``, or none when its fingerprint is the one recorded."""
    if latest_observed_version(instance, LEROBOT_DATASET_ASSET, dataset) == fingerprint:
        return []  # checked first: the revision below costs a few git commands
    return [versioned_observation(LEROBOT_DATASET_ASSET, dataset, fingerprint, data_root=lerobot.data_root(dataset),
                                  revision=lerobot.revision(dataset)[0] or "(unpinned)")]


@dg.observable_source_asset(
    name=LEROBOT_DATASET_ASSET,
    partitions_def=lerobot_datasets_partitions,
    group_name=LEROBOT_GROUP,
    tags=domain_tags(LEROBOT_GROUP),
    description=(
        "A LeRobot v3 dataset under PID_LEROBOT_ROOT (meta/info.json, episodes, videos). Its data version is "
        "a fingerprint of its metadata files and pinned git revision; lerobot_datasets_sensor records it "
        "when it changes, so the dataset's sidecar shows stale until it is rebuilt."
    ),
)
def lerobot_dataset(context: dg.AssetExecutionContext, lerobot: LeRobotResource) -> dg.DataVersionsByPartition:
    versions = {}
    for dataset in sorted(context.instance.get_dynamic_partitions(LEROBOT_DATASETS)):
        try:
            versions[dataset] = dataset_fingerprint(lerobot, dataset)
        except (OSError, ValueError) as exc:  # one unreadable dataset must not hide the others
            context.log.warning(f"dataset {dataset!r} not observed: {exc}")
    return dg.DataVersionsByPartition(versions)
