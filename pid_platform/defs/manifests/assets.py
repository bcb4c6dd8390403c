"""Key indexes and ``wdinfo.json`` manifests of one source, and the catalog of all sources."""

import hashlib
import json
from pathlib import Path
from typing import Any

import dagster as dg

from loader.formats.catalog import parse_catalog
from loader.formats.errors import FormatError
from loader.formats.wdinfo import WDINFO_NAME, read_wdinfo
from pid_platform.defs.automation.conditions import (
    CATALOG_CONDITION,
    CATALOG_FRESHNESS,
    FOLLOW_UPSTREAM,
)
from pid_platform.defs.automation.fingerprint import load_fingerprint
from pid_platform.defs.automation.run_holds import holding_output
from pid_platform.defs.checks.catalog import built_and_catalog
from pid_platform.defs.checks.common import built_plans
from pid_platform.defs.datasets.catalog_entries import catalog_datasets
from pid_platform.defs.datasets.definitions import read_datasets_file
from pid_platform.defs.groups import BUILD_GROUP, CATALOG_GROUP
from pid_platform.defs.metadata import bucket_label, first, row_count, table
from pid_platform.defs.partitions import sources_partitions
from pid_platform.defs.resources import SHARDING_CODE_VERSION, ShardingResource, SourceStoreResource
from pid_platform.defs.retries import IO_RETRY, retry_only_transient
from pid_platform.defs.settings import commit_launchpad_settings
from pid_platform.defs.shards.tasks import ui_advice, unfinished_failure
from pid_platform.defs.step_errors import step_failure
from pid_platform.sharding.catalog import build_catalog, build_s3_catalog
from pid_platform.sharding.commit.manifests import BucketManifest
from pid_platform.sharding.commit.s3_output import S3Output, read_pointer
from pid_platform.sharding.commit.verify_output import key_index_mismatches, manifest_mismatches
from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.layout import bucket_dir
from pid_platform.sharding.pipeline import (
    refuse_roots_on_s3,
    run_key_indexes,
    state_dir,
)
from pid_platform.sharding.plan.columnar import ShardRef
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.tasks.commit import commit_staged, staged_shards
from pid_platform.sharding.tasks.published import (
    published_config,
    published_manifests,
    published_problems,
)


def committed_only(out: Path) -> bool:
    """True when no build of ``out`` has staged tars (nothing to index or commit) and a committed
    version is there: key indexes and manifests then verify the committed version instead of
    failing, so each of them can be materialized on its own after a finished build."""
    return (not (state_dir(staging_dir(out)) / "sharding.json").is_file()
            and (state_dir(out) / "sharding.json").is_file())


def nothing_to_finish(out: Path, source: str, asset: str) -> None:
    """Refuse at once when no build of ``source`` has staged tars and none is committed."""
    if not (state_dir(staging_dir(out)) / "sharding.json").is_file() and not (state_dir(out) / "sharding.json").is_file():
        raise step_failure(
            f"{asset} of {source} has no tars to describe: no build of it is staged or committed. Select "
            f"sample_set and twin_tar_shards with it, or launch the source_build job for partition {source!r}")


def _verified_or_fail(problems: list[str], what: str, source: str) -> None:
    if problems:
        raise step_failure(
            f"the committed {what} of {source} do not match its tars ({len(problems)} problems; "
            f"first: {problems[0]}); rebuild the source (materialize source_build for it)",
            metadata={"problems": dg.MetadataValue.json(first(problems))})


def _committed_key_indexes(out: Path, source: str) -> tuple[ShardingConfig, list[ShardRef]]:
    config, plans = built_plans(out)
    _verified_or_fail(key_index_mismatches(out, sorted({p.bucket for p in plans})), "key indexes", source)
    return config, plans


def _committed_manifests(out: Path, source: str) -> tuple[ShardingConfig, list[BucketManifest], list[Path]]:
    config, plans = built_plans(out)
    buckets = sorted({p.bucket for p in plans})
    _verified_or_fail(manifest_mismatches(out, buckets), "manifests", source)
    found = [BucketManifest(b, bucket_dir(out, b) / WDINFO_NAME, read_wdinfo(bucket_dir(out, b) / WDINFO_NAME))
             for b in buckets]
    return config, found, []


@dg.asset(
    partitions_def=sources_partitions,
    deps=["twin_tar_shards"],
    group_name=BUILD_GROUP,
    kinds={"python", "parquet"},
    code_version=SHARDING_CODE_VERSION,
    automation_condition=FOLLOW_UPSTREAM,
    retry_policy=IO_RETRY,
)
def key_indexes(
    context: dg.AssetExecutionContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> dg.MaterializeResult:
    """One parquet key index per twin-tar shard: the sample keys in member order, the original
    basenames, and each member's offset and size per modality (the loader's index mode reads
    these instead of scanning tars). Written into the staging folder beside the staged tars.

    Materialized alone when no build is staged, it verifies the committed key indexes against
    the committed tars and records them (`state: committed`).
    """
    source = context.partition_key
    with holding_output(context, source, source_store):  # the run holds the source to its end (run_holds.py)
        out = source_store.source_out(source)
        target = source_store.source_target(source)
        with retry_only_transient(), ui_advice():
            if target is not None:
                return _s3_key_indexes(source_store, source, target)
            nothing_to_finish(out, source, "key_indexes")
            if committed_only(out):
                config, plans = _committed_key_indexes(out, source)
                return _key_indexes_result(plans, "committed", config)
            # The staged tars were cut with the config recorded beside them, whatever a later run asks for.
            config, plans, _written = run_key_indexes(out, num_workers=sharding.num_workers)
            return _key_indexes_result(plans, "staged", config)


def _key_indexes_result(plans: list[ShardRef] | None, state: str, config: ShardingConfig,
                        per_bucket: dict[str, int] | None = None, rows: int = 0) -> dg.MaterializeResult:
    if plans is not None:
        per_bucket, rows = {}, sum(p.count for p in plans)
        for p in plans:
            per_bucket[p.bucket] = per_bucket.get(p.bucket, 0) + 1
    count = sum(per_bucket.values())
    return dg.MaterializeResult(
        metadata={
            "key_indexes": count,
            "rows": rows,
            "state": state,
            "config_version": config.version(),
            "indexes_by_bucket": table((("bucket", "string"), ("key_indexes", "int")),
                                       [(bucket_label(b), n) for b, n in sorted(per_bucket.items())]),
            **row_count(rows),
        }
    )


def _s3_key_indexes(source_store: SourceStoreResource, source: str, target: S3Output) -> dg.MaterializeResult:
    """An s3 output's key indexes: the write tasks sent each with its shard (after its header
    check), so this step confirms they are all done; with nothing staged, it verifies the
    published version (its objects against its manifests)."""
    shards = staged_shards(target, source_store.work_root or None, "key indexes")
    if shards is None:
        _verified_or_fail(published_problems(target), "key indexes", source)
        manifests = published_manifests(target)
        return _key_indexes_result(None, "committed", published_config(target),
                                   {m.bucket or "": len(m.tars) for _, m in manifests},
                                   sum(m.total_key_count for _, m in manifests))
    shards.discard()
    problem = shards.unfinished()
    if problem is not None:
        raise unfinished_failure(f"key_indexes of {source}", problem)
    return _key_indexes_result(shards.plans, "staged (sent by the write tasks)", shards.config)


@dg.asset(
    partitions_def=sources_partitions,
    deps=["key_indexes"],
    group_name=BUILD_GROUP,
    kinds={"python", "json"},
    code_version=SHARDING_CODE_VERSION,
    automation_condition=FOLLOW_UPSTREAM,
    retry_policy=IO_RETRY,
)
def wdinfo_manifests(
    context: dg.AssetExecutionContext, source_store: SourceStoreResource, sharding: ShardingResource
) -> dg.MaterializeResult:
    """One `wdinfo.json` per bucket: the tars, their key counts, byte sizes and checksums.

    This is the commit point of a source's build: the manifests are written last, into the
    staging folder, after every tar and key index they list; then the staging folder replaces
    the source's output folder in one swap of folders. `removed` lists the files of the
    previous version that the new one no longer has.

    With an `s3://` output the staged version is first published to the bucket: tars and key
    indexes under a new `versions/<id>/` prefix, manifests last, then `pid-current.json` is
    switched to it (the commit point readers see); the previous version stays until the
    `s3_version_cleanup` job removes it after its grace period.

    Materialized alone when no build is staged, it verifies the committed manifests against the
    committed tars and records them (`state: committed`); nothing is rewritten.
    """
    source = context.partition_key
    with holding_output(context, source, source_store) as hold:  # the run holds the source to its end (run_holds.py)
        out = source_store.source_out(source)
        target = source_store.source_target(source)
        with retry_only_transient(), ui_advice():
            if target is not None:
                config, manifests, state, fingerprint, out = _s3_manifests(source_store, sharding, source, target)
                removed: list[Path] = []
            else:
                nothing_to_finish(out, source, "wdinfo_manifests")
                if committed_only(out):
                    config, manifests, removed = _committed_manifests(out, source)
                    state = "committed"
                else:  # the commit ``pid-shard commit`` runs, for a folder as for a bucket
                    done = commit_staged(out, num_workers=sharding.num_workers,
                                         manifest_root=sharding.manifest_root_of(source))
                    if done is None:  # committed by another run since this check
                        config, manifests, removed = _committed_manifests(out, source)
                        state = "committed"
                    else:
                        config, manifests, removed = done.shards.config, done.manifests, done.removed
                        state = "committed now"
                # What the committed build was made from: the sensor and the schedule compare against it.
                fingerprint = load_fingerprint(out)
            pointer = read_pointer(target) if target is not None else None
        if state == "committed now":
            # A launchpad re-shard takes effect in sharding.yaml now that its build is committed.
            commit_launchpad_settings(context, source_store, sharding, source, config)
        listed = ([f"{target}/{p}" for p in pointer.manifest_paths()] if pointer is not None
                  else [str(m.path) for m in manifests])
        rows = [
            (bucket_label(m.bucket), len(m.manifest.tars), m.manifest.total_key_count, m.manifest.chunk_size,
             str(m.path.relative_to(out)))
            for m in manifests
        ]
        if removed:
            context.log.info(f"{source}: the new version dropped {len(removed)} files of the previous one")
        hold.release()  # the build is committed (or verified): the run holds the source no more
        return dg.MaterializeResult(
            metadata={
                "manifests": dg.MetadataValue.json(listed),
                "state": state,
                **({"version": pointer.version} if pointer is not None else {}),
                "buckets": len(manifests),
                "tars": sum(len(m.manifest.tars) for m in manifests),
                "samples": sum(m.manifest.total_key_count for m in manifests),
                "config_version": config.version(),
                "settings_version": config.version(),
                **({"input_fingerprint": fingerprint} if fingerprint is not None else {}),
                "manifests_by_bucket": table(
                    (("bucket", "string"), ("tars", "int"), ("samples", "int"), ("chunk_size", "int"),
                     ("manifest", "string")), rows),
                **row_count(sum(m.manifest.total_key_count for m in manifests)),
                "removed_count": len(removed),
                "removed": dg.MetadataValue.json(first([str(p.relative_to(out)) for p in removed])),
                "output": dg.MetadataValue.path(source_store.output_location(source)),
            }
        )


def _s3_manifests(source_store: SourceStoreResource, sharding: ShardingResource, source: str, target: S3Output
                  ) -> tuple[ShardingConfig, list[BucketManifest], str, str | None, Path]:
    """An s3 output's commit (``tasks.commit.commit_staged``): the manifests from the plan and the
    write tasks' records, every object checked, the pointer switched; or, with nothing staged,
    the published version verified. Returns what the asset's metadata needs, and the folder its
    manifests' paths are relative to."""
    refuse_roots_on_s3(sharding.manifest_root_of(source), target)
    done = commit_staged(target, work_root=source_store.work_root or None, num_workers=sharding.num_workers)
    if done is None:
        _verified_or_fail(published_problems(target), "manifests", source)
        manifests = [BucketManifest(m.bucket or "", Path(rel), m) for rel, m in published_manifests(target)]
        return published_config(target), manifests, "committed", None, Path()
    folder = done.shards.folder
    fingerprint = load_fingerprint(folder)  # the listing the build was made from, as sample_set staged it
    done.shards.discard()
    return done.shards.config, done.manifests, "committed now", fingerprint, folder


@dg.asset(
    deps=["wdinfo_manifests"],
    group_name=CATALOG_GROUP,
    kinds={"python", "json"},
    automation_condition=CATALOG_CONDITION,
    freshness_policy=CATALOG_FRESHNESS,
    retry_policy=IO_RETRY,
)
def dataset_catalog(context: dg.AssetExecutionContext, source_store: SourceStoreResource,
                    sharding: ShardingResource) -> dg.MaterializeResult:
    """`catalog.json` at the output root: every source with a manifest, and the logical datasets
    (`$PID_DATASETS`, with `sharding.datasets` on top, plus `all`) that group them; the loader
    resolves a dataset name to its manifests through it.

    One dataset never stops it: a dataset naming a source not built yet, a bad entry, or a
    `datasets.yaml` that cannot be read keeps the definition the catalog had (if it still fits)
    or is left out (`datasets_kept`, `datasets_left_out`); its own asset's check fails.
    """
    with retry_only_transient():
        found = read_datasets_file()
        built, data, where = built_and_catalog(source_store)
        previous = _previous_datasets(data, where)
        chosen = catalog_datasets(found, sharding.datasets, built, previous)
        root = source_store.root_target()
        if root is not None:
            path, catalog = build_s3_catalog(root, chosen.datasets)
        else:
            path, catalog = build_catalog(Path(source_store.output_root), chosen.datasets)
    for name, why in sorted({**chosen.kept, **chosen.left_out}.items()):
        what = "keeps its previous definition" if name in chosen.kept else "is left out"
        context.log.warning(f"dataset {name!r} {what} in {path}: {why}")
    rows = [(s.name, len(s.buckets), s.total_key_count, ", ".join(s.data_keys)) for s in catalog.sources.values()]
    written = json.dumps(catalog.to_json(), sort_keys=True).encode()
    return dg.MaterializeResult(
        # What the catalog holds (sources, manifests and datasets): a dataset asset reads stale
        # exactly when the catalog it is resolved through changed.
        data_version=dg.DataVersion(hashlib.sha256(written).hexdigest()[:16]),
        metadata={
            "sources": dg.MetadataValue.json(sorted(catalog.sources)),
            "datasets": dg.MetadataValue.json(catalog.to_json()["datasets"]),
            "datasets_kept": dg.MetadataValue.json(chosen.kept),
            "datasets_left_out": dg.MetadataValue.json(chosen.left_out),
            "definitions_version": found.version(),
            "total_key_count": sum(s.total_key_count for s in catalog.sources.values()),
            "sources_table": table(
                (("source", "string"), ("buckets", "int"), ("samples", "int"), ("modalities", "string")), rows),
            **row_count(len(rows)),
            "catalog": dg.MetadataValue.path(str(path)),
        }
    )


def _previous_datasets(data: bytes | None, where: str) -> dict[str, Any]:
    """The datasets of the catalog being replaced ({} when there is none or it cannot be read:
    it is rewritten whole either way)."""
    if data is None:
        return {}
    try:
        return dict(parse_catalog(data, where).to_json()["datasets"])
    except (FormatError, ValueError):
        return {}
