"""One asset per logical dataset (``datasets/<name>``), downstream of exactly its sources'
manifests and the catalog, so the lineage shows which sources feed which dataset and a source's
re-shard marks the datasets it feeds stale; automation re-runs it after them. Its metadata: each
source's share of the epoch, samples per epoch and repeats, as a table and a plot; its blocking
check ``sources_match`` fails when its entry in ``$PID_DATASETS`` is wrong, a source is not
built, the sources' modalities do not fit the definition, or ``catalog.json`` (what the loader
reads) does not hold this definition.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from loader.formats.catalog import Catalog, SourceEntry, parse_catalog
from loader.formats.errors import FormatError, short_repr
from loader.mixture.definition import Mixture, MixtureError, Source, check_modalities
from pid_platform.defs.automation.conditions import DATASET_FOLLOWS
from pid_platform.defs.checks.catalog import built_and_catalog
from pid_platform.defs.datasets.definitions import DATASETS_ENV, read_datasets_file
from pid_platform.defs.groups import CATALOG_GROUP
from pid_platform.defs.plots import bar_png, png_markdown
from pid_platform.defs.resources import ShardingResource, SourceStoreResource
from pid_platform.defs.retries import IO_RETRY, fail_without_retry_on

DATASETS_PREFIX = "datasets"
CHECK_NAME = "sources_match"
DEFINITIONS_CHECK = "dataset_definitions_read"


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


def _sources_of(definition: Any) -> list[str]:
    """The source names a definition mentions, as far as it can be read (a bad entry still gets
    its asset, to show its error)."""
    named = definition.get("sources") if isinstance(definition, dict) else definition
    if isinstance(named, (dict, list)):
        return sorted({s for s in named if isinstance(s, str)})
    return []


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def _catalog_problem(name: str, current: Any, data: bytes | None, where: str) -> str | None:
    """Why catalog.json does not hold this definition of the dataset (the loader reads that), or None."""
    if data is None:
        return f"{where} is missing; materialize dataset_catalog"
    try:
        written = parse_catalog(data, where).to_json()["datasets"].get(name)
    except (FormatError, ValueError) as exc:
        return str(exc)
    if written is None:
        return f"dataset {name!r} is not in {where} (dataset_catalog leaves out a dataset that does not fit the " \
               "built sources); fix the problems above, then materialize dataset_catalog"
    try:  # as the catalog writes it: a union as its sorted list, a mixture in its canonical form
        value = list(current) if isinstance(current, list) else Mixture.from_json(name, current)
        wanted = Catalog({}, {name: value}).to_json()["datasets"][name]
    except MixtureError:
        return None  # the definition's own error is reported already
    if written != wanted:
        return f"{where} holds another definition of {name!r} ({short_repr(written, 200)}); materialize " \
               "dataset_catalog to write this one"
    return None


def dataset_asset(name: str, definition: Any, error: str | None = None) -> dg.AssetsDefinition:
    key = dg.AssetKey([DATASETS_PREFIX, name])
    sources = _sources_of(definition)
    bad = f" Its entry in ${DATASETS_ENV} is wrong: {error}" if error else ""

    @dg.asset(
        key=key,
        # Exactly these sources' manifests: the lineage (and staleness) of this dataset.
        deps=[dg.AssetDep("wdinfo_manifests", partition_mapping=dg.SpecificPartitionsPartitionMapping(sources)),
              "dataset_catalog"],
        group_name=CATALOG_GROUP,
        kinds={"python", "json"},
        retry_policy=IO_RETRY,
        # An edited entry marks the dataset stale (code version); the catalog and its sources'
        # new manifests make automation re-run it, and with it its check.
        code_version=_digest(definition, error),
        automation_condition=DATASET_FOLLOWS,
        check_specs=[dg.AssetCheckSpec(CHECK_NAME, asset=key, blocking=True,
                                       description="The definition reads, every source is built with the modalities "
                                                   "the dataset reads, and catalog.json holds this definition.")],
        description=f"Logical dataset {name!r}: sources {sources}; each source's share of an epoch, samples per "
                    "epoch and repeats (table and plot). The loader reads it with build_dataset(name, catalog=...)."
                    + bad,
    )
    def _dataset(source_store: SourceStoreResource, sharding: ShardingResource) -> dg.MaterializeResult:
        # The file as it is now (the run may start after an edit), the launchpad's
        # sharding.datasets on top (as for the catalog).
        found = read_datasets_file()
        current = sharding.datasets.get(name, found.definitions.get(name))
        with fail_without_retry_on():
            built, data, where = built_and_catalog(source_store)
        if name in sharding.datasets:
            problem = None
        elif name in found.errors:
            problem = found.errors[name]
        elif current is None:
            problem = found.file_error or (f"dataset {name!r} is no longer defined in {found.where}; reload the "
                                           "definitions (Deployment, Reload) to drop its asset")
        else:
            problem = None
        summary = summarize(name, current, built) if problem is None else DatasetSummary(problems=[problem])
        if problem is None and not summary.problems:
            in_catalog = _catalog_problem(name, current, data, where)
            if in_catalog:
                summary.problems.append(in_catalog)
        # Each bar names its source's repeat factor, the number a PiD user looks for (x3.33:
        # each sample about three times an epoch), in the plot and in its alt text.
        repeats = {r[0]: f"x{r[5]:g}" for r in summary.rows}
        per_epoch = {f"{r[0]}\n{repeats[r[0]]} repeats": r[3] for r in summary.rows}
        alt = f"{name} shares ({', '.join(f'{s} {x}' for s, x in repeats.items())})"
        return dg.MaterializeResult(
            metadata={
                "sources": dg.MetadataValue.json(_sources_of(current)),
                "samples_per_epoch": summary.samples_per_epoch,
                "shares": _table(summary),
                "shares_plot": png_markdown(bar_png(per_epoch, title=f"{name}: samples per epoch by source "
                                                    "(and how often each sample repeats)",
                                                    ylabel="samples per epoch"), alt),
                "definition": dg.MetadataValue.json(current if current is not None else {}),
            },
            check_results=[dg.AssetCheckResult(
                check_name=CHECK_NAME, passed=not summary.problems,
                severity=dg.AssetCheckSeverity.ERROR,
                metadata={"problems": dg.MetadataValue.json(summary.problems)},
                description="; ".join(summary.problems) or "every source is built with the modalities read, "
                                                           "and catalog.json holds this definition",
            )],
        )

    return _dataset


def definitions_read_check() -> dg.AssetChecksDefinition:
    """A check on dataset_catalog that ``$PID_DATASETS`` reads: a file that cannot be read names
    no dataset asset to show its error on, so the catalog, which writes the definitions, shows it.
    Not blocking: the catalog it checks is written all the same (keeping the datasets it had)."""

    @dg.asset_check(asset="dataset_catalog", name=DEFINITIONS_CHECK, blocking=False,
                    description=f"${DATASETS_ENV} reads: every entry is a valid dataset definition (an error names "
                                "the file, the dataset and the key).")
    def _read() -> dg.AssetCheckResult:
        found = read_datasets_file()
        problems = found.problems()
        return dg.AssetCheckResult(
            passed=not problems, severity=dg.AssetCheckSeverity.ERROR,
            description="; ".join(problems) or f"{found.where}: {len(found.definitions)} datasets",
            metadata={"file": str(found.where), "problems": dg.MetadataValue.json(problems),
                      "datasets": dg.MetadataValue.json(sorted(found.definitions))},
        )

    return _read


@dg.definitions
def datasets() -> dg.Definitions:
    """The assets of the datasets in ``$PID_DATASETS`` (none without it), and the check that it
    reads. A bad file never fails the load: every entry with a usable name still gets its asset."""
    found = read_datasets_file()
    if found.where is None:
        return dg.Definitions()
    return dg.Definitions(
        assets=[dataset_asset(n, d, found.errors.get(n)) for n, d in sorted(found.definitions.items())],
        asset_checks=[definitions_read_check()],
    )
