"""Commit points: a file appears under its final name only when complete."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

TMP_MARKER = ".tmp-"


def temp_name(final: Path) -> Path:
    # The pid keeps two concurrent writers of one file from sharing a temporary file.
    return final.with_name(f"{final.name}{TMP_MARKER}{os.getpid()}")


@contextlib.contextmanager
def atomic_writer(final: str | os.PathLike[str], *, durable: bool = True) -> Iterator[BinaryIO]:
    """Open a temporary sibling of ``final``; on success fsync and rename it into place.

    On any exception the temporary file is removed and ``final`` is left untouched.
    ``durable=False`` skips the fsync, for callers that make a whole batch durable at once at
    their own commit point (a crashed *process* never loses page-cache data, only power loss does).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    try:
        with open(tmp, "wb") as fh:
            yield fh
            fh.flush()
            if durable:
                os.fsync(fh.fileno())  # the bytes are on disk before the name says "complete"
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(final: str | os.PathLike[str], data: bytes) -> None:
    with atomic_writer(final) as fh:
        fh.write(data)


def is_temp_file(path: str | os.PathLike[str]) -> bool:
    return TMP_MARKER in Path(path).name


def remove_stale_temp_files(root: str | os.PathLike[str]) -> list[Path]:
    """Delete temporary files a crashed writer left behind under ``root``."""
    removed: list[Path] = []
    root = Path(root)
    if not root.exists():
        return removed
    for dirpath, _dirs, files in os.walk(root):
        for name in sorted(files):
            if TMP_MARKER in name:
                p = Path(dirpath) / name
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p)
    return removed
