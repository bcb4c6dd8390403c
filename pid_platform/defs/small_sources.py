"""Small sources build in one process: a run of a source whose raw files are under a size
threshold runs its steps with Dagster's ``in_process`` executor instead of ``multiprocess``.

Each step of the ``multiprocess`` executor is a new Python process that imports Dagster and this
code location, 3-5 s on a busy machine; a source of a few MiB does its actual work in about a
second, so a re-shard launched from the UI took a minute and a half of process starts. Below
``PID_IN_PROCESS_BELOW_MB`` (default 256 MiB of raw files; 0 turns it off) the same steps run
one after another in the run's own process: the same plan, write tasks, checks and events,
retries and re-execution from failure, the pools and Terminate; the fan-out over processes stays
for bigger sources, and a run configured for Celery or ECS is left to that executor.

The size is that of the files under the source's folder on a local raw root, summed until the
threshold is passed (a big source costs a listing of its first files, not all of them); a source
on an ``s3://`` raw root keeps the fan-out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

IN_PROCESS_BELOW_ENV = "PID_IN_PROCESS_BELOW_MB"
DEFAULT_IN_PROCESS_BELOW_MB = 256.0
PARTITION_TAG = "dagster/partition"


class SmallSourceSettingError(ValueError):
    """``PID_IN_PROCESS_BELOW_MB`` is not a number of MiB."""


def in_process_below_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The threshold in bytes (0: every source fans out)."""
    env = os.environ if environ is None else environ
    raw = env.get(IN_PROCESS_BELOW_ENV)
    if raw is None or raw.strip() == "":
        return int(DEFAULT_IN_PROCESS_BELOW_MB * 1024 * 1024)
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise SmallSourceSettingError(f"{IN_PROCESS_BELOW_ENV}={raw!r}: expected a size in MiB >= 0, e.g. "
                                      f"{IN_PROCESS_BELOW_ENV}=64 (0 runs every build's steps as processes)")
    return int(mb * 1024 * 1024)


def source_bytes_below(folder: Path, limit: int) -> bool:
    """Whether the files of the source ``folder`` (its modality folders, as the listing takes
    them: no hidden or ``_`` names) hold fewer than ``limit`` bytes; stops once they do not."""
    total = 0
    try:
        with os.scandir(folder) as modalities:
            dirs = sorted(d.path for d in modalities
                          if not d.name.startswith((".", "_")) and d.is_dir())
        for path in dirs:
            with os.scandir(path) as files:
                for f in files:
                    if f.name.startswith(".") or not f.is_file():
                        continue
                    total += f.stat().st_size
                    if total >= limit:
                        return False
    except OSError:
        return False  # not readable here: leave the run as configured
    return True


def runs_in_one_process(tags: Mapping[str, str], environ: Mapping[str, str] | None = None) -> bool:
    """Whether a run with ``tags`` builds a small source of a local raw root (see the module doc)."""
    from pid_platform.defs.resources import LocalSourceStoreResource, source_store_from_env

    source = tags.get(PARTITION_TAG)
    limit = in_process_below_bytes(environ)
    if not source or limit <= 0:
        return False
    store = source_store_from_env(environ)
    if not isinstance(store, LocalSourceStoreResource):
        return False
    folder = Path(store.raw_root) / source
    return folder.is_dir() and source_bytes_below(folder, limit)
