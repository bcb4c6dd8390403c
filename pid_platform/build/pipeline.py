"""The whole build of one source, step by step; the Dagster assets call the same steps."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loader.formats.atomic import atomic_write_bytes
from pid_platform.build.intake import IntakeReport, Sample, intake
from pid_platform.build.layout import STATE_DIR, ensure_writable
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


def state_dir(out: Path) -> Path:
    return out / STATE_DIR


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


def run_intake(store: SourceStore, source: str, out: Path, config: ShardingConfig, *, trust_pickle: bool,
               num_workers: int, progress: Callable | None = None) -> tuple[list[Sample], IntakeReport, Path]:
    ensure_writable(out)
    samples, report = intake(
        store, source, classify_aspect_ratio=config.classify_aspect_ratio, trust_pickle=trust_pickle,
        num_workers=num_workers, progress=progress,
    )
    path = write_samples(state_dir(out) / "samples.parquet", samples, report.modalities)
    atomic_write_bytes(state_dir(out) / "intake_report.json", json.dumps(report.to_json(), indent=1).encode())
    return samples, report, path


def run_sharding(store: SourceStore, source: str, out: Path, config: ShardingConfig, *, num_workers: int,
                 progress: Callable[[int, int], None] | None = None) -> tuple[list[ShardPlan], list[ShardResult]]:
    samples, modalities = read_samples(state_dir(out) / "samples.parquet")
    plans = plan_shards(samples, modalities, config)
    done = iter(range(1, len(plans) + 1))
    step = (lambda _res: progress(next(done), len(plans))) if progress else None
    results = write_shards(store, source, out, plans, num_workers=num_workers, progress=step)
    write_plans(state_dir(out) / "plan.parquet", plans, modalities)
    return plans, results


def save_sharding_config(out: Path, config: ShardingConfig) -> Path:
    """Record the config the tars on disk were cut with, for steps that run later on their own."""
    path = state_dir(out) / "sharding.json"
    atomic_write_bytes(path, json.dumps(asdict(config), sort_keys=True, indent=1).encode())
    return path


def load_sharding_config(out: Path) -> ShardingConfig:
    """The config of the last completed sharding of ``out`` (key indexes, manifests and checks
    must describe the tars that exist, not the config a later run may be asking for)."""
    path = state_dir(out) / "sharding.json"
    try:
        return ShardingConfig(**json.loads(path.read_bytes()))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no sharding recorded for {out}; materialize twin_tar_shards first"
        ) from None


def load_plans(out: Path, config: ShardingConfig) -> list[ShardPlan]:
    return read_plans(state_dir(out) / "plan.parquet", config.part_size)


def run_manifests(out: Path, source: str, plans: list[ShardPlan], *, num_workers: int) -> tuple[list[BucketManifest], list[Path]]:
    manifests = write_manifests(out, source, plans, num_workers=num_workers)
    removed = remove_unplanned(out, plans)
    return manifests, removed


def build_source(
    store: SourceStore, source: str, out: Path, config: ShardingConfig, *, num_workers: int = 1,
    trust_pickle: bool = False, progress: Callable[[int, int], None] | None = None,
) -> BuildSummary:
    """Intake -> twin tars -> key indexes -> wdinfo.json for one source, written under ``out``.

    The Dagster assets put a source under ``<output_root>/<source>``; the CLI writes where told.
    """
    out = Path(out)
    _, report, _ = run_intake(store, source, out, config, trust_pickle=trust_pickle, num_workers=num_workers)
    plans, results = run_sharding(store, source, out, config, num_workers=num_workers, progress=progress)
    write_key_indexes(out, plans, num_workers=num_workers)
    manifests, removed = run_manifests(out, source, plans, num_workers=num_workers)
    return BuildSummary(source, out, report, summarize(results), [m.path for m in manifests], removed)
