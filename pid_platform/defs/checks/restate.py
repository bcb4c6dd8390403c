"""A verified no-op build clears a source's red state (issue 34 part 3).

Dagster shows a partition as failed while the latest attempt to materialize it was a run that
failed, until the partition is materialized again; an observation, which is what a no-op build
records, does not clear it. So once the cause is fixed and a build finds the source up to date,
each of its assets whose latest attempt failed is reported materialized again: the committed
materialization restated (same data version, code version and input versions, same metadata),
so nothing downstream turns stale, and a source that never failed gets no new event at all.

The restatement is reported on the instance directly (as the UI's "Report materialization event"
does), not through the step's event stream: it is stored before the checks are re-asserted, so
their results belong to it and the asset page shows them on its latest materialization.
"""

from __future__ import annotations

import dagster as dg

from pid_platform.defs.automation.jobs import SOURCE_ASSETS
from pid_platform.defs.latest import latest_materialization


def _failed_since(instance: dg.DagsterInstance, key: dg.AssetKey, source: str, after_storage_id: int,
                  this_run: str) -> list[str]:
    """The runs other than ``this_run`` that planned ``key``'s ``source`` after ``after_storage_id`` and failed."""
    planned = instance.fetch_planned_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[source], after_storage_id=after_storage_id),
        limit=100).records
    run_ids = sorted({r.run_id for r in planned if r.run_id != this_run})
    if not run_ids:
        return []
    runs = instance.get_runs(filters=dg.RunsFilter(run_ids=run_ids))
    return sorted(r.run_id for r in runs if r.status == dg.DagsterRunStatus.FAILURE)


def restate_failed_assets(context: dg.AssetExecutionContext, source: str) -> list[str]:
    """Report ``source``'s committed materialization again for each of its assets whose latest
    attempt failed; the assets restated."""
    instance = context.instance
    restated = []
    for asset in SOURCE_ASSETS:
        key = dg.AssetKey(asset)
        committed = latest_materialization(instance, key, source)
        if committed is None:
            continue  # never built: nothing committed to restate
        failed = _failed_since(instance, key, source, committed.storage_id, context.run.run_id)
        if not failed:
            continue
        event = committed.asset_materialization
        instance.report_runless_asset_event(dg.AssetMaterialization(
            asset_key=key, partition=source, description=event.description,
            metadata={**event.metadata,
                      "restated": dg.MetadataValue.text(
                          f"the committed version of run {committed.run_id}, verified unchanged by run "
                          f"{context.run.run_id} after failed run(s) {', '.join(failed)}")},
            # Data, code and input versions as committed: nothing downstream turns stale.
            tags=event.tags,
        ))
        restated.append(asset)
    if restated:
        context.log.info(f"{source}: verified unchanged after a failed build; reported materialized again: "
                         + ", ".join(restated))
    return restated
