"""Named points where a build or cleanup can be held, so tests force an interleaving of real processes.

Races between two processes (a build and a cleanup, two builds from two machines) happen in
windows of milliseconds; a test makes them certain by holding one real process at a named point
while another one runs. With ``PID_PAUSE_AT`` unset (always, outside tests) a point costs one
dictionary lookup and does nothing.

``PID_PAUSE_AT=name[,name...]`` and ``PID_PAUSE_DIR=<folder>``: on reaching ``name``, the process
creates ``<folder>/<name>.reached`` and waits until ``<folder>/<name>.go`` exists (at most
``PID_PAUSE_TIMEOUT_S``, default 120 s, then it fails: a forgotten release must not hang a test).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PAUSE_AT_ENV = "PID_PAUSE_AT"
PAUSE_DIR_ENV = "PID_PAUSE_DIR"
PAUSE_TIMEOUT_ENV = "PID_PAUSE_TIMEOUT_S"


def pause_point(name: str) -> None:
    """Hold here if ``PID_PAUSE_AT`` names ``name`` (file names: ``:`` becomes ``-``)."""
    names = os.environ.get(PAUSE_AT_ENV)
    if not names or name not in names.split(","):
        return
    folder = Path(os.environ.get(PAUSE_DIR_ENV) or ".")
    stem = name.replace(":", "-")
    (folder / f"{stem}.reached").write_text(str(os.getpid()))
    deadline = time.monotonic() + float(os.environ.get(PAUSE_TIMEOUT_ENV) or 120)
    go = folder / f"{stem}.go"
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"pause point {name}: {go} was not created in time")
        time.sleep(0.02)
