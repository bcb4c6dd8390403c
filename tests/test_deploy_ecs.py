"""The cluster configuration resolves: deploy/ecs/dagster.yaml is a valid instance config whose
run launcher is dagster-aws's EcsRunLauncher with a config its schema accepts, the task
definition runs the launcher's container, and the Dockerfile builds the image they name.
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

REPO = Path(__file__).resolve().parents[1]
ECS = REPO / "deploy" / "ecs"
ENV = {"DAGSTER_PG_HOST": "db.internal", "DAGSTER_PG_USER": "dagster", "DAGSTER_PG_PASSWORD": "pw",
       "DAGSTER_PG_DB": "dagster", "PID_ECS_CLUSTER": "pid-cluster", "PID_ECS_RUN_TASK_FAMILY": "pid-platform-run"}


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
