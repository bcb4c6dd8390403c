"""Where the logical datasets are defined for the code location: a YAML (or JSON) file named by
``PID_DATASETS``, read when the code location loads, e.g.::

    # datasets.yaml: PiD's dataset_definition.py, as data
    blend:
      sources:
        photos: {weight: 0.7}
        portraits: {weight: 0.3}
      samples_per_epoch: 50
    everything: [photos, portraits]      # a union: every sample of each, once

Each entry becomes an asset (``datasets/<name>``) and is written into ``catalog.json`` by
``dataset_catalog``, with the ``sharding`` resource's ``datasets`` (set in the launchpad) on top.
The file is read by the one strict reader (``loader.formats.strict_doc``: a regular file of at
most 4 MiB, no anchors, aliases or tags, nesting bounded, keys are text). A malformed file never
fails the code location's load (that would stop every sensor, the schedule and the run-failure
alert): ``read_datasets_file`` keeps each error, naming the file, the dataset and the key, and
the dataset assets and the catalog's ``dataset_definitions_read`` check show it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loader.formats.catalog import ALL_DATASET
from loader.formats.errors import short_repr
from loader.formats.strict_doc import load_yaml_doc, read_local_doc
from loader.mixture.definition import Mixture, MixtureError

DATASETS_ENV = "PID_DATASETS"
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
# Ten thousand weighted sources take about 400 KB; anything far past that is not a definitions file.
MAX_DATASETS_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class DatasetsFile:
    """What ``$PID_DATASETS`` holds: every entry with a usable name, and what is wrong, naming
    the file, the dataset and the key."""

    where: str | None  # the file; None without PID_DATASETS
    definitions: dict[str, Any] = field(default_factory=dict)  # every entry with a usable name, as written
    errors: dict[str, str] = field(default_factory=dict)  # dataset name -> what is wrong with its entry
    file_error: str | None = None  # the file as a whole (unreadable, not a mapping, a bad name)

    def valid(self) -> dict[str, Any]:
        """The entries that can be written into the catalog (given their sources are built)."""
        return {n: d for n, d in self.definitions.items() if n not in self.errors}

    def problems(self) -> list[str]:
        return ([self.file_error] if self.file_error else []) + [self.errors[n] for n in sorted(self.errors)]

    def version(self) -> str:
        """A digest of the definitions and errors: a code version that moves with every edit."""
        doc = {"definitions": self.definitions, "errors": self.errors, "file_error": self.file_error}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def _check_entry(where: str, name: Any, value: Any) -> None:
    if not isinstance(name, str) or not NAME.match(name):
        raise MixtureError(f"{where}: dataset name {short_repr(name)} must be letters, digits, '_' or '-' "
                           "(it names an asset)")
    if name == ALL_DATASET:  # a built source's name is refused when the catalog is built
        raise MixtureError(f"{where}: dataset {name!r}: {ALL_DATASET!r} is the catalog's dataset of every built "
                           "source; rename the dataset")
    try:
        if isinstance(value, list):
            if not value or not all(isinstance(v, str) for v in value):
                raise MixtureError(f"dataset {name!r}: {short_repr(value)} is not a list of source names")
        else:
            Mixture.from_json(name, value)
    except MixtureError as exc:
        raise MixtureError(f"{where}: {exc}") from None


def read_datasets_file(environ: Mapping[str, str] | None = None) -> DatasetsFile:
    """``$PID_DATASETS`` read (an empty ``DatasetsFile`` without the variable), each entry checked
    as far as it can be without the built sources (names, weights, repeat, choose). Nothing
    raises: a bad entry is kept with its error (its asset shows it), a file that cannot be read
    or a name that cannot name an asset is the ``file_error``."""
    env = os.environ if environ is None else environ
    where = (env.get(DATASETS_ENV) or "").strip()
    if not where:
        return DatasetsFile(None)
    fix = f"fix the file or unset {DATASETS_ENV}"
    try:
        data = read_local_doc(Path(where), max_bytes=MAX_DATASETS_BYTES, fix=fix, error=MixtureError)
        doc = load_yaml_doc(data, f"{DATASETS_ENV}={where}", max_bytes=MAX_DATASETS_BYTES, fix=fix,
                            error=MixtureError) or {}
    except MixtureError as exc:
        return DatasetsFile(where, file_error=str(exc))
    if not isinstance(doc, dict):
        return DatasetsFile(where, file_error=f"{where}: the dataset definitions must map dataset names to "
                                              f"definitions, not a {type(doc).__name__}; {fix}")
    definitions: dict[str, Any] = {}
    errors: dict[str, str] = {}
    bad_names: list[str] = []
    for name, value in doc.items():
        try:
            _check_entry(where, name, value)
        except MixtureError as exc:
            if isinstance(name, str) and NAME.match(name) and name != ALL_DATASET:
                errors[name] = str(exc)
            else:
                bad_names.append(str(exc))
                continue
        definitions[name] = value
    return DatasetsFile(where, definitions, errors, "; ".join(bad_names) or None)


def dataset_definitions(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The definitions in ``$PID_DATASETS`` as plain values (``{}`` without the variable); the
    first problem raises (a ``MixtureError`` naming the file, the dataset and the key)."""
    found = read_datasets_file(environ)
    problems = found.problems()
    if problems:
        raise MixtureError(problems[0])
    return found.definitions
