"""``s3_version_cleanup``: the only thing that deletes published versions of an S3 output.

A build on S3 publishes a new version beside the old ones and moves the pointer; readers that
resolved the old pointer may still be streaming the old version (a training epoch can take
hours), so nothing is deleted at the commit. This job removes versions retired longer than the
grace period ago, and abandoned uploads (a build killed before its pointer switch) older than it.
The version a source's pointer names when its deletion starts is never touched, nor one a
build has claimed (``pid_platform/sharding/commit/claims.py``): a build republishing a retired version
while this job runs keeps it. A local output needs no cleanup: its commit swaps folders and
deletes the replaced one.
"""

import dagster as dg
from pydantic import Field

from pid_platform.defs.resources import SourceStoreResource
from pid_platform.defs.retries import fail_without_retry_on
from pid_platform.sharding.commit.s3_output import (
    DEFAULT_GRACE_S,
    cleanup_versions,
    published_sources,
)


class CleanupConfig(dg.Config):
    grace_hours: float = Field(default=DEFAULT_GRACE_S / 3600, ge=0,
                               description="Keep a retired version at least this long after the pointer left it.")


@dg.op
def remove_retired_versions(context: dg.OpExecutionContext, config: CleanupConfig,
                            source_store: SourceStoreResource) -> dict[str, list[str]]:
    """Deletes every source's versions retired longer than `grace_hours` ago; returns them."""
    root = source_store.root_target()
    if root is None:
        context.log.info(f"output root {source_store.output_root} is local: nothing to clean up")
        return {}
    removed: dict[str, list[str]] = {}
    with fail_without_retry_on():
        for source in published_sources(root):
            report = cleanup_versions(root.child(source), grace_s=config.grace_hours * 3600)
            removed[source] = report.removed
            context.log.info(f"{source}: current {report.current}; removed {report.removed or 'none'} "
                             f"({report.objects_deleted} objects); kept within the grace period {report.kept or 'none'}; "
                             f"kept as claimed by a build {report.claimed or 'none'}; expired claims deleted "
                             f"{report.claims_expired}")
    return removed


@dg.job(description="Delete versions of S3 outputs retired longer than the grace period ago (never the current one, "
                    "nor one a build is publishing).")
def s3_version_cleanup() -> None:
    remove_retired_versions()
