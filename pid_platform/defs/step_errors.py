"""What a failed step says in the run view and in the run-failure alert.

Dagster stores a step's error as Python formats the exception it caught: ``module.Class:
message``. A ``dg.Failure`` therefore reads ``dagster._core.definitions.events.Failure: ...`` in
the run view, and the cause's ``pid_platform.sharding.errors.X`` follows it. ``step_failure``
raises a ``dg.Failure`` that the run view shows under its cause's own class name
(``FileNotFoundError: ...``, ``ShardingConfigError: ...``), or as ``Failure: ...`` when it has no
cause.

The sharding layer's messages are also read by ``pid-shard`` users, so they advise ``pid-shard``
commands. ``for_the_ui`` rewrites that advice as what an operator in the UI does. The sharding
layer's own text is not changed.
"""

from __future__ import annotations

import functools
import re

import dagster as dg

# What an operator in the UI does instead of the pid-shard commands the sharding layer advises.
LAUNCH_AGAIN = "launch the source_build job for this partition again"
FINISH_TASKS = ("re-execute the run with all steps (Re-execute -> All steps), or launch the source_build job "
                "for this partition")

_BACKTICKED_CLI = r"`pid-shard[^`]*`"
# The most specific pattern comes first. "(or run `pid-shard plan` again)" after UI-worthy advice
# is left out; "run `pid-shard task ...` for I = ..., then commit again" means finish the tasks;
# any other "run `pid-shard ...` (the same ...) again" means build again.
_CLI_ADVICE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\s*\(or (?:run )?" + _BACKTICKED_CLI + r"(?: again| first)?\)"), ""),
    (re.compile(r"\b[Rr]un `pid-shard task[^`]*`(?: for each(?: unfinished I of one N)?| for I = 0 \.\. N-1)?"
                r"(?:, then commit again)?"), FINISH_TASKS),
    (re.compile(r"\b[Rr]un " + _BACKTICKED_CLI
                + r"(?: \(the same --input-dir, --output-dir and settings\))?(?: again| first)?"), LAUNCH_AGAIN),
    (re.compile(_BACKTICKED_CLI), "a new source_build run of this partition"),
)


def for_the_ui(message: str) -> str:
    """``message`` with the ``pid-shard`` commands it advises replaced by what a UI user does."""
    for pattern, advice in _CLI_ADVICE:
        message = pattern.sub(lambda m, a=advice: (a[:1].upper() + a[1:]) if m.group(0)[:1] == "R" else a, message)
    return message


@functools.cache
def _shown_as(name: str) -> type[dg.Failure]:
    # Python prints a class of module "builtins" by its bare name, as it prints FileNotFoundError.
    return type(name, (dg.Failure,), {"__module__": "builtins", "__qualname__": name,
                                      "__doc__": f"A step failure the run view shows as {name}."})


def step_failure(message: str, cause: BaseException | None = None, *, allow_retries: bool = False,
                 metadata: dict | None = None) -> dg.Failure:
    """A ``dg.Failure`` that fails the step at once (unless ``allow_retries``), shown in the run view
    and the alert as ``<cause's class name>: <message>`` (``Failure: <message>`` without a cause),
    with any ``pid-shard`` advice in ``message`` worded for the UI."""
    shown = type(cause).__name__ if cause is not None else "Failure"
    return _shown_as(shown)(description=for_the_ui(message), allow_retries=allow_retries, metadata=metadata)
