"""The pid_platform code location: everything is registered by the modules under ``defs/``;
here only the global policy: every job's executor (``defs/executors.py``, chosen by configuration),
and the catalog's code version, a digest of ``$PID_DATASETS`` read at this load (modules are
imported once per process, so it cannot be set where the asset is declared): after an edit of
the file and a reload, automation rewrites ``catalog.json`` (``automation/conditions.py``)."""

from pathlib import Path

import dagster as dg

from pid_platform.defs.datasets.definitions import read_datasets_file
from pid_platform.defs.executors import pid_executor
from pid_platform.defs.ownership import with_owners


@dg.definitions
def defs() -> dg.Definitions:
    loaded = with_owners(dg.load_from_defs_folder(path_within_project=Path(__file__).parent))
    version = read_datasets_file().version()
    loaded = loaded.permissive_map_resolved_asset_specs(
        func=lambda spec: spec.replace_attributes(code_version=f"datasets-{version}"), selection=dg.AssetSelection.assets("dataset_catalog"))
    return dg.Definitions.merge(loaded, dg.Definitions(executor=pid_executor()))
