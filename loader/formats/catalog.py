"""Catalog: which sources exist and which logical datasets group them.

PiD keeps this in two Python files (``data_source_local.py`` maps a source name to where its
``wdinfo.json`` files are; ``dataset_definition.py`` maps a dataset to sources). Here it is one
JSON file, ``catalog.json``, written by the build; paths are relative to the catalog's folder.

A logical dataset is either a list of source names (a union: every sample of each, once per
epoch) or a weighted mixture, ``{"sources": {"photos": {"weight": 0.6}, ...},
"samples_per_epoch": N}`` (``loader.mixture.definition``), checked when the catalog is read:
its sources must be in the catalog, with the modalities it reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loader.formats.atomic import atomic_write_bytes
from loader.formats.errors import FormatError, short_repr
from loader.formats.strict_doc import load_json_doc, read_local_doc
from loader.io import urls
from loader.mixture.definition import Mixture, MixtureError, check_modalities

CATALOG_NAME = "catalog.json"
CATALOG_VERSION = 1
ALL_DATASET = "all"  # the dataset of every built source, which the build adds to each catalog


class UnknownDatasetError(KeyError):
    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0])


@dataclass(frozen=True)
class SourceEntry:
    name: str
    manifests: list[str]  # wdinfo.json paths, relative to the catalog folder
    buckets: list[str] = field(default_factory=list)
    total_key_count: int = 0
    data_keys: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Catalog:
    sources: dict[str, SourceEntry]
    datasets: dict[str, list[str] | Mixture]  # dataset name -> source names, or a weighted mixture
    location: str | None = None  # folder the catalog was read from

    def mixture(self, name: str) -> Mixture | None:
        """The weighted mixture ``name`` defines (``None``: a union, a source, or unknown)."""
        d = self.datasets.get(name)
        return d if isinstance(d, Mixture) else None

    def source_names(self, name: str) -> list[str]:
        d = self.datasets[name]
        return [s.label for s in d.sources] if isinstance(d, Mixture) else list(d)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": CATALOG_VERSION,
            "sources": {
                n: {
                    "manifests": s.manifests,
                    "buckets": s.buckets,
                    "total_key_count": s.total_key_count,
                    "data_keys": s.data_keys,
                }
                for n, s in sorted(self.sources.items())
            },
            "datasets": {n: v.to_json() if isinstance(v, Mixture) else sorted(v)
                         for n, v in sorted(self.datasets.items())},
        }

    def resolve(self, name: str, *, sources_only: bool = False) -> list[str]:
        """Manifest paths of a dataset (or of a single source), sorted; ``sources_only``: of a
        source (a mixture's source is one), a dataset of that name is refused."""
        if sources_only and name not in self.sources:
            what = "a dataset" if name in self.datasets else "not"
            raise UnknownDatasetError(
                f"source {name!r} is {what} in the catalog at {self.location or '?'} as a source (sources: "
                f"{short_repr(sorted(self.sources), 300)}); a mixture's sources are built sources: name those")
        if name in self.datasets and not sources_only:  # a mixture's manifests: those of every source it names
            sources = self.source_names(name)
        elif name in self.sources:
            sources = [name]
        else:
            known = sorted(set(self.datasets) | set(self.sources))
            raise UnknownDatasetError(
                f"dataset {name!r} is not in the catalog at {self.location or '?'}; known: {known}"
            )
        out: list[str] = []
        for s in sources:
            if s not in self.sources:
                raise UnknownDatasetError(
                    f"dataset {name!r} names source {s!r}, which the catalog at {self.location} lacks; "
                    "build that source or fix the dataset definition"
                )
            base = self.location or "."
            out.extend(_join(base, m) for m in self.sources[s].manifests)
        return sorted(out)


def _join(base: str, rel: str) -> str:
    """``rel`` (a catalog entry, '/'-separated) under the catalog's folder or URL."""
    return urls.join_norm(base, rel)


def write_catalog(folder: str | os.PathLike[str], catalog: Catalog) -> Path:
    path = Path(folder) / CATALOG_NAME
    atomic_write_bytes(path, json.dumps(catalog.to_json(), indent=1).encode() + b"\n")
    return path


MAX_CATALOG_BYTES = 64 * 1024 * 1024  # a catalog of ten thousand sources is a few MB
_FIX = "re-run the dataset_catalog asset"


def read_catalog(path: str | os.PathLike[str]) -> Catalog:
    path = Path(path)
    if path.is_dir():
        path = path / CATALOG_NAME
    # Past the cap is refused, never read whole; a pipe or a device in its place is refused, not waited on.
    data = read_local_doc(path, max_bytes=MAX_CATALOG_BYTES, fix=_FIX)
    return parse_catalog(data, str(path))


def check_entry(rel: Any, where: str) -> str:
    """A catalog path entry, refused unless it is a relative path below the catalog's folder.

    As in ``wdinfo.json``: no absolute path, no ``..`` climbing out, no backslash, and no URL
    (``file://``, ``http://``): an entry of a catalog someone else wrote must not make the
    reader fetch from elsewhere. Entries are '/'-separated."""
    if not isinstance(rel, str) or not rel:
        raise FormatError(f"{where} must be a relative path (a non-empty string), got {short_repr(rel)}; {_FIX}")
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or urls.has_scheme(rel) or ".." in parts or "\n" in rel or "\0" in rel:
        raise FormatError(
            f"{where} {short_repr(rel)} leaves the catalog's folder (absolute, a URL, '..' or a backslash); "
            f"entries are relative paths below it - refusing to read files elsewhere; {_FIX}"
        )
    return rel


def parse_catalog(data: bytes, path: str) -> Catalog:
    """The catalog in ``data``, read from ``path`` (a file or a URL; entries are relative to its folder)."""
    doc = load_json_doc(data, path, max_bytes=MAX_CATALOG_BYTES, fix=_FIX)
    try:
        sources = {
            n: SourceEntry(
                n, list(s["manifests"]), list(s.get("buckets", [])), int(s.get("total_key_count", 0)),
                list(s.get("data_keys", [])),
            )
            for n, s in doc["sources"].items()
        }
        raw = dict(doc.get("datasets", {}))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise FormatError(f"{path}: unreadable catalog ({short_repr(str(exc), 200)}); {_FIX}") from None
    for n, s in sources.items():
        for i, rel in enumerate(s.manifests):
            check_entry(rel, f"{path}: sources[{short_repr(n)}].manifests[{i}]")
    try:
        datasets = check_datasets(raw, sources, unions=False)
    except MixtureError as exc:
        raise MixtureError(f"{path}: {exc}") from None
    return Catalog(sources, datasets, urls.parent(path))


def check_datasets(raw: dict[str, Any], sources: dict[str, SourceEntry], *,
                   unions: bool = True) -> dict[str, list[str] | Mixture]:
    """The logical datasets of a catalog, each checked against its ``sources``: a list names
    sources that exist (``unions=False``: left to ``Catalog.resolve``, as catalogs were always
    read); a mixture's sources exist and have the modalities it reads (one ``MixtureError``
    naming the dataset, the source and the fix). The one reader of the ``datasets`` field, for
    ``catalog.json`` and for the build's settings alike.

    A name means one thing: a dataset may not take a source's name (which would a mixture's
    source, a union's member or ``build_dataset(name)`` mean?), and a definition may not take
    ``all`` (the build's dataset of every source; ``unions=True``, the definition side)."""
    out: dict[str, list[str] | Mixture] = {}
    for name, value in raw.items():
        if name in sources:
            raise MixtureError(f"dataset {name!r} takes the name of the built source {name!r}; rename the dataset "
                               "(a name means one thing in the catalog)")
        if unions and name == ALL_DATASET:
            raise MixtureError(f"dataset {name!r}: {ALL_DATASET!r} is the catalog's dataset of every built source; "
                               "rename the dataset")
        if isinstance(value, (list, tuple)):
            if not all(isinstance(v, str) for v in value):
                raise MixtureError(f"dataset {name!r}: {list(value)!r} is not a list of source names")
            missing = [s for s in value if s not in sources]
            if missing and unions:
                raise MixtureError(f"dataset {name!r}, source {missing[0]!r}: no such source in the catalog "
                                   f"(built: {sorted(sources)}); build it first or fix the name")
            out[name] = list(value)
            continue
        mix = Mixture.from_json(name, value, known_sources=sources)
        if all(sources[s.label].data_keys for s in mix.sources):  # older catalogs may not list them
            check_modalities(mix, {s.label: sources[s.label].data_keys for s in mix.sources})
        out[name] = mix
    return out
