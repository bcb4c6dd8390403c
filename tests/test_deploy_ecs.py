"""The cluster configuration resolves: deploy/ecs/dagster.yaml is a valid instance config whose
run launcher is dagster-aws's EcsRunLauncher with a config its schema accepts, the task
definition runs the launcher's container, and the Dockerfile builds the image they name; the
executor files (deploy/ecs/executor.yaml, deploy/celery/executor.yaml) resolve against the
schemas of dagster_aws.ecs.ecs_executor and dagster_celery.celery_executor, and the free-form
parts of them against what ECS's RunTask and Celery take. A misspelled key fails each check.
No AWS call is made (constructing the launcher would describe the task definition)."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from dagster._config import process_config
from dagster._core.instance.config import dagster_instance_config
from dagster._core.launcher import RunLauncher
from dagster_aws.ecs import ecs_executor
from dagster_celery import celery_executor

from pid_platform.defs.executors import EXECUTOR_CONFIG_ENV, ExecutorConfigError, executor_default

REPO = Path(__file__).resolve().parents[1]
ECS = REPO / "deploy" / "ecs"
ENV = {"DAGSTER_PG_HOST": "db.internal", "DAGSTER_PG_USER": "dagster", "DAGSTER_PG_PASSWORD": "pw",
       "DAGSTER_PG_DB": "dagster", "PID_ECS_CLUSTER": "pid-cluster", "PID_ECS_RUN_TASK_FAMILY": "pid-platform-run",
       "PID_CELERY_BROKER": "redis://redis.internal:6379/0", "PID_CELERY_BACKEND": "redis://redis.internal:6379/1"}
EXECUTOR_FILES = {"ecs": (ECS / "executor.yaml", ecs_executor),
                  "celery": (REPO / "deploy" / "celery" / "executor.yaml", celery_executor)}
# One key of each file, misspelled: at the executor's root, and in its free-form part.
MISSPELLED = {"ecs": [(("max_concurrent",), "max_concurent"), (("run_task_kwargs", "launchType"), "launchtype")],
              "celery": [(("broker",), "brokr"), (("config_source", "task_acks_late"), "task_ack_late")]}


@pytest.fixture
def instance_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    shutil.copy(ECS / "dagster.yaml", tmp_path / "dagster.yaml")
    config, _ = dagster_instance_config(str(tmp_path))  # validates against the instance schema
    return config


def test_ecs_instance_config_resolves(instance_config: dict) -> None:
    launcher = instance_config["run_launcher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_aws.ecs", "EcsRunLauncher")
    cls = getattr(importlib.import_module(launcher["module"]), launcher["class"])
    assert issubclass(cls, RunLauncher)
    processed = process_config(cls.config_type(), launcher["config"])
    assert processed.success, processed.errors
    value = processed.value
    assert value["run_task_kwargs"]["cluster"] == "pid-cluster"  # {env: ...} resolved
    assert value["task_definition"] == {"env": "PID_ECS_RUN_TASK_FAMILY"}
    assert value["container_name"] == "run"
    assert instance_config["storage"]["postgres"]["postgres_db"]["hostname"] == {"env": "DAGSTER_PG_HOST"}
    assert instance_config["run_retries"]["enabled"] and instance_config["run_monitoring"]["enabled"]
    # The same pools as the local instance: a cluster never runs a pool unlimited.
    local = yaml.safe_load((REPO / "dagster.yaml").read_text())
    assert instance_config["concurrency"]["pools"] == local["concurrency"]["pools"]


def test_task_definition_runs_the_launchers_container(instance_config: dict) -> None:
    task = json.loads((ECS / "run-task-definition.json").read_text())
    assert task["family"] == ENV["PID_ECS_RUN_TASK_FAMILY"]
    (container,) = task["containerDefinitions"]
    assert container["name"] == instance_config["run_launcher"]["config"]["container_name"]
    assert container["command"][:3] == ["dagster", "api", "execute_run"]
    env = {e["name"]: e["value"] for e in container["environment"]}
    assert env["DAGSTER_HOME"] == "/opt/dagster/home"
    assert "DAGSTER_PG_PASSWORD" not in env  # a secret, not plain config
    assert "FARGATE" in task["requiresCompatibilities"]
    assert instance_config["run_launcher"]["config"]["run_task_kwargs"]["launchType"] == "FARGATE"


def test_dockerfile_builds_the_image_the_deployment_runs() -> None:
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    runs = [line for line in lines if line.startswith("RUN pip install")]
    assert "torch==2.13.0" in runs[0] and ".[platform]" in runs[1]  # CPU torch pinned, first
    assert "ENV" in " ".join(lines) and "DAGSTER_HOME=/opt/dagster/home" in " ".join(lines)
    assert "COPY deploy/ecs/dagster.yaml /opt/dagster/home/dagster.yaml" in lines


def _free_form_problems(name: str, settings: dict) -> list[str]:
    """Keys of the parts the executor's schema takes as any mapping, that their consumer lacks:
    ECS's RunTask parameters (botocore's service model, no call) and Celery's settings."""
    if name == "ecs":
        import botocore.session

        known = set(botocore.session.get_session().get_service_model("ecs").operation_model("RunTask")
                    .input_shape.members)
        given = settings.get("run_task_kwargs", {})
    else:
        from celery.app.defaults import NAMESPACES, flatten

        known = {key for key, _ in flatten(NAMESPACES)}
        given = settings.get("config_source", {})
    return [f"{key!r} is not a setting it takes" for key in given if key not in known]


def _check_executor_file(name: str, doc: dict) -> list[str]:
    _, executor = EXECUTOR_FILES[name]
    assert list(doc) == [name]
    processed = process_config(executor.config_schema.config_type, doc[name])
    return [e.message for e in processed.errors or []] + _free_form_problems(name, doc[name])


@pytest.mark.parametrize("name", sorted(EXECUTOR_FILES))
def test_executor_config_resolves_against_its_schema(name: str, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    for var, value in ENV.items():
        monkeypatch.setenv(var, value)
    path, executor = EXECUTOR_FILES[name]
    doc = yaml.safe_load(path.read_text())
    assert _check_executor_file(name, doc) == []
    value = process_config(executor.config_schema.config_type, doc[name]).value
    if name == "ecs":
        assert value["run_task_kwargs"]["launchType"] == "FARGATE" and value["max_concurrent"] == 8
    else:
        assert value["broker"] == ENV["PID_CELERY_BROKER"]  # {env: ...} resolved
        assert value["config_source"]["task_acks_late"] is True
    # The code location reads the same file (PID_EXECUTOR_CONFIG) and picks its only key.
    assert executor_default({EXECUTOR_CONFIG_ENV: str(path)}) == doc

    # A copy with one key misspelled is refused, naming that key.
    for where, wrong in MISSPELLED[name]:
        bad = yaml.safe_load(path.read_text())
        parent = bad[name]
        for part in where[:-1]:
            parent = parent[part]
        parent[wrong] = parent.pop(where[-1])
        problems = _check_executor_file(name, bad)
        assert problems and wrong in " ".join(problems), (where, problems)
        if len(where) == 1:  # the schema's own keys: the code location's load fails too
            copy = tmp_path / f"{wrong}.yaml"
            copy.write_text(yaml.safe_dump(bad))
            with pytest.raises(ExecutorConfigError, match=wrong):
                executor_default({EXECUTOR_CONFIG_ENV: str(copy)})


def test_the_root_instances_commented_postgres_block_is_the_clusters(instance_config: dict) -> None:
    """The Postgres storage the root dagster.yaml tells a team to add is the one the cluster runs
    (with psycopg2's scheme), so following the comment gives a working shared instance."""
    lines = (REPO / "dagster.yaml").read_text().splitlines()
    start = lines.index("#   storage:")
    block = []
    for line in lines[start:]:
        if line.strip() == "#":
            break
        block.append(line.removeprefix("# "))
    commented = yaml.safe_load("\n".join(block))
    assert commented["storage"] == instance_config["storage"]
    assert commented["storage"]["postgres"]["postgres_db"]["scheme"] == "postgresql+psycopg2"
