"""Where the stages of one build hand each other files, and the completion records kept there.

A ``Staging`` is the seam between a folder output and a bucket: the storage layer's object
store (``loader/io/objects.py``) of the staging folder's ``.pid-build/`` (beside the output), or
the bucket's ``<output>/.pid-build/staged/``; the stages get, put, list and delete its files by
the same names (``tasks/write-000000-of-000002.json``) either way.

A record is written last, atomically, once every output of its task is in place: its presence
is the task's "done". It names the task (stage, index, of) and what it was done against (the
plan's shard list's sha256 for a write task; the validation settings for an intake task), so a
record left by a task of another plan is not taken for this one's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loader.formats.atomic import is_temp_file
from loader.io.objects import LocalObjects, ObjectStore
from loader.io.s3_client import S3AccessError
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.commit.state import state_dir
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.state_doc import load_state_doc

STAGED = ".pid-build/staged"  # a bucket's staging, under its output prefix
TASKS_DIR = "tasks"
INTAKE = "intake"
WRITE = "write"
RECORD_FORMAT = 1


@dataclass(frozen=True)
class Staging:
    """The staged files of one build: ``prefix`` in an object store (``loader/io/objects.py``),
    a folder's (``folder_staging``) or a bucket's (``bucket_staging``)."""

    store: ObjectStore
    prefix: str = ""

    def _key(self, name: str) -> str:
        return "/".join(p for p in (self.prefix, name) if p)

    def url(self, name: str) -> str:
        return self.store.url(self._key(name))

    def get(self, name: str) -> bytes | None:
        try:
            return self.store.get_or_none(self._key(name))
        except S3AccessError as exc:
            raise BuildError(str(exc)) from None

    def put(self, name: str, data: bytes | Path, what: str) -> None:
        try:
            self.store.put(self._key(name), data)
        except S3AccessError as exc:
            raise BuildError(f"{exc} ({what}; nothing was published)") from None

    def names(self, under: str) -> list[str]:
        """The names of the files under ``under/``, relative to it, sorted."""
        prefix = self._key(under) + "/"
        return [o.key[len(prefix):] for o in self.store.list(prefix)]

    def delete(self, *names: str) -> None:
        for n in names:
            self.store.delete(self._key(n))


def folder_staging(folder: Path) -> Staging:
    """The staging folder ``folder``'s own files (``<folder>/.pid-build/<name>``)."""
    return Staging(LocalObjects(state_dir(folder)))


def bucket_staging(output: S3Output, under: str = STAGED) -> Staging:
    """The staging of ``output`` in its bucket (``<output>/.pid-build/staged/<name>``; ``under``
    "": the output's own objects)."""
    return Staging(output.store(), output.key(under))


def tasks_dir(folder: Path) -> Path:
    return state_dir(folder) / TASKS_DIR


def _stem(stage: str, index: int, of: int) -> str:
    return f"{stage}-{index:06d}-of-{of:06d}"


def record_name(stage: str, index: int, of: int) -> str:
    return f"{TASKS_DIR}/{_stem(stage, index, of)}.json"


def record_path(folder: Path, stage: str, index: int, of: int) -> Path:
    return state_dir(folder) / record_name(stage, index, of)


def intake_part_name(index: int, of: int) -> str:
    """The file outcomes intake task ``index`` of ``of`` found (an ``IntakeCache`` parquet)."""
    return f"{TASKS_DIR}/{_stem(INTAKE, index, of)}.parquet"


def intake_part_path(folder: Path, index: int, of: int) -> Path:
    return state_dir(folder) / intake_part_name(index, of)


def intake_parts(folder: Path) -> list[Path]:
    """Every finished intake task's outcomes in ``folder`` (a part without its record is from a
    task killed after writing it: still valid outcomes, but the task is not done)."""
    d = tasks_dir(folder)
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob(f"{INTAKE}-*.parquet") if not is_temp_file(p))


def get_doc(store: Staging, name: str) -> dict | None:
    """The JSON object staged as ``name``; None when there is none; ``StateFileError`` naming it
    when it is damaged (a task or the commit acts on it)."""
    data = store.get(name)
    doc = None if data is None else load_state_doc(data, store.url(name))
    return doc if isinstance(doc, dict) else None


def _record(store: Staging, name: str, stage: str) -> dict | None:
    doc = get_doc(store, name)
    if doc is not None and doc.get("format") == RECORD_FORMAT and doc.get("stage") == stage:
        return doc | {"path": store.url(name)}
    return None


def read_record(store: Staging, stage: str, index: int, of: int) -> dict | None:
    """Task ``index`` of ``of``'s record; None when there is none; ``StateFileError`` naming it
    when it is damaged."""
    return _record(store, record_name(stage, index, of), stage)


def write_record(store: Staging, stage: str, index: int, of: int, doc: dict, what: str = "") -> str:
    """The record, last (where it is: a path or URL)."""
    name = record_name(stage, index, of)
    full = {"format": RECORD_FORMAT, "stage": stage, "index": index, "of": of, **doc}
    store.put(name, json.dumps(full, sort_keys=True, indent=1).encode(), what or f"{stage} task {index} of {of}")
    return store.url(name)


def _names(store: Staging, stage: str) -> list[str]:
    return [f"{TASKS_DIR}/{n}" for n in store.names(TASKS_DIR) if n.startswith(f"{stage}-") and n.endswith(".json")]


def records(store: Staging, stage: str) -> list[dict]:
    """Every readable record of ``stage``, in name order, each with its ``path``."""
    return [r for n in _names(store, stage) if (r := _record(store, n, stage)) is not None]


def clear_records(store: Staging, stage: str) -> int:
    """Remove every record of ``stage``: its tasks run again (each keeping what is still up to
    date) instead of being taken for done. Returns how many were removed."""
    names = _names(store, stage)
    store.delete(*names)
    return len(names)
