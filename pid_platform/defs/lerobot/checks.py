"""Blocking checks of the LeRobot group.

``mp4_sidecar_is_valid`` on ``mp4_sidecar``: the sidecar validates against its dataset, so
nothing downstream (the publish) runs in the same run when it does not.
``published_sidecar_streams`` on ``published_mp4_sidecar``: the sidecar, read back from where it
was published, streams one batch, so a broken publish fails the run that made it.
"""

import warnings

import dagster as dg

from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.sidecar import validate_sidecar
from pid_platform.defs.checks.common import result
from pid_platform.defs.lerobot.partitions import lerobot_datasets_partitions
from pid_platform.defs.lerobot.resources import LeRobotResource
from pid_platform.defs.metadata import human_bytes, markdown_table

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

    @dg.asset_check(
        asset="published_mp4_sidecar",
        blocking=True,
        partitions_def=lerobot_datasets_partitions,
        description="The published sidecar is read back from its target (pointer followed, sha256 and size "
                    "checked) and one batch streams through it with the loader's StreamingLeRobotDataset "
                    "(fresh caches), every feature there with its shape and dtype.",
    )
    def published_sidecar_streams(context: dg.AssetCheckExecutionContext,
                                  lerobot: LeRobotResource) -> dg.AssetCheckResult:
        # Imported here: torch and the streaming reader stay out of the code location's load.
        from pid_platform.lerobot.stream_check import stream_published_batch

        dataset = context.partition_key
        try:
            target = lerobot.target(dataset)
            if target is None:
                return dg.AssetCheckResult(passed=True, metadata={
                    "published": False, "note": "publishing is off (publish_target is 'none'): nothing to stream"})
            revision, _ = lerobot.revision(dataset)
            streamed = stream_published_batch(target, repo_id=lerobot.repo_id(dataset),
                                              data_root=lerobot.data_root(dataset), revision=revision)
        except Exception as exc:  # any failure is what the check found: its text is the finding
            context.log.error(f"{dataset}: the published sidecar does not stream: {type(exc).__name__}: {exc}")
            return result([f"{type(exc).__name__}: {exc}"], published=True)
        shapes = markdown_table(("key", "batch"), sorted(streamed.shapes.items()))
        return result(
            streamed.problems, published=True, target=str(target), batch_size=streamed.batch_size,
            keys=dg.MetadataValue.json(sorted(streamed.shapes)), shapes=dg.MetadataValue.md(shapes),
            sidecar_bytes_fetched=streamed.sidecar_bytes, payload_bytes_fetched=streamed.payload_bytes,
            payload_fetched=human_bytes(streamed.payload_bytes), seconds=streamed.seconds,
        )
