"""The pid_platform code location: everything is registered by the modules under ``defs/``;
here only the global policy: every job's executor (``defs/executors.py``, chosen by configuration)."""

from pathlib import Path

import dagster as dg

from pid_platform.defs.executors import pid_executor
from pid_platform.defs.ownership import with_owners


@dg.definitions
def defs() -> dg.Definitions:
    loaded = with_owners(dg.load_from_defs_folder(path_within_project=Path(__file__).parent))
    return dg.Definitions.merge(loaded, dg.Definitions(executor=pid_executor()))
