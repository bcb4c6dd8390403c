"""``sample_set``: the samples of one source, and a report of every file that was left out."""

import hashlib
from contextlib import nullcontext
from dataclasses import replace

import dagster as dg
import pyarrow as pa

from pid_platform.defs.automation.fingerprint import save_fingerprint, source_fingerprint
from pid_platform.defs.automation.run_holds import holding_output
from pid_platform.defs.checks.committed import reassert_committed_checks
from pid_platform.defs.checks.restate import restate_failed_assets
from pid_platform.defs.groups import BUILD_GROUP, BUILD_POOL
from pid_platform.defs.metadata import row_count, table
from pid_platform.defs.partitions import sources_partitions
from pid_platform.defs.plots import bar_png, png_markdown
from pid_platform.defs.raw_sources import RAW_SOURCE_ASSET
from pid_platform.defs.resources import ShardingResource, SourceStoreResource
from pid_platform.defs.retries import IO_RETRY, retry_only_transient
from pid_platform.defs.settings import SETTINGS_ASSET, settings_for_run, settings_metadata
from pid_platform.sharding.commit.lease import build_lease
from pid_platform.sharding.commit.s3_output import check_writable, read_pointer
from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.compute import pc
from pid_platform.sharding.intake.report import IntakeReport
from pid_platform.sharding.layout import final_dir
from pid_platform.sharding.pipeline import run_intake
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.plan.tables import table_modalities
from pid_platform.sharding.tasks.published import (
    discard_staging,
    published_intake_matches,
    seed_intake_cache,
)
from pid_platform.sharding.tasks.staging import push_intake

INTAKE_VERSION = "intake-v1"
# classify_aspect_ratio decides every sample's bucket; the default is part of the code version,
# a source's own value (sharding.yaml) reaches sample_set through its sharding_settings dependency.
INTAKE_CODE_VERSION = f"{INTAKE_VERSION}-classify_aspect_ratio={ShardingConfig().classify_aspect_ratio}"


def _samples_digest(samples: pa.Table, classify_aspect_ratio: bool) -> str:
    # Changes exactly when a sample's key, bucket or any of its files does: unchanged input leaves
    # everything downstream fresh. Read a batch at a time: the table may hold millions of samples.
    h = hashlib.sha256(f"classify_aspect_ratio={classify_aspect_ratio}".encode())
    mods = sorted(table_modalities(samples.schema))
    for batch in samples.to_batches(max_chunksize=64 * 1024):
        d = batch.to_pydict()
        for i, key in enumerate(d["key"]):
            h.update(f"{key}|{d['bucket'][i]}".encode())
            for m in mods:
                name = d[f"name.{m}"][i]
                if name is not None:
                    h.update(f"|{m}|{name}|{d[f'fingerprint.{m}'][i]}".encode())
    return h.hexdigest()[:16]


def ratio_label(bucket: str) -> str:
    """``aspect_ratio_16_9`` -> ``16:9``; the flat bucket is ``(flat)``."""
    return bucket.removeprefix("aspect_ratio_").replace("_", ":") if bucket else "(flat)"


def _plots(source: str, samples: pa.Table, report: IntakeReport) -> dict[str, dg.MetadataValue]:
    counts = pc.value_counts(samples["bucket"]).to_pylist() if samples.num_rows else []
    per_bucket = {c["values"]: c["counts"] for c in counts}
    ratios = {ratio_label(b): n for b, n in sorted(per_bucket.items(), key=lambda kv: _ratio_value(kv[0]))}
    left_out = {**{r: n for r, n in sorted(report.dropped.items())},
                **{f"file {r}": n for r, n in sorted(report.skipped_files.items())}}
    return {
        "aspect_ratio_histogram": png_markdown(
            bar_png(ratios, title=f"{source}: samples per aspect-ratio bucket", ylabel="samples"),
            f"samples per aspect-ratio bucket of {source}"),
        "dropped_by_reason_plot": png_markdown(
            bar_png(left_out, title=f"{source}: samples dropped and files skipped, by reason", ylabel="count",
                    color="#c0392b"),
            f"samples dropped by reason in {source}"),
    }


def _ratio_value(bucket: str | None) -> float:
    # Portrait to landscape, left to right; anything else (the flat bucket: None) after them.
    parts = (bucket or "").removeprefix("aspect_ratio_").split("_")
    if len(parts) == 2 and all(p.isdigit() for p in parts) and int(parts[1]):
        return int(parts[0]) / int(parts[1])
    return float("inf")


REPORT_COLUMNS = (("outcome", "string"), ("count", "int"), ("examples", "string"))


def _report_table(report: IntakeReport) -> dg.TableMetadataValue:
    rows = [("kept", report.samples, "")]
    for reason, n in sorted(report.dropped.items()):
        rows.append((f"dropped: {reason}", n, ", ".join(report.examples.get(reason, [])[:5])))
    for reason, n in sorted(report.skipped_files.items()):
        rows.append((f"file skipped: {reason}", n, ", ".join(report.examples.get(reason, [])[:5])))
    return table(REPORT_COLUMNS, rows)


@dg.asset(
    partitions_def=sources_partitions,
    group_name=BUILD_GROUP,
    kinds={"python", "parquet"},
    code_version=INTAKE_CODE_VERSION,
    deps=[RAW_SOURCE_ASSET, SETTINGS_ASSET],
    pool=BUILD_POOL,
    retry_policy=IO_RETRY,
    output_required=False,
)
def sample_set(
    context: dg.AssetExecutionContext, source_store: SourceStoreResource, sharding: ShardingResource
):
    """The samples of a source: basenames present in every modality folder whose files are all
    valid, each with a WebDataset-safe unique key and its aspect-ratio bucket.

    Every file looked at is either in a sample or counted, with its reason, in the metadata
    (orphans per modality, dropped samples by reason, skipped files, key collisions). Only new
    or changed files are validated. When nothing changed since the committed build, the asset
    records an observation (`up_to_date`) instead of a materialization: no new data version,
    and the steps downstream are skipped; an asset whose last build failed gets its committed
    materialization reported again, so it shows green (`checks/restate.py`).
    """
    source = context.partition_key
    with holding_output(context, source, source_store) as hold:  # the run holds the source to its end (run_holds.py)
        out = source_store.source_out(source)
        store = source_store.open()
        with retry_only_transient():
            run_settings = settings_for_run(context, source_store, sharding, source)
            settings = run_settings.settings
            target = source_store.source_target(source)
            if target is not None:
                check_writable(target)  # an S3 output that refuses stops the run before any work
            # Listed before the intake reads: a file changed meanwhile makes the next tick build again.
            fingerprint, _ = source_fingerprint(store, source)
            samples_where = None
            with build_lease(target) if target is not None else nullcontext():
                if target is not None:
                    seed_intake_cache(target, out)  # the published outcomes: validate only what changed since
                # An s3 output is up to date when the bucket serves what this intake finds (below), never
                # by a local folder: one an older release committed there would vouch for the bucket.
                result = run_intake(
                    store, source, out, settings.config, trust_pickle=sharding.trust_pickle,
                    num_workers=sharding.num_workers, stop_if_up_to_date=target is None,
                )
                if target is not None and published_intake_matches(target, staging_dir(out), settings.config):
                    # The bucket serves what this build would publish: nothing to build, on any machine.
                    samples_where = f"{target}/{read_pointer(target).version_dir()}/.pid-build/samples.parquet"
                    discard_staging(out)
                    result = replace(result, up_to_date=True)
            if not result.up_to_date:
                save_fingerprint(staging_dir(out), fingerprint)  # committed with the build it describes
                if target is not None:
                    push_intake(target, staging_dir(out))  # for the plan step, on whichever machine it runs
        samples, report, path = result.samples, result.report, result.path
        counts = {"files_validated": report.files_validated, "outcomes_reused": report.outcomes_reused,
                  "validate": result.validate}
        if result.up_to_date:
            context.log.info(f"{source}: up to date ({report.samples} samples); nothing to build")
            hold.release()  # nothing follows in this run: the source is free for other builds
            # A source red from a failed build is green again once verified unchanged; before the
            # checks, so their results belong to the restated materializations.
            restate_failed_assets(context, source)
            # The skipped checks' verdict, on what is served.
            reassert_committed_checks(context, source, final_dir(out), target if samples_where else None)
            context.log_event(dg.AssetObservation(
                asset_key=context.asset_key, partition=source,
                # What the committed build is made from, confirmed: the sensor compares against it.
                metadata={"up_to_date": True, "samples": report.samples, **counts,
                          "settings_version": settings.version, "input_fingerprint": fingerprint,
                          "data_version": _samples_digest(samples, settings.config.classify_aspect_ratio),
                          "samples_table": dg.MetadataValue.path(samples_where or str(path))},
            ))
            return
        context.log.info(f"{source}: {report.samples} samples kept, {report.dropped_total} dropped")
        yield dg.MaterializeResult(
            metadata={
                "up_to_date": False,
                **counts,
                "samples": report.samples,
                "dropped_total": report.dropped_total,
                "dropped_by_reason": dg.MetadataValue.json(dict(sorted(report.dropped.items()))),
                "orphans": dg.MetadataValue.json(report.orphans),
                "skipped_files": dg.MetadataValue.json(dict(sorted(report.skipped_files.items()))),
                "examples": dg.MetadataValue.json(dict(sorted(report.examples.items()))),
                "key_collisions": report.key_collisions,
                "modalities": ", ".join(report.modalities),
                "files_seen": dg.MetadataValue.json(report.files_seen),
                "report": _report_table(report),
                **row_count(report.samples),
                # Written into the staging folder; this is where it is once wdinfo_manifests commits.
                "samples_table": dg.MetadataValue.path(str(out / path.relative_to(staging_dir(out)))),
                "raw_source": f"{store.uri.rstrip('/')}/{source}",
                "classify_aspect_ratio": settings.config.classify_aspect_ratio,
                "input_fingerprint": fingerprint,
                **settings_metadata(run_settings),
                **_plots(source, samples, report),
            },
            tags=run_settings.tags,
            data_version=dg.DataVersion(_samples_digest(samples, settings.config.classify_aspect_ratio)),
        )
