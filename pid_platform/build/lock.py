"""One build of an output folder at a time.

Two builds of the same output (``pid-shard`` beside a Dagster run, say) would write into the same
staging folder. Each build step holds an advisory ``flock`` on ``.<name>.pid-lock`` beside the
output; the kernel drops it when the process dies, so a killed build never leaves it stuck.
"""

from __future__ import annotations

import fcntl
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from pid_platform.build.errors import BuildError, OutputNotWritableError
from pid_platform.build.layout import final_dir

F = TypeVar("F", bound=Callable)

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
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _held[path] = (fd, 1)
    try:
        yield
    finally:
        del _held[path]
        os.close(fd)  # closing the descriptor releases the flock


def exclusive(fn: F) -> F:
    """Run ``fn`` holding the build lock of its ``out`` argument."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = sig.bind_partial(*args, **kwargs).arguments["out"]
        with build_lock(out):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
