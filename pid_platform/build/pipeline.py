"""The whole build of one source, step by step; the Dagster assets call the same steps.

Every step takes the source's output folder ``out`` and works in its staging folder beside it
(``publish.staging_dir``); ``run_manifests`` ends with the commit that publishes it as ``out``.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from loader.formats.atomic import atomic_write_bytes
from loader.formats.wdinfo import root_base
from pid_platform.build import publish
from pid_platform.build.intake import IntakeReport, Sample, intake
from pid_platform.build.layout import STATE_DIR, final_dir
from pid_platform.build.lock import build_lock
from pid_platform.build.manifests import (
    BucketManifest,
    remove_unplanned,
    write_key_indexes,
    write_manifests,
)
from pid_platform.build.plan import ShardingConfig, ShardPlan, plan_shards
from pid_platform.build.storage import SourceStore
from pid_platform.build.tables import read_plans, read_samples, write_plans, write_samples
from pid_platform.build.writer import ShardResult, write_shards

F = TypeVar("F", bound=Callable)


def build_step(fn: F) -> F:
    """Run ``fn`` holding the build lock of its ``out`` argument; if it fails, remove a staging
    folder it left empty (still under the lock, so no other build's staging is touched)."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = sig.bind_partial(*args, **kwargs).arguments["out"]
        with build_lock(out):
            try:
                return fn(*args, **kwargs)
            except BaseException:
                publish.discard_empty_staging(out)
                raise

    return wrapper  # type: ignore[return-value]


def state_dir(folder: Path) -> Path:
    return folder / STATE_DIR


@dataclass
class BucketSummary:
    bucket: str
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    written: int = 0


@dataclass
class BuildSummary:
    source: str
    out: Path
    report: IntakeReport
    buckets: dict[str, BucketSummary] = field(default_factory=dict)
    manifests: list[Path] = field(default_factory=list)
    # Tars, key indexes and manifests of the previous version that the new one dropped.
    removed: list[Path] = field(default_factory=list)

    @property
    def shards(self) -> int:
        return sum(b.shards for b in self.buckets.values())

    @property
    def samples(self) -> int:
        return sum(b.samples for b in self.buckets.values())


def summarize(results: list[ShardResult]) -> dict[str, BucketSummary]:
    buckets: dict[str, BucketSummary] = defaultdict(lambda: BucketSummary(""))
    for r in results:
        b = buckets[r.bucket]
        b.bucket = r.bucket
        b.shards += 1
        b.samples += r.count
        b.bytes += sum(r.bytes.values())
        b.written += int(r.written)
    return dict(sorted(buckets.items()))


@build_step
def run_intake(store: SourceStore, source: str, out: Path, config: ShardingConfig, *, trust_pickle: bool,
               num_workers: int, progress: Callable | None = None,
               force: bool = False) -> tuple[list[Sample], IntakeReport, Path]:
    """``force``: build into a non-empty folder that no build made (its files are kept)."""
    staging = publish.begin(out, first_step=True, force=force)
    samples, report = intake(
        store, source, classify_aspect_ratio=config.classify_aspect_ratio, trust_pickle=trust_pickle,
        num_workers=num_workers, progress=progress,
    )
    path = write_samples(state_dir(staging) / "samples.parquet", samples, report.modalities)
    atomic_write_bytes(state_dir(staging) / "intake_report.json", json.dumps(report.to_json(), indent=1).encode())
    return samples, report, path


@build_step
def run_sharding(store: SourceStore, source: str, out: Path, config: ShardingConfig, *, num_workers: int,
                 progress: Callable[[int, int], None] | None = None) -> tuple[list[ShardPlan], list[ShardResult]]:
    """Write the planned tars into the staging folder, hard-linking those ``out`` already holds."""
    staging = publish.begin(out)
    samples, modalities = read_samples(state_dir(staging) / "samples.parquet")
    plans = plan_shards(samples, modalities, config)
    done = iter(range(1, len(plans) + 1))
    step = (lambda _res: progress(next(done), len(plans))) if progress else None
    results = write_shards(
        store, source, staging, plans, previous=publish.final_dir(out), num_workers=num_workers, progress=step
    )
    write_plans(state_dir(staging) / "plan.parquet", plans, modalities)
    save_sharding_config(staging, config)
    return plans, results


def save_sharding_config(folder: Path, config: ShardingConfig) -> Path:
    """Record the config the tars in ``folder`` were cut with, for steps that run later on their own."""
    path = state_dir(folder) / "sharding.json"
    atomic_write_bytes(path, json.dumps(asdict(config), sort_keys=True, indent=1).encode())
    return path


def load_sharding_config(folder: Path) -> ShardingConfig:
    """The config the tars in ``folder`` (staging or published) were cut with (key indexes,
    manifests and checks must describe the tars that exist, not the config a later run may be
    asking for)."""
    path = state_dir(folder) / "sharding.json"
    try:
        return ShardingConfig(**json.loads(path.read_bytes()))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no sharding recorded in {folder}; materialize twin_tar_shards first"
        ) from None


def load_plans(folder: Path, config: ShardingConfig) -> list[ShardPlan]:
    return read_plans(state_dir(folder) / "plan.parquet", config.part_size)


@build_step
def run_key_indexes(out: Path, *, num_workers: int) -> tuple[ShardingConfig, list[ShardPlan], list[str]]:
    """Key indexes of the staged tars, cut with the config recorded beside them."""
    staging = publish.begin(out)
    config = load_sharding_config(staging)
    plans = load_plans(staging, config)
    return config, plans, write_key_indexes(staging, plans, num_workers=num_workers)


@build_step
def run_manifests(out: Path, source: str, *, num_workers: int,
                  manifest_root: str = "relative") -> tuple[ShardingConfig, list[BucketManifest], list[Path]]:
    """wdinfo.json per bucket into the staging folder, then the commit that publishes it as ``out``.

    ``manifest_root``: ``"relative"`` roots (``"."``), ``"absolute"`` (the published folder's
    absolute path, which PiD's reader needs) or the URL the output is published at (``s3://...``).

    Returns the manifests (at their published paths) and the files of the previous version the
    new one dropped.
    """
    base = root_base(manifest_root, final_dir(out))  # refused before anything is written
    staging = publish.begin(out)
    config = load_sharding_config(staging)
    plans = load_plans(staging, config)
    remove_unplanned(staging, plans)  # an earlier, unfinished build may have left other shards
    manifests = write_manifests(staging, source, plans, num_workers=num_workers, root_base=base)
    removed = publish.commit(out)
    published = [replace(m, path=Path(out) / m.path.relative_to(staging)) for m in manifests]
    return config, published, removed


@build_step
def build_source(
    store: SourceStore, source: str, out: Path, config: ShardingConfig, *, num_workers: int = 1,
    trust_pickle: bool = False, progress: Callable[[int, int], None] | None = None, force: bool = False,
    manifest_root: str = "relative",
) -> BuildSummary:
    """Intake -> twin tars -> key indexes -> wdinfo.json for one source, written under ``out``.

    The Dagster assets put a source under ``<output_root>/<source>``; the CLI writes where told.
    """
    out = Path(out)
    root_base(manifest_root, final_dir(out))  # a bad manifest root is refused before any work
    _, report, _ = run_intake(store, source, out, config, trust_pickle=trust_pickle, num_workers=num_workers,
                              force=force)
    _, results = run_sharding(store, source, out, config, num_workers=num_workers, progress=progress)
    run_key_indexes(out, num_workers=num_workers)
    _, manifests, removed = run_manifests(out, source, num_workers=num_workers, manifest_root=manifest_root)
    return BuildSummary(source, out, report, summarize(results), [m.path for m in manifests], removed)
