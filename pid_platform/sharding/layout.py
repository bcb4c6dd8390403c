"""Where a source's build output lives."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from loader.formats.layout import STATE_DIR
from pid_platform.sharding.errors import OutputNotWritableError

__all__ = [
    "PROBE_PREFIX", "STATE_DIR", "bucket_dir", "ensure_writable", "final_dir", "sha_cache_path", "stamp_path",
]

PROBE_PREFIX = ".write-probe-"


def final_dir(out: str | os.PathLike[str]) -> Path:
    """The folder a build of ``out`` publishes, stages beside and locks.

    Absolute, so that "." has a name and a parent; a linked output folder is published where
    the link points (renaming the link itself would move the output away from its target), so
    ``out`` and a link to it are one output: one staging folder, one lock.
    """
    path = Path(os.path.abspath(out))
    return path.resolve() if path.is_symlink() else path


def bucket_dir(out: Path, bucket: str) -> Path:
    return out / bucket if bucket else out


def stamp_path(out: Path, bucket: str, index: int) -> Path:
    return out / STATE_DIR / "stamps" / (bucket or "_flat") / f"{index:06d}.json"


def sha_cache_path(out: Path, bucket: str, index: int) -> Path:
    return out / STATE_DIR / "sha256" / (bucket or "_flat") / f"{index:06d}.json"


def ensure_writable(out: str | os.PathLike[str], *, shown_as: Path | None = None) -> Path:
    """Create ``out`` and prove a file can be written there, before any work starts.

    ``shown_as`` is the folder the error names (the output folder the user chose, when ``out``
    is the build's staging folder beside it).
    """
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputNotWritableError(
            f"output folder {shown_as or out} is not writable ({exc.strerror or exc}); "
            "choose another --output-dir or fix its permissions"
        ) from None
    return out
