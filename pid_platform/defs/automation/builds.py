"""What the discovery sensor and the daily schedule know of a source's builds, from the instance:
whether one is queued or running, and which settings and raw files its last committed build
was made from.

A committed build is a materialization of ``wdinfo_manifests`` (its commit step), or an
up-to-date ``sample_set`` observation (a rebuild that found the committed build already is what
it would publish). Both carry ``settings_version`` and ``input_fingerprint``; the event's storage
id only grows, so it is the part of a run key that moves forward: after a build commits, the
same settings and files as two builds ago (A -> B -> A) make a key never seen before.
"""

from __future__ import annotations

from dataclasses import dataclass

import dagster as dg

from pid_platform.defs.automation.jobs import SOURCE_ASSETS, source_build_job
from pid_platform.defs.latest import latest_materialization

COMMIT_ASSET = dg.AssetKey("wdinfo_manifests")
INTAKE_ASSET = dg.AssetKey("sample_set")
_SOURCE_KEYS = {dg.AssetKey(a) for a in SOURCE_ASSETS}
IN_PROGRESS = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


@dataclass(frozen=True)
class CommittedBuild:
    settings_version: str
    input_fingerprint: str
    event_id: int  # storage id of the event that recorded it
    run_id: str = ""  # the run that committed (or verified) it


def build_in_progress(instance: dg.DagsterInstance, source: str) -> dg.DagsterRun | None:
    """A queued or running run that builds any of ``source``'s assets (a ``source_build`` run, or
    assets materialized from the UI), if there is one."""
    return run_in_progress(instance, source, source_build_job.name, _SOURCE_KEYS)


def builds_source(run: dg.DagsterRun) -> bool:
    """``run`` builds a source: a ``source_build`` run (or its re-execution), or one that
    materializes any of a source's assets (Materialize, a backfill, automation)."""
    return run.job_name == source_build_job.name or bool(_SOURCE_KEYS & set(run.asset_selection or ()))


def run_in_progress(instance: dg.DagsterInstance, partition: str, job_name: str,
                    asset_keys: set[dg.AssetKey]) -> dg.DagsterRun | None:
    """A queued or running run of ``job_name``, or one materializing any of ``asset_keys``, for
    ``partition``, if there is one."""
    runs = instance.get_runs(dg.RunsFilter(statuses=IN_PROGRESS, tags={"dagster/partition": partition}))
    for run in runs:
        if run.job_name == job_name or asset_keys & set(run.asset_selection or ()):
            return run
    return None


def _recorded(record: dg.EventLogRecord | None, version_key: str = "settings_version") -> CommittedBuild | None:
    if record is None:
        return None
    event = record.asset_materialization or record.asset_observation
    metadata = event.metadata if event is not None else {}
    version, fingerprint = metadata.get(version_key), metadata.get("input_fingerprint")
    if version is None or fingerprint is None:
        return None
    return CommittedBuild(str(version.value), str(fingerprint.value), record.storage_id, record.event_log_entry.run_id)


def last_materialized_build(instance: dg.DagsterInstance, asset_key: dg.AssetKey, partition: str,
                            version_key: str) -> CommittedBuild | None:
    """What the newest materialization of ``asset_key`` for ``partition`` was made from: its
    ``version_key`` and ``input_fingerprint`` metadata (``None``: none recorded)."""
    return _recorded(latest_materialization(instance, asset_key, partition), version_key)


def last_committed_build(instance: dg.DagsterInstance, source: str) -> CommittedBuild | None:
    """What the newest committed build of ``source`` was made from (``None``: none recorded)."""
    found = [last_materialized_build(instance, COMMIT_ASSET, source, "settings_version")]
    # Observations of sample_set are up-to-date rebuilds: nothing staged, the committed build stands.
    checked = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=INTAKE_ASSET, asset_partitions=[source]), limit=1).records
    found.append(_recorded(checked[0] if checked else None))
    builds = [b for b in found if b is not None]
    return max(builds, key=lambda b: b.event_id) if builds else None


def is_current(committed: CommittedBuild | None, settings_version: str, fingerprint: str) -> bool:
    return committed is not None and (committed.settings_version, committed.input_fingerprint) == (
        settings_version, fingerprint)


def build_run_key(source: str, settings_version: str, fingerprint: str, committed: CommittedBuild | None) -> str:
    # The daemon drops a run request whose run_key it has seen before, forever: the key changes
    # when the input files or the settings do, and after every commit (its event id), so a
    # source set back to earlier settings or files is built again.
    return f"{source}:{settings_version}:{fingerprint}:after-{committed.event_id if committed else 0}"
