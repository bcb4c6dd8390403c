"""The one reader of the JSON files a build leaves for another process: task records, the
staged plan's ``staged.json`` and markers, the state files beside a version (``sharding.json``,
``plan_cut.json``, ``intake_report.json`` ...). Each goes through ``loader``'s strict reader,
so a damaged or hostile file is one clear error naming it, never a half-read value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loader.formats.strict_doc import load_json_doc
from pid_platform.sharding.errors import BuildError

# A write record of one task over a whole big source names every shard's digests (~300 bytes
# each, ~100,000 shards): far below this; a manifest of a bucket, likewise.
MAX_STATE_DOC_BYTES = 256 << 20
REBUILD = "rebuild the source (or run `pid-shard plan` again): the build's own files are not read on trust"


class StateFileError(BuildError, ValueError):
    """A file the build wrote for another of its steps is damaged (or not of this format); a
    ``ValueError`` too, as a file that parses but holds the wrong values is."""


def load_state_doc(data: bytes, origin: str | Path, fix: str = REBUILD) -> Any:
    """The JSON value of ``data``, read from ``origin``; ``StateFileError`` naming it otherwise."""
    return load_json_doc(data, str(origin), max_bytes=MAX_STATE_DOC_BYTES, fix=fix, error=StateFileError)


def read_state_doc(path: Path, fix: str = REBUILD) -> Any | None:
    """The JSON value of the file ``path``; None when there is none (missing is not damaged)."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return load_state_doc(data, path, fix)
