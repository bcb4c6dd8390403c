"""Completion records of build tasks, in the staging folder's ``.pid-build/tasks/``.

A record is written last, atomically, once every output of its task is in place: its presence
is the task's "done". It names the task (stage, index, of) and what it was done against (the
plan's shard list's sha256 for a write task; the validation settings for an intake task), so a record left
by a task of another plan is not taken for this one's.
"""

from __future__ import annotations

import json
from pathlib import Path

from loader.formats.atomic import atomic_write_bytes, is_temp_file
from pid_platform.sharding.commit.state import state_dir
from pid_platform.sharding.state_doc import read_state_doc

TASKS_DIR = "tasks"
INTAKE = "intake"
WRITE = "write"
STAGES = (INTAKE, WRITE)
RECORD_FORMAT = 1


def tasks_dir(folder: Path) -> Path:
    return state_dir(folder) / TASKS_DIR


def _stem(stage: str, index: int, of: int) -> str:
    return f"{stage}-{index:06d}-of-{of:06d}"


def record_path(folder: Path, stage: str, index: int, of: int) -> Path:
    return tasks_dir(folder) / f"{_stem(stage, index, of)}.json"


def intake_part_path(folder: Path, index: int, of: int) -> Path:
    """The file outcomes intake task ``index`` of ``of`` found (an ``IntakeCache`` parquet)."""
    return tasks_dir(folder) / f"{_stem(INTAKE, index, of)}.parquet"


def intake_parts(folder: Path) -> list[Path]:
    """Every finished intake task's outcomes in ``folder`` (a part without its record is from a
    task killed after writing it: still valid outcomes, but the task is not done)."""
    d = tasks_dir(folder)
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob(f"{INTAKE}-*.parquet") if not is_temp_file(p))


def read_record(folder: Path, stage: str, index: int, of: int) -> dict | None:
    """Task ``index`` of ``of``'s record; None when there is none; ``StateFileError`` naming it
    when it is damaged."""
    doc = read_state_doc(record_path(folder, stage, index, of))
    return doc if isinstance(doc, dict) and doc.get("format") == RECORD_FORMAT else None


def write_record(folder: Path, stage: str, index: int, of: int, doc: dict) -> Path:
    path = record_path(folder, stage, index, of)
    full = {"format": RECORD_FORMAT, "stage": stage, "index": index, "of": of, **doc}
    atomic_write_bytes(path, json.dumps(full, sort_keys=True, indent=1).encode())
    return path


def records(folder: Path, stage: str) -> list[dict]:
    """Every readable record of ``stage`` in ``folder``, in name order."""
    d = tasks_dir(folder)
    found = []
    for p in sorted(d.glob(f"{stage}-*.json")) if d.is_dir() else []:
        if is_temp_file(p):
            continue
        doc = read_state_doc(p)
        if isinstance(doc, dict) and doc.get("format") == RECORD_FORMAT and doc.get("stage") == stage:
            found.append(doc | {"path": str(p)})
    return found


def clear_records(folder: Path, stage: str) -> int:
    """Remove every record of ``stage`` in ``folder``: its tasks run again (each keeping what
    is still up to date) instead of being taken for done. Returns how many were removed."""
    d = tasks_dir(folder)
    found = sorted(d.glob(f"{stage}-*.json")) if d.is_dir() else []
    for p in found:
        p.unlink(missing_ok=True)
    return len(found)

