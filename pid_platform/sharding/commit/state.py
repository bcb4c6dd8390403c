"""What a build records beside its output, and whether a new build would reproduce it.

A rebuild that finds the same samples, the same intake report and the same settings as the
committed version, and that version's files intact, has nothing to write: it stops early
("up to date") instead of staging a copy of what is published.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from loader.formats.atomic import atomic_write_bytes
from loader.formats.twin_tar import file_sha256, key_index_relpath
from loader.formats.wdinfo import WDINFO_NAME
from pid_platform.sharding.errors import ShardingConfigError
from pid_platform.sharding.intake.cache import RULES_VERSION
from pid_platform.sharding.intake.report import IntakeReport
from pid_platform.sharding.layout import state_dir
from pid_platform.sharding.plan.columnar import ShardRef
from pid_platform.sharding.plan.plan_files import load_shards
from pid_platform.sharding.plan.shard_plan import ShardingConfig, ShardPlan
from pid_platform.sharding.state_doc import load_state_doc, read_state_doc
from pid_platform.sharding.write.tars import shard_up_to_date

INTAKE_SETTINGS = "intake.json"  # how the samples were validated
OUTPUTS = "outputs.json"  # sha256 of every key index and manifest, as committed
SAMPLES = "samples.parquet"
REPORT = "intake_report.json"
FINGERPRINT = "input_fingerprint.json"  # the raw listing a staged build was made from (defs/automation)
SHARDING = "sharding.json"


def intake_settings(validate: str) -> dict:
    """The settings that decide which samples a source yields (beside the sharding config)."""
    return {"rules_version": RULES_VERSION, "validate": validate}


def save_intake_settings(folder: Path, validate: str) -> Path:
    path = state_dir(folder) / INTAKE_SETTINGS
    atomic_write_bytes(path, json.dumps(intake_settings(validate), sort_keys=True, indent=1).encode())
    return path


def load_intake_settings(folder: Path) -> dict | None:
    return read_state_doc(state_dir(folder) / INTAKE_SETTINGS)


def _outputs_of(plans: Sequence[ShardPlan | ShardRef]) -> list[str]:
    """Key indexes and manifests of ``plans``, relative to the output folder (tars have stamps)."""
    # Strings joined as bucket_dir joins them (no Path per shard: a big source has ~100,000 shards).
    def under(bucket: str, rel: str) -> str:
        return f"{bucket}/{rel}" if bucket else rel

    rels = [under(p.bucket, key_index_relpath(p.relpath)) for p in plans]
    rels += [under(b, WDINFO_NAME) for b in sorted({p.bucket for p in plans})]
    return sorted(rels)


def save_outputs(folder: Path, plans: Sequence[ShardPlan | ShardRef]) -> Path:
    """Record the checksums of the key indexes and manifests in ``folder`` (just before its commit)."""
    root = os.fspath(folder)
    doc = {rel: file_sha256(os.path.join(root, rel)) for rel in _outputs_of(plans)}
    path = state_dir(folder) / OUTPUTS
    atomic_write_bytes(path, json.dumps(doc, sort_keys=True, indent=0).encode())
    return path


def refresh_outputs(folder: Path, rels: list[str]) -> None:
    """Record new checksums for ``rels`` (files of ``folder`` changed on purpose after its commit,
    such as manifests whose roots were rewritten), so the version still counts as intact."""
    path = state_dir(folder) / OUTPUTS
    recorded = read_state_doc(path)
    if not isinstance(recorded, dict):
        return  # no record (not a build's output, or an older one): nothing to keep in step
    fresh = {**recorded, **{rel: file_sha256(folder / rel) for rel in rels if rel in recorded}}
    if fresh != recorded:
        atomic_write_bytes(path, json.dumps(fresh, sort_keys=True, indent=0).encode())


def _outputs_intact(folder: Path, plans: Sequence[ShardPlan | ShardRef]) -> bool:
    try:
        recorded = read_state_doc(state_dir(folder) / OUTPUTS)
        if not isinstance(recorded, dict) or sorted(recorded) != _outputs_of(plans):
            return False
        return all(file_sha256(folder / rel) == sha for rel, sha in recorded.items())
    except (OSError, ValueError, AttributeError):
        return False


def committed_up_to_date(
    final: Path, samples: pa.Table, report: IntakeReport, config: ShardingConfig, validate: str
) -> bool:
    """Whether the version published in ``final`` is what a build of ``samples`` (the samples
    table an intake made; with this
    report, config and validation level) would publish, and its files are as it wrote them:
    every tar matches its stamp, every key index and manifest its recorded checksum."""
    state = state_dir(final)
    try:
        if ShardingConfig(**load_state_doc((state / SHARDING).read_bytes(), state / SHARDING)) != config:
            return False
        if load_intake_settings(final) != intake_settings(validate):
            return False
        if read_state_doc(state / REPORT) != report.to_json():
            return False
        committed = pq.read_table(state / SAMPLES)
    except (OSError, ValueError, TypeError, ShardingConfigError):
        return False
    if not committed.equals(samples):
        return False
    # The same samples and settings give the same plan, and a plan that modalities were added to
    # stays the plan while the samples stay (both checked above): the committed one, a row a shard.
    plans = load_shards(final, config)
    return all(shard_up_to_date(final, p) for p in plans) and _outputs_intact(final, plans)
