"""The pid_platform code location: everything is registered by the modules under ``defs/``."""

from pathlib import Path

import dagster as dg

from pid_platform.defs.ownership import with_owners


@dg.definitions
def defs() -> dg.Definitions:
    return with_owners(dg.load_from_defs_folder(path_within_project=Path(__file__).parent))
