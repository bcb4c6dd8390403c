"""One build of an output folder at a time.

Two builds of the same output (``pid-shard`` beside a Dagster run, say) would write into the same
staging folder. Each build step holds an advisory ``flock`` on ``.<name>.pid-lock`` beside the
output; the kernel drops it when the process dies, so a killed build never leaves it stuck.
The file exists only while a build step runs: the holder deletes it before letting go, and a
taker checks that the file it locked is still the one under that name (else it locked a file
a finishing holder had just deleted, and tries again).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pid_platform.build.errors import BuildError, OutputNotWritableError
from pid_platform.build.layout import final_dir

# Steps nest (build_source calls every run_* step): the process keeps one lock per folder.
_held: dict[Path, tuple[int, int]] = {}


class BuildInProgressError(BuildError):
    pass


def lock_path(out: str | os.PathLike[str]) -> Path:
    # Lock what is staged: ``out`` and a link to it stage in one folder, so they share one lock.
    final = final_dir(out)
    return final.parent / f".{final.name}.pid-lock"


@contextmanager
def build_lock(out: str | os.PathLike[str]) -> Iterator[None]:
    path = lock_path(out)
    if path in _held:
        fd, depth = _held[path]
        _held[path] = (fd, depth + 1)
        try:
            yield
        finally:
            fd, depth = _held[path]
            _held[path] = (fd, depth - 1)
        return
    fd = _acquire(path, out)
    _held[path] = (fd, 1)
    try:
        yield
    finally:
        del _held[path]
        # Delete before letting go: a taker that opened the file meanwhile either finds it still
        # locked (and names this build) or, once it holds it, sees the name gone and retries.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)  # closing the descriptor releases the flock


def _acquire(path: Path, out: str | os.PathLike[str]) -> int:
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputNotWritableError(
                f"output folder {out} is not writable ({exc.strerror or exc}); "
                "choose another --output-dir or fix its permissions"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise BuildInProgressError(
                f"another build of {Path(out)} is running (pid {holder}); wait for it to finish. The lock "
                f"is released when that process exits, so {path} never needs deleting by hand"
            ) from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            return fd
        os.close(fd)  # the previous holder deleted this file as we opened it: take the new one
