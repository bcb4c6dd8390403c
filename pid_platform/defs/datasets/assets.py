"""One asset per logical dataset (``datasets/<name>``), downstream of exactly its sources'
manifests, so the lineage shows which sources feed which dataset and a source's re-shard marks
the datasets it feeds stale. Its metadata: each source's share of the epoch, samples per epoch
and repeats, as a table and a plot; its blocking check ``sources_match`` fails when a source is
not built or the sources' modalities do not fit the definition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg

from loader.formats.catalog import SourceEntry
from loader.mixture.definition import Mixture, MixtureError, Source, check_modalities
from pid_platform.defs.datasets.definitions import dataset_definitions
from pid_platform.defs.groups import CATALOG_GROUP
from pid_platform.defs.plots import bar_png, png_markdown
from pid_platform.defs.resources import ShardingResource, SourceStoreResource
from pid_platform.defs.retries import IO_RETRY, fail_without_retry_on
from pid_platform.sharding.catalog import scan_s3_sources, scan_sources

DATASETS_PREFIX = "datasets"
CHECK_NAME = "sources_match"


@dataclass
class DatasetSummary:
    """Per source: (name, setting, samples, samples per epoch, share, repeats); what is wrong."""

    rows: list[tuple[str, str, int, int, float, float]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def samples_per_epoch(self) -> int:
        return sum(r[3] for r in self.rows)


def _mixture(name: str, definition: Any) -> Mixture:
    if isinstance(definition, list):  # a union: every sample of each source once
        return Mixture([Source(s, name=s) for s in definition], name=name)
    return Mixture.from_json(name, definition)


def summarize(name: str, definition: Any, built: dict[str, SourceEntry]) -> DatasetSummary:
    """What one epoch of the dataset holds, given the built sources (nothing raises: a problem
    is listed, for the check to report)."""
    out = DatasetSummary()
    try:
        mix = _mixture(name, definition)
    except MixtureError as exc:
        out.problems.append(str(exc))
        return out
    if name in built:
        out.problems.append(f"dataset {name!r} takes the name of the built source {name!r}; rename the dataset "
                            "(a name means one thing in the catalog)")
    missing = [s.label for s in mix.sources if s.label not in built]
    for src in missing:
        out.problems.append(f"dataset {name!r}, source {src!r}: not built under the output root (built: "
                            f"{sorted(built)}); build it first or fix the name")
    present = [s for s in mix.sources if s.label in built]
    try:
        if present and not missing:
            check_modalities(mix, {s.label: built[s.label].data_keys for s in present})
    except MixtureError as exc:
        out.problems.append(str(exc))
    sizes = [built[s.label].total_key_count if s.label in built else 0 for s in mix.sources]
    try:
        counts = mix.counts(sizes) if not missing else [0] * len(sizes)
    except MixtureError as exc:
        out.problems.append(str(exc))
        counts = [0] * len(sizes)
    total = sum(counts) or 1
    for s, n, c in zip(mix.sources, sizes, counts, strict=True):
        setting = ", ".join(f"{k}={v}" for k, v in s.to_json().items()) or "once each"
        out.rows.append((s.label, setting, n, c, round(c / total, 4), round(c / n, 4) if n else 0.0))
    return out


def _table(summary: DatasetSummary) -> dg.MetadataValue:
    schema = dg.TableSchema(columns=[
        dg.TableColumn("source", "string"), dg.TableColumn("setting", "string"), dg.TableColumn("samples", "int"),
        dg.TableColumn("samples_per_epoch", "int"), dg.TableColumn("share", "float"),
        dg.TableColumn("repeats", "float", description="samples per epoch / samples: 2 = each twice, 0.5 = half"),
    ])
    records = [dg.TableRecord({"source": r[0], "setting": r[1], "samples": r[2], "samples_per_epoch": r[3],
                               "share": r[4], "repeats": r[5]}) for r in summary.rows]
    return dg.MetadataValue.table(records, schema=schema)


def _built_sources(source_store: SourceStoreResource) -> dict[str, SourceEntry]:
    root = source_store.root_target()
    return scan_s3_sources(root) if root is not None else scan_sources(Path(source_store.output_root))


def _sources_of(definition: Any) -> list[str]:
    if isinstance(definition, list):
        return sorted(definition)
    return sorted(definition.get("sources") or {})


def dataset_asset(name: str, definition: Any) -> dg.AssetsDefinition:
    key = dg.AssetKey([DATASETS_PREFIX, name])
    sources = _sources_of(definition)

    @dg.asset(
        key=key,
        # Exactly these sources' manifests: the lineage (and staleness) of this dataset.
        deps=[dg.AssetDep("wdinfo_manifests", partition_mapping=dg.SpecificPartitionsPartitionMapping(sources)),
              "dataset_catalog"],
        group_name=CATALOG_GROUP,
        kinds={"python", "json"},
        retry_policy=IO_RETRY,
        check_specs=[dg.AssetCheckSpec(CHECK_NAME, asset=key, blocking=True,
                                       description="Every source is built and has the modalities the dataset reads.")],
        description=f"Logical dataset {name!r}: sources {sources}; each source's share of an epoch, samples per "
                    "epoch and repeats (table and plot). The loader reads it with build_dataset(name, catalog=...).",
    )
    def _dataset(source_store: SourceStoreResource, sharding: ShardingResource) -> dg.MaterializeResult:
        # The launchpad's sharding.datasets may redefine the dataset for a run (as for the catalog).
        current = sharding.datasets.get(name, definition)
        with fail_without_retry_on():
            summary = summarize(name, current, _built_sources(source_store))
        per_epoch = {r[0]: r[3] for r in summary.rows}
        return dg.MaterializeResult(
            metadata={
                "sources": dg.MetadataValue.json(_sources_of(current)),
                "samples_per_epoch": summary.samples_per_epoch,
                "shares": _table(summary),
                "shares_plot": png_markdown(bar_png(per_epoch, title=f"{name}: samples per epoch by source",
                                                    ylabel="samples per epoch"), f"{name} shares"),
                "definition": dg.MetadataValue.json(current),
            },
            check_results=[dg.AssetCheckResult(
                check_name=CHECK_NAME, passed=not summary.problems,
                severity=dg.AssetCheckSeverity.ERROR,
                metadata={"problems": dg.MetadataValue.json(summary.problems)},
                description="; ".join(summary.problems) or "every source is built with the modalities read",
            )],
        )

    return _dataset


@dg.definitions
def datasets() -> dg.Definitions:
    """The assets of the datasets in ``$PID_DATASETS`` (none without it)."""
    return dg.Definitions(assets=[dataset_asset(n, d) for n, d in sorted(dataset_definitions().items())])
