"""Which logical datasets ``dataset_catalog`` writes into ``catalog.json``.

One dataset must never stop the catalog: a definition naming a source not built yet (the natural
order is to define it before the data lands), a typo in one entry, or a ``datasets.yaml`` that
cannot be read at all would otherwise fail every catalog build, and no source's new manifests
would reach the loader. So each dataset is checked on its own against the built sources (by the
catalog's one reader of ``datasets``, ``check_datasets``); one that does not fit keeps the
definition the catalog had if that still fits, else is left out. Its own asset's
``sources_match`` check fails, naming why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loader.formats.catalog import ALL_DATASET, SourceEntry, check_datasets
from pid_platform.defs.datasets.definitions import DatasetsFile


@dataclass
class CatalogDatasets:
    datasets: dict[str, Any] = field(default_factory=dict)  # what catalog.json gets (besides 'all')
    kept: dict[str, str] = field(default_factory=dict)  # name -> why its previous definition stays
    left_out: dict[str, str] = field(default_factory=dict)  # name -> why it is not in catalog.json


def _fits(name: str, definition: Any, built: Mapping[str, SourceEntry]) -> str | None:
    """None when ``definition`` can be written with these built sources, else why not."""
    if definition is None:
        return "no definition"
    try:
        check_datasets({name: definition}, dict(built))
    except ValueError as exc:  # MixtureError (a ValueError) naming the dataset, the source and the fix
        return str(exc)
    return None


def catalog_datasets(found: DatasetsFile, settings: Mapping[str, Any], built: Mapping[str, SourceEntry],
                     previous: Mapping[str, Any]) -> CatalogDatasets:
    """The datasets for ``catalog.json``: the file's (``found``) with the launchpad's
    ``sharding.datasets`` (``settings``) on top, each checked against the ``built`` sources.
    ``previous``: the datasets of the catalog being replaced; one of them stays when its new
    definition does not fit (or, the file unreadable, when nothing says otherwise)."""
    wanted: dict[str, Any] = {**found.definitions, **dict(settings)}
    why_not: dict[str, str] = {n: e for n, e in found.errors.items() if n not in settings}
    names = set(wanted)
    if found.file_error:  # nothing says which datasets the file meant: the catalog's stay
        names |= {n for n in previous if n != ALL_DATASET}
    out = CatalogDatasets()
    for name in sorted(names):
        problem = why_not.get(name)
        if problem is None and name in wanted:
            problem = _fits(name, wanted[name], built)
        elif problem is None:
            problem = found.file_error or "no definition"
        if problem is None:
            out.datasets[name] = wanted[name]
        elif name in previous and _fits(name, previous[name], built) is None:
            out.datasets[name] = previous[name]
            out.kept[name] = problem
        else:
            out.left_out[name] = problem
    return out
