"""Retries of the steps that read or write storage.

Every such step retries a failure a few times with growing waits: a network blip, a throttled
bucket or a busy disk heal on a later try, and each step is safe to repeat (a build stages its
output and commits it atomically, a sidecar is replaced atomically). A failure that a retry
cannot heal (bad input, a wrong setting, a file an earlier step should have left) is raised as
a final ``dg.Failure`` (``step_errors.step_failure``), the original error as its cause, so the
run fails at once with that error's class name and message. The build assets use ``retry_only_transient``: only an I/O error a
later try can heal (``is_transient``) is left to the retry policy.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

from pid_platform.defs.step_errors import step_failure
from pid_platform.sharding.errors import BuildError

IO_RETRY = dg.RetryPolicy(max_retries=3, delay=10, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS)

# What a retry cannot change: the build's own named errors (bad or missing input, unsafe data,
# an output it may not write), ValueError, which the readers raise for malformed files and the
# resources for bad names and settings, and a tar that does not parse.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (BuildError, ValueError, tarfile.TarError)


@contextmanager
def fail_without_retry_on(*errors: type[BaseException]) -> Iterator[None]:
    """Inside an asset or check: turn ``errors`` (default ``PERMANENT_ERRORS``) into a final failure."""
    final: tuple[type[BaseException], ...] = errors or PERMANENT_ERRORS
    try:
        yield
    except final as exc:
        raise step_failure(str(exc), exc) from exc


# OSErrors that stay what they are on the next try: a missing file stays missing (an earlier step
# was not run), a refused permission stays refused.
LASTING_OS_ERRORS: tuple[type[OSError], ...] = (
    FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError,
)


def is_transient(exc: BaseException) -> bool:
    """An I/O error a retry may heal (a network blip, a throttled bucket, a busy disk); never a
    build error (a source file changed since the plan is an ``OSError`` too, and stays changed)."""
    return isinstance(exc, OSError) and not isinstance(exc, (*LASTING_OS_ERRORS, BuildError))


@contextmanager
def retry_only_transient() -> Iterator[None]:
    """Inside an asset: every error but a transient I/O error fails the step at once, unretried."""
    try:
        yield
    except (dg.Failure, dg.RetryRequested):
        raise
    except Exception as exc:
        if is_transient(exc):
            raise
        raise step_failure(str(exc), exc) from exc
