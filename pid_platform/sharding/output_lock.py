"""One build of an output folder at a time.

Two builds of the same output (``pid-shard`` beside a Dagster run, say) would write into the same
staging folder. Each build step holds an advisory ``flock`` on ``.<name>.pid-lock`` beside the
output; the kernel drops it when the process dies, so a killed build never leaves it stuck.
The file exists only while a build step runs: the holder deletes it before letting go, and a
taker checks that the file it locked is still the one under that name (else it locked a file
a finishing holder had just deleted, and tries again).

A Dagster run holds its output from its first step to its end (``run_hold.py``); a build of any
other process is refused while that hold is live, before it takes the lock.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

from loader.formats.layout import lock_name
from loader.io.flock import flock_held, read_lock_holder
from pid_platform.sharding.commit.held import OncePerProcess
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.layout import final_dir, not_writable
from pid_platform.sharding.run_hold import refuse_if_held

_held = OncePerProcess()  # lock file -> None


class BuildInProgressError(BuildError):
    pass


def lock_path(out: str | os.PathLike[str]) -> Path:
    # Lock what is staged: ``out`` and a link to it stage in one folder, so they share one lock.
    final = final_dir(out)
    return final.parent / lock_name(final.name)


def build_lock(out: str | os.PathLike[str]) -> AbstractContextManager[None]:
    """Hold the build lock of ``out`` for the block (nested holds in one process share it)."""
    path = lock_path(out)
    return _held.hold(path, lambda: _locked(out, path))


@contextmanager
def _locked(out: str | os.PathLike[str], path: Path) -> Iterator[None]:
    def in_progress() -> BuildInProgressError:
        holder = read_lock_holder(path)[:64] or "unknown"
        return BuildInProgressError(
            f"another build of {Path(out)} is running (pid {holder}); wait for it to finish. The lock "
            f"is released when that process exits, so {path} never needs deleting by hand"
        )

    # No waiting: a second build stops at once.
    with ExitStack() as stack:
        try:
            stack.enter_context(flock_held(path, holder=str(os.getpid()), busy=in_progress, timeout_s=0, remove=True))
        except OSError as exc:
            raise not_writable(out, exc) from None
        # Checked holding the lock: a run's step takes its hold before the lock, so a step that
        # starts after this check finds the lock taken, and one that started before is seen here.
        refuse_if_held(out)  # a Dagster run holds the output between its steps too
        yield
