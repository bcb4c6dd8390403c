"""Where a run's steps execute: configuration, never a code edit.

Every job of this code location gets one executor, ``pid_executor``, whose config is a choice of
Dagster's own executors, exactly as Dagster's default executor offers ``multiprocess`` or
``in_process``:

* ``multiprocess`` (the default: every step a process on the run's machine, as before),
* ``in_process`` (one process; what ``execute_in_process`` and the demos use),
* ``celery`` (``dagster_celery.celery_executor``: each step a task on a Celery queue; workers on
  any machine that reaches the broker, the instance's storage and the data),
* ``ecs`` (``dagster_aws.ecs.ecs_executor``: each step its own ECS task; the run must itself run
  on ECS through the ``EcsRunLauncher``, deploy/ecs/).

Each key takes that executor's own settings, unchanged. Which one a run uses:

1. the run's config, ``execution: config: {celery: {...}}`` (launchpad, schedules, sensors), else
2. the code location's default, read when it loads: ``PID_EXECUTOR_CONFIG`` names a YAML file
   holding one of those keys with its settings (``deploy/ecs/executor.yaml``,
   ``deploy/celery/executor.yaml``), and ``PID_EXECUTOR=multiprocess|in_process|celery|ecs`` picks
   the key (the file's only key when unset; ``multiprocess`` with no file). A bad name or a
   setting the executor's schema refuses fails the load, naming the file. The file is read by
   the one strict reader (``loader.formats.strict_doc``: a regular file of at most 64 KiB, no
   anchors, aliases or tags, nesting bounded), so a hostile one is an ``ExecutorConfigError``
   naming it in milliseconds, never a hang or gigabytes of memory in every process that loads
   the code location.

A run of a small source (``small_sources.py``: raw files under ``PID_IN_PROCESS_BELOW_MB``)
that would use ``multiprocess`` runs its steps in one process instead, as ``in_process`` runs
them: a UI re-shard of a few MiB takes seconds, not a process start per step.

(``dagster_k8s.k8s_job_executor`` plugs in the same way; it is not a dependency here: README.)
Pools (``pools.py``) cap concurrent steps whatever the executor: the multiprocess, Celery and
ECS executors all take a pool's slot from the instance before they start a step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg
from dagster._config import process_config
from dagster._core.definitions.executor_definition import (
    ExecutorRequirement,
    in_process_executor,
    multiple_process_executor_requirements,
    multiprocess_executor,
)
from dagster._core.execution.retries import RetryMode
from dagster._core.executor.base import Executor
from dagster._core.executor.in_process import InProcessExecutor
from dagster._core.executor.init import InitExecutorContext
from dagster_aws.ecs import ecs_executor
from dagster_celery import celery_executor

from loader.formats.errors import short_repr
from loader.formats.strict_doc import load_yaml_doc, read_local_doc
from pid_platform.defs.small_sources import (
    IN_PROCESS_BELOW_ENV,
    in_process_below_bytes,
    runs_in_one_process,
)

EXECUTOR_ENV = "PID_EXECUTOR"
EXECUTOR_CONFIG_ENV = "PID_EXECUTOR_CONFIG"
DEFAULT_EXECUTOR = "multiprocess"
MAX_EXECUTOR_CONFIG_BYTES = 64 * 1024  # an executor's settings are a screenful

EXECUTORS: dict[str, dg.ExecutorDefinition] = {
    "multiprocess": multiprocess_executor,
    "in_process": in_process_executor,
    "celery": celery_executor,
    "ecs": ecs_executor,
}


class ExecutorConfigError(ValueError):
    """``PID_EXECUTOR`` / ``PID_EXECUTOR_CONFIG`` name an unknown executor or settings it refuses."""


def _choice_schema() -> dg.Selector:
    return dg.Selector({name: ex.config_schema.as_field() for name, ex in EXECUTORS.items()})


def executor_default(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{name: settings}``: the executor config a run gets when its own config has none."""
    env = os.environ if environ is None else environ
    path = env.get(EXECUTOR_CONFIG_ENV)
    where = f"{EXECUTOR_CONFIG_ENV}={path}" if path else EXECUTOR_ENV
    from_file: dict[str, Any] = {}
    if path:
        fix = f"fix the file or unset {EXECUTOR_CONFIG_ENV}"
        data = read_local_doc(Path(path), max_bytes=MAX_EXECUTOR_CONFIG_BYTES, fix=fix, error=ExecutorConfigError)
        doc = load_yaml_doc(data, where, max_bytes=MAX_EXECUTOR_CONFIG_BYTES, fix=fix,
                            error=ExecutorConfigError)
        from_file = doc if doc is not None else {}
        if not isinstance(from_file, dict) or not all(k in EXECUTORS for k in from_file):
            found = sorted(from_file) if isinstance(from_file, dict) else f"a {type(from_file).__name__}"
            raise ExecutorConfigError(f"{where}: expected one of {sorted(EXECUTORS)} as the top key, each "
                                      f"holding that executor's settings; found {short_repr(found, 200)}")
    name = env.get(EXECUTOR_ENV) or (next(iter(from_file)) if len(from_file) == 1 else DEFAULT_EXECUTOR)
    if name not in EXECUTORS:
        raise ExecutorConfigError(f"{EXECUTOR_ENV}={name!r}: not an executor here; use one of {sorted(EXECUTORS)}")
    chosen = {name: from_file.get(name) or {}}
    # Checked now, so a typo fails the load and not the first run; the default keeps its
    # {env: NAME} references (resolved per run), which must be set where the code location loads.
    checked = process_config(_choice_schema(), chosen)
    if not checked.success:
        raise ExecutorConfigError(f"{where}: the {name} executor refuses these settings: "
                                  + "; ".join(e.message for e in checked.errors))
    return chosen


def _requirements(config: Mapping[str, Any]) -> list[ExecutorRequirement]:
    # Only one process needs no reconstructable job nor persistent instance (execute_in_process).
    return [] if "in_process" in config else list(multiple_process_executor_requirements())


# A step's end: where a run in one process checks whether it was asked to stop.
_STEP_ENDS = frozenset({"STEP_SUCCESS", "STEP_FAILURE", "STEP_UP_FOR_RETRY", "STEP_SKIPPED"})


def _until_terminated(plan_context, events):  # noqa: ANN001, ANN202 (Dagster's own types)
    """``events`` of a run in one process, ended at the first step end after Terminate.

    Terminate interrupts the running step; Dagster then honours the step's retry policy (an
    interrupt is retried, as a lost worker would be), so without this the run would sit in
    Canceling through the retries' waits. The multiprocess executor stops launching steps on
    Terminate; this does the same for one process."""
    from dagster._core.errors import DagsterExecutionInterruptedError

    run_id = plan_context.dagster_run.run_id
    for event in events:
        yield event
        if event.event_type_value in _STEP_ENDS and (
                plan_context.instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.CANCELING):
            events.close()
            raise DagsterExecutionInterruptedError("the run was terminated; no further step starts")


class SmallSourcesInOneProcess(Executor):
    """``multiprocess``, except for a run of a small source: its steps run in this process."""

    def __init__(self, multiprocess: Executor) -> None:
        self._multiprocess = multiprocess
        self._in_process = InProcessExecutor(retries=multiprocess.retries,
                                             step_dependency_config=multiprocess.step_dependency_config)

    @property
    def retries(self) -> RetryMode:
        return self._multiprocess.retries

    def execute(self, plan_context, execution_plan):  # noqa: ANN001, ANN201 (Dagster's own signature)
        from dagster._core.events import DagsterEvent, EngineEventData

        run = plan_context.dagster_run
        if runs_in_one_process(run.tags):
            yield DagsterEvent.engine_event(
                plan_context,
                f"{run.tags.get('dagster/partition')}: a small source (raw files under {IN_PROCESS_BELOW_ENV}); "
                "its steps run in this process, one after another",
                event_specific_data=EngineEventData(),
            )
            yield from _until_terminated(plan_context, self._in_process.execute(plan_context, execution_plan))
        else:
            yield from self._multiprocess.execute(plan_context, execution_plan)


def pid_executor(environ: Mapping[str, str] | None = None) -> dg.ExecutorDefinition:
    """The executor of every job here, its default chosen from ``environ`` (see the module doc)."""
    default = executor_default(environ)
    in_process_below_bytes(environ)  # a bad PID_IN_PROCESS_BELOW_MB fails the load, named

    def create(init_context: InitExecutorContext) -> dg.Executor:
        ((name, settings),) = init_context.executor_config.items()
        chosen = EXECUTORS[name]
        created = chosen.executor_creation_fn(InitExecutorContext(  # ty: ignore[call-non-callable]
            job=init_context.job, executor_def=chosen, executor_config=settings, instance=init_context.instance))
        return SmallSourcesInOneProcess(created) if name == "multiprocess" else created

    return dg.ExecutorDefinition(
        name="pid_executor",
        config_schema=dg.Field(_choice_schema(), default_value=default),
        executor_creation_fn=create,
        requirements=_requirements,
        description="Dagster's multiprocess, in-process, Celery or ECS executor, chosen by the run's config "
                    f"or the code location's ({EXECUTOR_ENV}, {EXECUTOR_CONFIG_ENV}); default here: {next(iter(default))}.",
    )
