"""``sample_set``: the samples of one source, and a report of every file that was left out."""

import hashlib

import dagster as dg

from pid_platform.build.intake import IntakeReport, Sample
from pid_platform.build.pipeline import run_intake
from pid_platform.build.publish import staging_dir
from pid_platform.defs.groups import BUILD_GROUP, BUILD_POOL
from pid_platform.defs.metadata import markdown_table
from pid_platform.defs.partitions import sources_partitions
from pid_platform.defs.resources import ShardingResource, SourceStoreResource
from pid_platform.defs.retries import IO_RETRY, fail_without_retry_on

INTAKE_VERSION = "intake-v1"


def _samples_digest(samples: list[Sample]) -> str:
    # Changes exactly when a sample's key, bucket or any of its files does: unchanged input leaves
    # everything downstream fresh.
    h = hashlib.sha256()
    for s in samples:
        h.update(f"{s.key}|{s.bucket}".encode())
        for m, f in sorted(s.files.items()):
            h.update(f"|{m}|{f.name}|{f.fingerprint}".encode())
    return h.hexdigest()[:16]


def _report_table(report: IntakeReport) -> str:
    rows = [("kept", report.samples, "")]
    for reason, n in sorted(report.dropped.items()):
        rows.append((f"dropped: {reason}", n, ", ".join(report.examples.get(reason, [])[:5])))
    for reason, n in sorted(report.skipped_files.items()):
        rows.append((f"file skipped: {reason}", n, ", ".join(report.examples.get(reason, [])[:5])))
    return markdown_table(("outcome", "count", "examples"), rows)


@dg.asset(
    partitions_def=sources_partitions,
    group_name=BUILD_GROUP,
    kinds={"python", "parquet"},
    code_version=INTAKE_VERSION,
    pool=BUILD_POOL,
    retry_policy=IO_RETRY,
)
def sample_set(
    context: dg.AssetExecutionContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> dg.MaterializeResult:
    """The samples of a source: basenames present in every modality folder whose files are all
    valid, each with a WebDataset-safe unique key and its aspect-ratio bucket.

    Every file looked at is either in a sample or counted, with its reason, in the metadata
    (orphans per modality, dropped samples by reason, skipped files, key collisions).
    """
    source = context.partition_key
    out = source_store.source_out(source)
    store = source_store.open()
    with fail_without_retry_on():
        samples, report, path = run_intake(
            store, source, out, sharding.config(),
            trust_pickle=sharding.trust_pickle, num_workers=sharding.num_workers,
        )
    context.log.info(f"{source}: {report.samples} samples kept, {report.dropped_total} dropped")
    return dg.MaterializeResult(
        metadata={
            "samples": report.samples,
            "dropped_total": report.dropped_total,
            "dropped_by_reason": dg.MetadataValue.json(dict(sorted(report.dropped.items()))),
            "orphans": dg.MetadataValue.json(report.orphans),
            "skipped_files": dg.MetadataValue.json(dict(sorted(report.skipped_files.items()))),
            "examples": dg.MetadataValue.json(dict(sorted(report.examples.items()))),
            "key_collisions": report.key_collisions,
            "modalities": ", ".join(report.modalities),
            "files_seen": dg.MetadataValue.json(report.files_seen),
            "report": dg.MetadataValue.md(_report_table(report)),
            # Written into the staging folder; this is where it is once wdinfo_manifests commits.
            "samples_table": dg.MetadataValue.path(str(out / path.relative_to(staging_dir(out)))),
            "raw_source": f"{store.uri.rstrip('/')}/{source}",
        },
        data_version=dg.DataVersion(_samples_digest(samples)),
    )
