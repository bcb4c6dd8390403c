"""Blocking check on ``mp4_sidecar``: the sidecar validates against its dataset, so nothing
downstream (the publish) runs in the same run when it does not."""

import warnings

import dagster as dg

from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.sidecar import validate_sidecar
from pid_platform.defs.checks.common import result
from pid_platform.defs.lerobot.partitions import lerobot_datasets_partitions
from pid_platform.defs.lerobot.resources import LeRobotResource

# Partitioned checks are marked preview in 1.13; without the partition, one dataset's failure
# would be shown as the whole asset's latest state.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", dg.PreviewWarning)

    @dg.asset_check(
        asset="mp4_sidecar",
        blocking=True,
        partitions_def=lerobot_datasets_partitions,
        description="The sidecar is a complete schema-v3 sidecar of this dataset at this revision: every "
                    "video file indexed, no extra files, and every file's size and fingerprint unchanged.",
    )
    def mp4_sidecar_is_valid(context: dg.AssetCheckExecutionContext, lerobot: LeRobotResource) -> dg.AssetCheckResult:
        dataset = context.partition_key
        revision, _ = lerobot.revision(dataset)
        meta = LeRobotMeta.load(lerobot.data_root(dataset))
        problems = validate_sidecar(lerobot.sidecar_path(dataset), meta, repo_id=lerobot.repo_id(dataset),
                                    revision=revision, require_complete=True)
        return result(problems, video_files=len(meta.video_files()))
