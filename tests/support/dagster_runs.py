"""Helpers shared by the Dagster tests (this module holds no tests).

Every test runs against a real temporary Dagster instance; the Definitions are loaded the way the
UI loads them (``pid_platform.definitions.defs``), with the raw and output roots taken from the
environment as in production.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml

from pid_platform.defs.partitions import SOURCES

SOURCE_ASSETS = ("sample_set", "twin_tar_shards", "key_indexes", "wdinfo_manifests")


def use_roots(monkeypatch: pytest.MonkeyPatch, raw_root: Path, out_root: Path) -> None:
    monkeypatch.setenv("PID_RAW_ROOT", str(raw_root))
    monkeypatch.setenv("PID_OUTPUT_ROOT", str(out_root))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)


@pytest.fixture
def out_root(tmp_path: Path, raw_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh output root, with the code location pointed at ``raw_root`` and it."""
    out = tmp_path / "out"
    use_roots(monkeypatch, raw_root, out)
    return out


@contextmanager
def dagster_instance() -> Iterator[dg.DagsterInstance]:
    """A real, empty Dagster instance with in-memory storage.

    The sqlite storage of ``instance_for_test`` spends seconds per run in fsync on a busy CI
    disk; the demo's test covers that storage. ``instance_for_test`` still wraps it, so whatever
    looks up the default instance (a Definitions load) finds a temporary one, not ``~``.
    """
    with dg.instance_for_test(), dg.DagsterInstance.ephemeral() as instance:
        yield instance


def load_defs() -> dg.Definitions:
    """Call inside ``dagster_instance()``: loading after a materialize wants a test instance."""
    from pid_platform.definitions import defs

    return defs()


def run_config(**sharding: Any) -> dict:
    # One worker: the CI machine has two cores and these sources are tiny.
    return {"resources": {"sharding": {"config": {"num_workers": 1, **sharding}}}}


def launchpad_config(defs: dg.Definitions, job: str = "source_build", **sharding: Any) -> dict:
    """The run config the UI's launchpad pre-fills for ``job`` (the webserver's ``rootDefaultYaml``:
    every default of the config schema), with the operator's edits of the ``sharding`` resource
    applied on top, as they would be typed into it."""
    from dagster._core.snap.snap_to_yaml import default_values_yaml_from_type_snap

    snapshot = defs.resolve_job_def(job).get_job_snapshot()
    schema = snapshot.config_schema_snapshot
    root = schema.get_config_snap(snapshot.mode_def_snaps[0].root_config_key)
    config = yaml.safe_load(default_values_yaml_from_type_snap(schema, root)) or {}
    if sharding:
        config.setdefault("resources", {}).setdefault("sharding", {}).setdefault("config", {}).update(sharding)
    return config


def build_source(
    defs: dg.Definitions, instance: dg.DagsterInstance, source: str, tags: dict[str, str] | None = None,
    **sharding: Any,
) -> dg.ExecuteInProcessResult:
    if source not in instance.get_dynamic_partitions(SOURCES):
        instance.add_dynamic_partitions(SOURCES, [source])
    return defs.resolve_job_def("source_build").execute_in_process(
        instance=instance, partition_key=source, run_config=run_config(**sharding), tags=tags,
        raise_on_error=False,
    )


def build_catalog(defs: dg.Definitions, instance: dg.DagsterInstance, **sharding: Any) -> dg.ExecuteInProcessResult:
    return defs.resolve_job_def("catalog_build").execute_in_process(
        instance=instance, run_config=run_config(**sharding), raise_on_error=False
    )


def evaluate_sensor(defs: dg.Definitions, instance: dg.DagsterInstance, cursor: str | None, **resources) -> dg.SensorResult:
    sensor = defs.resolve_sensor_def("raw_sources_sensor")
    # The daemon hands the sensor the code location's resources; so does this test.
    with dg.build_sensor_context(
        instance=instance, cursor=cursor, definitions=defs, resources={**defs.resources, **resources}
    ) as context:
        result = sensor(context)
    assert isinstance(result, dg.SensorResult)
    return result


def evaluate_schedule(defs: dg.Definitions, instance: dg.DagsterInstance, when: Any, **resources) -> Any:
    """The daily schedule's evaluation at ``when``, with the code location's resources."""
    schedule = defs.resolve_schedule_def("daily_source_rebuild")
    with dg.build_schedule_context(instance=instance, scheduled_execution_time=when,
                                   resources={**defs.resources, **resources}) as context:
        return schedule(context)


def apply_partition_requests(instance: dg.DagsterInstance, result: dg.SensorResult) -> list[str]:
    """What the sensor daemon does with a result's partition requests; returns the added keys."""
    added = []
    for request in result.dynamic_partitions_requests or []:
        assert isinstance(request, dg.AddDynamicPartitionsRequest) and request.partitions_def_name == SOURCES
        instance.add_dynamic_partitions(SOURCES, list(request.partition_keys))
        added += request.partition_keys
    return added


def materialized(result: dg.ExecuteInProcessResult) -> dict[str, dict[str, Any]]:
    """Asset name -> its metadata as plain values."""
    out = {}
    for event in result.get_asset_materialization_events():
        mat = event.materialization
        out[mat.asset_key.to_user_string()] = {k: _plain(v) for k, v in mat.metadata.items()}
    return out


def observed(result: dg.ExecuteInProcessResult) -> dict[str, dict[str, Any]]:
    """Asset name -> the metadata of its observation (an asset that found nothing to do)."""
    out = {}
    for event in result.all_events:
        if event.event_type == dg.DagsterEventType.ASSET_OBSERVATION:
            obs = event.asset_observation_data.asset_observation
            out[obs.asset_key.to_user_string()] = {k: _plain(v) for k, v in obs.metadata.items()}
    return out


def step_node(step_key: str) -> str:
    """The asset (or check) a step belongs to: ``twin_tar_shards`` runs as the steps
    ``twin_tar_shards.plan``, ``twin_tar_shards.write_task[0_of_3]``, ... and ``twin_tar_shards.collect``."""
    return step_key.split(".", 1)[0]


def skipped_steps(result: dg.ExecuteInProcessResult) -> set[str]:
    """The assets and checks whose steps were skipped."""
    return {step_node(e.step_key) for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_SKIPPED}


def check_outcomes(result: dg.ExecuteInProcessResult) -> dict[str, bool]:
    return {e.check_name: e.passed for e in result.get_asset_check_evaluations()}


def check_metadata(result: dg.ExecuteInProcessResult, name: str) -> dict[str, Any]:
    for e in result.get_asset_check_evaluations():
        if e.check_name == name:
            return {k: _plain(v) for k, v in e.metadata.items()}
    raise KeyError(name)


def manifests(out: Path) -> dict[str, dict]:
    """Bucket folder -> parsed wdinfo.json, for every manifest under a source's output."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(out.rglob("wdinfo.json"))}


def tars(out: Path) -> set[Path]:
    return {p for p in out.rglob("*.tar") if ".pid-build" not in p.parts}


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, dg.MetadataValue) else value
