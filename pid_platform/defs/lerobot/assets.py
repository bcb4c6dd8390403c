"""``mp4_sidecar`` (build one dataset's MP4 sidecar) and ``published_mp4_sidecar`` (publish it).

Publishing is its own asset so a failed or refused publish never costs a rebuild, it retries on
its own, and its pool keeps publishes one at a time; the blocking ``mp4_sidecar_is_valid`` check
runs between the two, so only a sidecar that validates against its dataset goes out.
"""

import tempfile

import dagster as dg

from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.sidecar import (
    SIDECAR_SCHEMA_VERSION,
    build_sidecar,
    compact_report,
    read_sidecar,
    sidecar_digest,
    validate_sidecar,
)
from loader.lerobot.sidecar.publish_layout import POINTER_VERSION, PublishRefused
from pid_platform.defs.lerobot.datasets import LEROBOT_DATASET_ASSET, dataset_fingerprint
from pid_platform.defs.lerobot.partitions import LEROBOT_GROUP, lerobot_datasets_partitions
from pid_platform.defs.lerobot.pools import PUBLISH_POOL
from pid_platform.defs.lerobot.resources import LeRobotResource
from pid_platform.defs.metadata import human_bytes, row_count, table
from pid_platform.defs.plots import bar_png, grouped_bars_png, png_markdown
from pid_platform.defs.retries import IO_RETRY, fail_without_retry_on
from pid_platform.defs.step_errors import step_failure
from pid_platform.lerobot.publish import publish_sidecar

# The sidecar's bytes depend on the schema: a new schema version marks every sidecar stale.
SIDECAR_CODE_VERSION = f"mp4-sidecar-v{SIDECAR_SCHEMA_VERSION}"
PUBLISH_CODE_VERSION = f"{SIDECAR_CODE_VERSION}-pointer-v{POINTER_VERSION}"


FILE_COLUMNS = (("file", "string"), ("codec", "string"), ("width", "int"), ("height", "int"), ("samples", "int"),
                ("bytes", "int"), ("size", "string"), ("edit_list", "bool"))


def _files_table(manifest: dict) -> dg.TableMetadataValue:
    rows = [(f["path"], f["codec"], f["width"], f["height"], f["sample_count"], f["size"], human_bytes(f["size"]),
             f["edit"] is not None)
            for f in manifest["files"]]
    return table(FILE_COLUMNS, rows)


def episode_stats(meta: LeRobotMeta, sidecar) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(frames per episode, camera -> bytes per episode): an episode's bytes in a camera are the
    sizes of the samples its time span covers in that camera's MP4, as the sidecar indexes them."""
    lengths: dict[str, int] = {}
    per_camera: dict[str, dict[str, int]] = {key: {} for key in meta.video_keys}
    arrays: dict[str, dict] = {}
    for index in meta.episode_indices.tolist():
        episode = meta.episode(int(index))
        lengths[str(index)] = episode.length
        for key, span in episode.videos.items():
            rel = meta.video_rel(key, span.chunk, span.file)
            if rel not in arrays:
                arrays[rel] = sidecar.arrays(rel)
            pts, sizes = arrays[rel]["sample_pts"], arrays[rel]["sample_sizes"]
            # Half a frame of slack: frame times are multiples of 1/fps, stored as floats.
            eps = 0.5 / meta.fps
            inside = (pts >= span.from_timestamp - eps) & (pts < span.to_timestamp - eps)
            per_camera[key][str(index)] = int(sizes[inside].sum())
    return lengths, per_camera


def _episode_plots(dataset: str, lengths: dict[str, int], per_camera: dict[str, dict[str, int]]) -> dict:
    kib = {camera.removeprefix("observation.images."): {e: b / 1024 for e, b in values.items()}
           for camera, values in per_camera.items()}
    return {
        "episode_lengths_plot": png_markdown(
            bar_png(lengths, title=f"{dataset}: frames per episode", ylabel="frames"),
            f"episode lengths of {dataset}"),
        "episode_bytes_plot": png_markdown(
            grouped_bars_png(kib, title=f"{dataset}: video bytes per episode, per camera", ylabel="KiB"),
            f"video bytes per episode per camera of {dataset}"),
    }


@dg.asset(
    partitions_def=lerobot_datasets_partitions,
    deps=[LEROBOT_DATASET_ASSET],
    group_name=LEROBOT_GROUP,
    kinds={"python", "numpy"},
    code_version=SIDECAR_CODE_VERSION,
    retry_policy=IO_RETRY,
)
def mp4_sidecar(context: dg.AssetExecutionContext, lerobot: LeRobotResource) -> dg.MaterializeResult:
    """The MP4 sidecar of one LeRobot v3 dataset: `<output_root>/lerobot/<dataset>/mp4-sidecar.npz`,
    an NPZ (schema v3) of every video file's sample times, sizes, byte offsets and sync samples,
    read from the MP4 boxes alone (no decoding), built by the loader's own `build_sidecar`.

    A sidecar that still validates against the dataset (same files, same fingerprints, same
    revision) is kept as is; otherwise it is rebuilt and replaced atomically, so a failed build
    leaves the previous file in place.
    """
    dataset = context.partition_key
    data_root = lerobot.data_root(dataset)
    out = lerobot.sidecar_path(dataset)
    repo_id = lerobot.repo_id(dataset)
    revision, how = lerobot.revision(dataset)
    # What this build is made from, taken before it reads anything: lerobot_datasets_sensor
    # requests no build while the dataset's fingerprint is still this one.
    fingerprint = dataset_fingerprint(lerobot, dataset)
    with fail_without_retry_on():  # a malformed dataset stays malformed
        meta = LeRobotMeta.load(data_root)
    rebuilt = not out.exists() or bool(validate_sidecar(out, meta, repo_id=repo_id, revision=revision,
                                                        require_complete=True))
    read: list[int] = []
    if rebuilt:
        def progress(done: int, total: int, rel: str, bytes_read: int | None = None) -> None:
            # bytes_read: only if build_sidecar reports it (Mp4Index.bytes_read of that file).
            if bytes_read is not None:
                read.append(bytes_read)
            if done == total or done % max(1, total // 10) == 0:
                context.log.info(f"{dataset}: {done}/{total} MP4 files indexed")

        build_sidecar(meta, out, repo_id=repo_id, revision=revision, data_root=data_root,
                      workers=lerobot.workers, progress=progress)
    else:
        context.log.info(f"{dataset}: the sidecar at {out} still matches the dataset; kept")
    with read_sidecar(out) as sc:
        manifest = sc.manifest
        lengths, per_camera = episode_stats(meta, sc)
    with tempfile.TemporaryDirectory(prefix="pid-compact-") as cache:
        # The compact index training derives on first open: its size against the int64 arrays.
        report = compact_report(out, cache_root=cache)
    video_bytes = sum(f["size"] for f in manifest["files"])
    # Everything outside the mdat boxes (ftyp, moov, box headers): what an index from boxes reads.
    header_bytes = video_bytes - sum(size for f in manifest["files"] for _, size in f["mdat"])
    measured = {"index_bytes_read": sum(read)} if len(read) == len(manifest["files"]) and read else {}
    files = _files_table(manifest)
    return dg.MaterializeResult(
        metadata={
            "files": len(manifest["files"]),
            "samples": report.samples,
            "video_bytes": video_bytes,
            "header_bytes": header_bytes,
            "header_fraction": round(header_bytes / video_bytes, 6) if video_bytes else 0.0,
            **measured,
            "sidecar_bytes": report.npz_bytes,
            "sidecar_size": human_bytes(report.npz_bytes),
            "video_size": human_bytes(video_bytes),
            "int64_array_bytes": report.int64_bytes,
            "compact_index_bytes": report.compact_bytes,
            "compact_ratio": round(report.ratio, 4),
            "rebuilt": rebuilt,
            "repo_id": repo_id,
            "revision": revision or "(unpinned)",
            "revision_source": how,
            "data_root": manifest["data_root"],
            "schema_version": manifest["schema_version"],
            "sidecar_code_version": SIDECAR_CODE_VERSION,
            "input_fingerprint": fingerprint,
            # One row per MP4: the table, and its row count where the UI shows it.
            "video_files": files,
            **row_count(len(manifest["files"])),
            **_episode_plots(dataset, lengths, per_camera),
            "sidecar": dg.MetadataValue.path(str(out)),
        },
        # Its bytes name it: an unchanged rebuild leaves the publish fresh.
        data_version=dg.DataVersion(sidecar_digest(out)[:16]),
    )


@dg.asset(
    partitions_def=lerobot_datasets_partitions,
    deps=[mp4_sidecar],
    group_name=LEROBOT_GROUP,
    kinds={"python"},
    code_version=PUBLISH_CODE_VERSION,
    pool=PUBLISH_POOL,
    # With publishing off nothing is materialized (an observation says so): the asset must not
    # read as published when nothing was.
    output_required=False,
    # A push can lose a race with another publisher or meet a flaky network: both heal on a
    # later try. Refusals (a subset, an unpinned revision) fail at once (Failure without retries).
    retry_policy=dg.RetryPolicy(max_retries=3, delay=15, backoff=dg.Backoff.EXPONENTIAL),
)
def published_mp4_sidecar(context: dg.AssetExecutionContext, lerobot: LeRobotResource):
    """The dataset's sidecar, published where training looks for it: the `lerobot-sidecars`
    branch of its git or Hub repository (created from the pinned source commit; the source branch
    is never touched) or `meta/mp4-sidecars/` under its bucket root, as `publish_target` says.
    With `publish_target` `none` nothing is published: the asset is not materialized (it stays
    unpublished in the UI) and an observation (`published: false`) says why; its stream check
    does not run.
    """
    dataset = context.partition_key
    sidecar = lerobot.sidecar_path(dataset)
    try:
        target = lerobot.target(dataset)
    except PublishRefused as exc:
        raise step_failure(str(exc), exc) from exc
    if target is None:
        note = ("publishing is off (publish_target is 'none'; set PID_LEROBOT_PUBLISH to git:<url>, "
                "s3://bucket/prefix or hub to publish)")
        context.log.info(f"{dataset}: not published: {note}")
        context.log_event(dg.AssetObservation(asset_key=context.asset_key, partition=dataset, metadata={
            "published": False, "note": note, "sidecar": dg.MetadataValue.path(str(sidecar))}))
        return
    try:
        result = publish_sidecar(sidecar, target)
    except PublishRefused as exc:
        raise step_failure(str(exc), exc) from exc
    context.log.info(f"{dataset}: {'already published' if result.unchanged else 'published'} to {result.target}")
    metadata: dict[str, object] = {
        "published": True,
        "unchanged": result.unchanged,
        "target": result.target,
        "sidecar_url": result.sidecar_url,
        "pointer_url": result.pointer_url,
        "sha256": result.sha256,
        "bytes": result.size,
        "size": human_bytes(result.size),
    }
    if result.commit:
        metadata["commit"] = result.commit
    if result.parent:
        metadata["parent"] = result.parent
    yield dg.MaterializeResult(metadata=metadata)
