"""The whole build of one source, step by step; the Dagster assets call the same steps.

Every step takes the source's output folder ``out`` and works in its staging folder beside it
(``versions.staging_dir``); the commit that publishes it as ``out`` is ``tasks.commit``'s.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import pyarrow as pa

from loader.formats.atomic import atomic_write_bytes
from loader.formats.errors import FormatError
from pid_platform.sharding.commit import versions
from pid_platform.sharding.commit.manifests import (
    write_key_indexes,
)
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.commit.state import (
    REPORT,
    SAMPLES,
    committed_up_to_date,
    save_intake_settings,
    state_dir,
)
from pid_platform.sharding.intake.cache import CACHE_NAME, IntakeCache
from pid_platform.sharding.intake.file_checks import VALIDATE_FULL, check_validate_level
from pid_platform.sharding.intake.task import IntakeReport, intake
from pid_platform.sharding.layout import final_dir
from pid_platform.sharding.output_lock import build_lock
from pid_platform.sharding.plan.add_modality import (
    may_extend,
    plan_build,
    save_plan_cut,
)
from pid_platform.sharding.plan.columnar import Shard, ShardRef
from pid_platform.sharding.plan.plan_files import (
    iter_shard_plans,
    load_shards,
    write_cut,
    write_planned,
)
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.plan.tables import (
    read_samples,
    samples_modalities,
    write_table,
)
from pid_platform.sharding.state_doc import load_state_doc
from pid_platform.sharding.storage import SourceStore
from pid_platform.sharding.tasks.records import intake_parts
from pid_platform.sharding.write.tars import ShardResult

F = TypeVar("F", bound=Callable)


def build_step(fn: F) -> F:
    """Run ``fn`` holding the build lock of its ``out`` argument; if it fails, remove a staging
    folder it left empty (still under the lock, so no other build's staging is touched). An S3
    output's steps hold its build lease too (``sharding/tasks/``)."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = sig.bind_partial(*args, **kwargs).arguments["out"]
        with build_lock(out):
            try:
                return fn(*args, **kwargs)
            except BaseException:
                versions.discard_empty_staging(out)
                raise

    return wrapper  # type: ignore[return-value]


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
    validate: str = VALIDATE_FULL
    # Nothing changed since the committed build (source files, outcomes, settings): nothing written.
    up_to_date: bool = False
    # For an S3 output: the version now current (``s3://.../versions/<id>``); ``out`` is then
    # the local work folder the build staged in.
    published: str | None = None
    # Objects of the published version that were missing or of the wrong size, sent again.
    repaired: int = 0
    # With ``repair``: committed shards with a tar missing or whose sha256 differs, written again.
    damaged_shards: int = 0

    @property
    def shards(self) -> int:
        return sum(b.shards for b in self.buckets.values())

    @property
    def samples(self) -> int:
        return sum(b.samples for b in self.buckets.values())


def summarize(results: list[ShardResult]) -> dict[str, BucketSummary]:
    buckets: dict[str, BucketSummary] = {}
    for r in results:
        b = buckets.setdefault(r.bucket, BucketSummary(r.bucket))
        b.shards += 1
        b.samples += r.count
        b.bytes += sum(r.bytes.values())
        b.written += int(r.written)
    return dict(sorted(buckets.items()))


@dataclass
class IntakeResult:
    samples: pa.Table  # the samples table (``plan.tables.samples_table``'s columns), sorted by key
    report: IntakeReport
    path: Path  # samples.parquet: the staged one, or the committed one when up to date
    validate: str
    # The committed build already holds exactly these samples, this report and these settings,
    # and its files are intact: nothing was staged.
    up_to_date: bool = False


@build_step
def run_intake(store: SourceStore, source: str, out: Path, config: ShardingConfig, *, trust_pickle: bool,
               num_workers: int, progress: Callable | None = None, force: bool = False,
               validate: str = VALIDATE_FULL, revalidate: bool = False,
               stop_if_up_to_date: bool = False) -> IntakeResult:
    """Samples of ``source`` into the staging folder, validating only files the intake cache
    (of the committed build, or of an unfinished one in the staging folder) does not vouch for.

    ``force``: build into a non-empty folder that no build made (its files are kept).
    ``validate``: ``full`` or ``header`` (``validate.VALIDATE_LEVELS``). ``revalidate``: ignore
    the cache. ``stop_if_up_to_date``: when the committed build already is what this one would
    publish (``state.committed_up_to_date``) and no unfinished build is staged, stage nothing
    (no staging folder is even created) and say so.
    """
    check_validate_level(validate)
    final = final_dir(out)
    may_stop = stop_if_up_to_date and not revalidate
    if may_stop:
        versions.prepare(out, first_step=True, force=force)
        # Only over a committed build, and not while an unfinished one is staged: that one is
        # finished (and published) by this run instead.
        may_stop = (state_dir(final) / SAMPLES).is_file() and not versions.staging_dir(out).exists()
    if not may_stop:
        versions.begin(out, first_step=True, force=force)  # proves the output writable before any work
    staged = versions.staging_dir(out)
    # Outcomes of intake tasks (``tasks.run_intake_task``) come last and win: files they did not
    # cover (a slice never run, a file changed since) are validated here, so the samples and the
    # report are those of one intake over the whole source however it was sliced.
    caches = [state_dir(final) / CACHE_NAME, state_dir(staged) / CACHE_NAME, *intake_parts(staged)]
    cache = IntakeCache(validate) if revalidate else IntakeCache.load(caches, validate)
    samples, report, used = intake(
        store, source, classify_aspect_ratio=config.classify_aspect_ratio, trust_pickle=trust_pickle,
        num_workers=num_workers, progress=progress, validate=validate, cache=cache,
    )
    # A file validated this run means the committed cache lacks its outcome: publish a new version
    # (cheap: every tar is hard-linked) rather than validate it again on every rebuild.
    if may_stop and report.files_validated == 0 and committed_up_to_date(final, samples, report, config, validate):
        return IntakeResult(samples, report, state_dir(final) / SAMPLES, validate, up_to_date=True)
    staging = versions.begin(out, first_step=True, force=force)
    # The cache first: should the build stop after it, the next one still reuses these outcomes.
    used.save(state_dir(staging) / CACHE_NAME)
    path = write_table(state_dir(staging) / SAMPLES, samples)
    atomic_write_bytes(state_dir(staging) / REPORT, json.dumps(report.to_json(), indent=1).encode())
    save_intake_settings(staging, validate)
    return IntakeResult(samples, report, path, validate)


def stage_plan_files(store: SourceStore, source: str, out: Path, config: ShardingConfig,
                     committed: Path | None = None) -> list[ShardRef]:
    """The plan of the samples staged for ``out`` (``samples.parquet``): ``plan.parquet``,
    ``shards.parquet``, ``plan_cut.json`` and ``sharding.json`` into the staging folder; its shards.

    Cut from samples.parquet as columns (``plan_files.write_cut``: no object per sample), unless
    the build may only add modality folders to the committed plan of ``committed`` (default:
    ``out``'s published one; ``add_modality.may_extend``): that plan is extended as objects
    (``plan_build``), and re-cut the same way should it not apply."""
    staging = versions.begin(out)
    committed = committed or final_dir(out)
    samples_path = state_dir(staging) / SAMPLES
    if not may_extend(committed, samples_modalities(samples_path), config):
        save_plan_cut(staging, None)
        shards = write_cut(staging, samples_path, config)
    else:
        samples, modalities = read_samples(samples_path)
        plans, cut = plan_build(store, source, committed, samples, modalities, config)
        save_plan_cut(staging, cut)
        shards = write_planned(staging, plans, modalities, config)
    save_sharding_config(staging, config)
    return shards


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
        return ShardingConfig(**load_state_doc(path.read_bytes(), path))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no sharding recorded in {folder}; materialize twin_tar_shards first"
        ) from None


@build_step
def run_key_indexes(out: Path, *, num_workers: int) -> tuple[ShardingConfig, list[ShardRef], list[str]]:
    """Key indexes of the staged tars, cut with the config recorded beside them; the plan is read
    a row group at a time, so no step holds every sample."""
    staging = versions.begin(out)
    config = load_sharding_config(staging)
    written = [w for plans in iter_shard_plans(staging, config)
               for w in write_key_indexes(staging, plans, num_workers=num_workers)]
    return config, load_shards(staging, config), written


def refuse_roots_on_s3(manifest_root: str, publish_to: S3Output | None) -> None:
    """A version's folder is named after its manifests' content, so no root written into them
    can name it: an S3 output keeps relative roots, resolved inside the version the pointer names."""
    if publish_to is not None and manifest_root != "relative":
        raise FormatError(
            f"manifest root {manifest_root!r}: the manifests of an s3:// output keep relative roots (each version "
            f"lives under {publish_to}/versions/<id>/, named after them); read it through its pointer or catalog"
        )


def planned_results(plans: Sequence[Shard], written: Callable[[int], bool] = lambda _i: False) -> list[ShardResult]:
    """Each planned shard as a result: its count and planned tar sizes; ``written(position)``."""
    return [ShardResult(p.bucket, p.index, p.relpath, p.count, {m: p.tar_bytes(m) for m in p.modalities}, written(i))
            for i, p in enumerate(plans)]


def build_source(store: SourceStore, source: str, out: Path, config: ShardingConfig, **settings) -> BuildSummary:
    """The one-process build of a folder output: ``tasks.run.run_build`` (plan, write task 0 of 1,
    commit), under the name the benchmarks and tests call it by."""
    from pid_platform.sharding.tasks.run import run_build

    return run_build(store, source, out, config, **settings)
