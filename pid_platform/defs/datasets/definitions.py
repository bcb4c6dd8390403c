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
A malformed file fails the code location's load with a ``MixtureError`` naming the file and the
entry: it is read by the one strict reader (``loader.formats.strict_doc``: a regular file of at
most 4 MiB, no anchors, aliases or tags, nesting bounded, keys are text).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
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


def dataset_definitions(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The definitions in ``$PID_DATASETS`` as plain values (``{}`` without the variable), each
    checked as far as it can be without the built sources (names, weights, repeat, choose)."""
    env = os.environ if environ is None else environ
    where = (env.get(DATASETS_ENV) or "").strip()
    if not where:
        return {}
    fix = f"fix the file or unset {DATASETS_ENV}"
    data = read_local_doc(Path(where), max_bytes=MAX_DATASETS_BYTES, fix=fix, error=MixtureError)
    doc = load_yaml_doc(data, f"{DATASETS_ENV}={where}", max_bytes=MAX_DATASETS_BYTES, fix=fix,
                        error=MixtureError) or {}
    if not isinstance(doc, dict):
        raise MixtureError(f"{where}: the dataset definitions must map dataset names to definitions, "
                           f"not a {type(doc).__name__}")
    for name, value in doc.items():
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
    return doc


def merged_definitions(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The file's definitions with the ``sharding.datasets`` setting on top (what the catalog holds)."""
    return {**dataset_definitions(), **dict(settings)}
