"""Where a source's build output lives."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from loader.formats.atomic import atomic_writer
from loader.formats.layout import STATE_DIR
from pid_platform.sharding.errors import OutputNotWritableError

PROBE_PREFIX = ".write-probe-"


def final_dir(out: str | os.PathLike[str]) -> Path:
    """The folder a build of ``out`` publishes, stages beside and locks.

    Absolute, so that "." has a name and a parent; a linked output folder is published where
    the link points (renaming the link itself would move the output away from its target), so
    ``out`` and a link to it are one output: one staging folder, one lock.
    """
    path = Path(os.path.abspath(out))
    return path.resolve() if path.is_symlink() else path


def state_dir(folder: str | os.PathLike[str]) -> Path:
    """The build's private state folder inside ``folder`` (a staged or published build)."""
    return Path(folder) / STATE_DIR


def bucket_dir(out: Path, bucket: str) -> Path:
    return out / bucket if bucket else out


def stamp_path(out: Path, bucket: str, index: int) -> Path:
    return out / STATE_DIR / "stamps" / (bucket or "_flat") / f"{index:06d}.json"


def sha_cache_path(out: Path, bucket: str, index: int) -> Path:
    return out / STATE_DIR / "sha256" / (bucket or "_flat") / f"{index:06d}.json"


def write_staged_state(path: Path, data: bytes) -> None:
    """Write a per-shard state file (stamp, checksum cache) of a staging folder, atomically but
    without its own fsync.

    The commit fsyncs every file of the staging folder before it publishes it, and on ext4 an
    fsync here would also wait for the journal to flush the tars being written beside it. A
    crash before the commit leaves such a file old, missing or empty; each only makes the next
    build rewrite or hash that shard again (a stamp records its tars' size, which a tar whose
    bytes were lost no longer has).
    """
    with atomic_writer(path, durable=False) as fh:
        fh.write(data)


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
        raise not_writable(shown_as or out, exc) from None
    return out


def not_writable(out: str | os.PathLike[str], exc: OSError) -> OutputNotWritableError:
    return OutputNotWritableError(f"output folder {out} is not writable ({exc.strerror or exc}); "
                                  "choose another --output-dir or fix its permissions")
