"""The columnar shard plan equals the object plan it replaced, and the commit reads it in bounded memory.

``reference_plan`` below is the object plan as it was before the columnar one (one Python loop
over ``Sample`` objects), kept here verbatim as the oracle: every plan, plan.parquet and manifest
the columnar code makes is compared with what that one makes on the same samples.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from loader.formats.twin_tar import (
    END_OF_ARCHIVE,
    RECORD,
    key_index_relpath,
    member_span,
    shard_relpath,
)
from loader.formats.wdinfo import read_wdinfo
from pid_platform.sharding.commit.manifests import write_manifests
from pid_platform.sharding.commit.versions import staging_dir
from pid_platform.sharding.intake.task import Sample
from pid_platform.sharding.layout import STATE_DIR, bucket_dir
from pid_platform.sharding.plan.columnar import (
    plan_table,
    read_shard_refs,
    read_shards_file,
    write_plan_file,
    write_plan_table,
)
from pid_platform.sharding.plan.shard_plan import FLAT, ShardingConfig, ShardPlan, plan_shards
from pid_platform.sharding.plan.tables import read_plans, samples_table, write_plans, write_table
from pid_platform.sharding.storage import FileEntry

ROOT = Path(__file__).resolve().parent.parent
MODS = ["caption", "image", "umt5"]
BUCKETS = ["aspect_ratio_16_9", "aspect_ratio_1_1", "aspect_ratio_4_3", "aspect_ratio_9_16", None]


# --- the object plan as it was (the oracle) -----------------------------------------------------

def _sample_span(s: Sample, modalities: tuple[str, ...]) -> int:
    return sum(member_span(s.files[m].size) for m in modalities)


def _group_by_bytes(samples: list[Sample], modalities: tuple[str, ...], bound: int) -> list[list[Sample]]:
    fixed = len(modalities) * (END_OF_ARCHIVE + RECORD)
    groups: list[list[Sample]] = []
    current: list[Sample] = []
    used = 0
    for s in samples:
        span = _sample_span(s, modalities)
        if current and used + span + fixed > bound:
            groups.append(current)
            current, used = [], 0
        current.append(s)
        used += span
    if current:
        groups.append(current)
    return groups


def reference_plan(samples: list[Sample], modalities: list[str], config: ShardingConfig) -> list[ShardPlan]:
    mods = tuple(sorted(modalities))
    buckets: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        buckets[(s.bucket or FLAT) if config.classify_aspect_ratio else FLAT].append(s)
    plans: list[ShardPlan] = []
    for bucket in sorted(buckets):
        items = sorted(buckets[bucket], key=lambda s: s.key)
        if config.shuffle:
            random.Random(f"{config.seed}:{bucket}").shuffle(items)
        if config.shard_size > 0:
            groups = [items[i : i + config.shard_size] for i in range(0, len(items), config.shard_size)]
        else:
            groups = _group_by_bytes(items, mods, config.max_shard_bytes)
        for i, g in enumerate(groups):
            plans.append(ShardPlan(bucket, i, shard_relpath(i, config.part_size), tuple(g), mods))
    return plans


# --- inputs ---------------------------------------------------------------------------------------

def make_samples(n: int, seed: int, *, local: bool = True, sort: bool = True, huge_every: int = 37) -> list[Sample]:
    """Samples of varied buckets (None too), sizes from a few bytes to several MB (every
    ``huge_every``-th image larger than any bound used here: an oversize singleton)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = f"s{rng.randrange(10**6):06d}_{i}"
        files = {}
        for m, ext in zip(MODS, (".json", ".jpg", ".npy"), strict=True):
            size = rng.choice([1, 511, 512, 513, rng.randrange(1, 40_000), rng.randrange(1, 400_000)])
            if m == "image" and huge_every and i % huge_every == 0:
                size = 3_000_000 + rng.randrange(10**6)
            fp = f"{size}:{rng.randrange(10**18)}:{rng.randrange(10**18)}:{i}" if local else f"{size}:{rng.getrandbits(128):032x}"
            files[m] = FileEntry(m, base + ext, size, fp, f"/raw/src/{m}" if local else None)
        w, h = rng.choice([(1920, 1080), (1000, 1000), (800, 600), (1080, 1920), (None, None)])
        out.append(Sample(base, base, files, w, h, rng.choice(BUCKETS) if w else None))
    if sort:
        out.sort(key=lambda s: s.key)
    return out


CONFIGS = [
    ShardingConfig(max_shard_size_mb=0.5),
    ShardingConfig(max_shard_size_mb=2.0, part_size=3),
    ShardingConfig(max_shard_size_mb=1 / 1024),  # below any sample: every one alone
    ShardingConfig(max_shard_size_mb=0.5, classify_aspect_ratio=False),
    ShardingConfig(shard_size=7),
    ShardingConfig(shard_size=1000),
    ShardingConfig(max_shard_size_mb=0.5, shuffle=True, seed=0),
    ShardingConfig(max_shard_size_mb=1.0, shuffle=True, seed=-12345),
    ShardingConfig(shard_size=5, shuffle=True, seed=2**63 - 1, classify_aspect_ratio=False),
]


def _shape(plans: list[ShardPlan]) -> list[tuple]:
    return [(p.bucket, p.index, p.relpath, p.modalities, tuple(s.key for s in p.samples)) for p in plans]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.max_shard_size_mb}mb-n{c.shard_size}-ar{int(c.classify_aspect_ratio)}-sh{int(c.shuffle)}s{c.seed}")
@pytest.mark.parametrize("seed", [1, 2])
def test_the_columnar_plan_is_the_object_plan(config: ShardingConfig, seed: int) -> None:
    samples = make_samples(400, seed, sort=seed == 1)  # seed 2: not in key order, as no intake writes
    want = reference_plan(samples, MODS, config)
    got = plan_shards(samples, MODS, config)
    assert _shape(got) == _shape(want)
    assert got == want
    assert [p.digest() for p in got] == [p.digest() for p in want]
    assert [p.count for p in got] == [len(p.samples) for p in want]
    bound = config.max_shard_bytes
    if config.shard_size == 0:  # the bound holds, but for samples over it on their own
        assert all(p.total_bytes <= bound or len(p.samples) == 1 for p in got)
        assert any(len(p.samples) == 1 and p.total_bytes > bound for p in got)


def test_edge_inputs_plan_as_before() -> None:
    cfg = ShardingConfig(max_shard_size_mb=0.5)
    assert plan_shards([], MODS, cfg) == []
    one = make_samples(1, 3)
    assert plan_shards(one, MODS, cfg) == reference_plan(one, MODS, cfg)
    flat = [Sample(s.key, s.basename, s.files, None, None, None) for s in make_samples(50, 4)]
    flat += [Sample(s.key + "x", s.basename, s.files, 1, 1, "") for s in make_samples(50, 5)]
    flat.sort(key=lambda s: s.key)
    assert plan_shards(flat, MODS, cfg) == reference_plan(flat, MODS, cfg)  # None and "" are one flat bucket
    mods = ["image"]
    single = [Sample(s.key, s.basename, {"image": s.files["image"]}, s.width, s.height, s.bucket)
              for s in make_samples(120, 6)]
    assert plan_shards(single, mods, cfg) == reference_plan(single, mods, cfg)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4], CONFIGS[7], CONFIGS[3]], ids=["bytes", "count", "shuffle", "flat"])
@pytest.mark.parametrize("local", [True, False], ids=["local", "s3"])
def test_plan_parquet_from_columns_has_the_bytes_of_the_object_plan(tmp_path: Path, config: ShardingConfig,
                                                                    local: bool) -> None:
    samples = make_samples(500, 7, local=local)
    want = reference_plan(samples, MODS, config)
    write_plans(tmp_path / "objects.parquet", want, MODS)
    table, _ = plan_table(samples_table(samples, MODS), config)
    write_plan_table(tmp_path / "table.parquet", table)
    write_table(tmp_path / "samples.parquet", samples_table(samples, MODS))
    layout = write_plan_file(tmp_path / "samples.parquet", tmp_path / "file.parquet", config)
    ref = (tmp_path / "objects.parquet").read_bytes()
    assert (tmp_path / "table.parquet").read_bytes() == ref
    assert (tmp_path / "file.parquet").read_bytes() == ref
    assert len(layout.offsets) - 1 == len(want)
    # Scattered through row groups of 64 rows (what a source of millions of samples takes):
    # other row groups, the same rows.
    write_plan_file(tmp_path / "samples.parquet", tmp_path / "small.parquet", config, row_group_rows=64,
                    batch_rows=50)
    small = pq.ParquetFile(tmp_path / "small.parquet")
    assert small.metadata.num_row_groups == -(-500 // 64)
    assert small.read().equals(pq.read_table(tmp_path / "objects.parquet"))
    assert not any(p.name.startswith(".plan-scatter-") for p in tmp_path.iterdir())
    assert read_plans(tmp_path / "small.parquet", config.part_size) == read_plans(
        tmp_path / "objects.parquet", config.part_size)


def test_samples_out_of_key_order_are_planned_in_key_order(tmp_path: Path) -> None:
    config = CONFIGS[0]
    samples = make_samples(300, 8, sort=False)
    write_table(tmp_path / "samples.parquet", samples_table(samples, MODS))
    write_plan_file(tmp_path / "samples.parquet", tmp_path / "plan.parquet", config, row_group_rows=100,
                    batch_rows=64)
    write_plans(tmp_path / "objects.parquet", reference_plan(samples, MODS, config), MODS)
    assert pq.read_table(tmp_path / "plan.parquet").equals(pq.read_table(tmp_path / "objects.parquet"))


def _digest_sha(_out: Path, shard) -> dict[str, str]:
    # Stand-in for the tars' sha256 (no tars are written here): the plan digest, per modality.
    return {m: f"{m}:{shard.digest()}" for m in shard.modalities}


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[8]], ids=["bytes", "parts", "flat-shuffle"])
def test_the_commit_reads_shards_from_the_plan_file_as_the_object_plan_has_them(
        tmp_path: Path, config: ShardingConfig) -> None:
    samples = make_samples(600, 9)
    plans = reference_plan(samples, MODS, config)
    write_plans(tmp_path / "plan.parquet", plans, MODS)
    for batch_rows in (1, 13, 64 * 1024):  # shards cut across batches
        refs = read_shard_refs(tmp_path / "plan.parquet", config.part_size, batch_rows=batch_rows)
        assert [(r.bucket, r.index, r.relpath, r.modalities, r.count) for r in refs] == [
            (p.bucket, p.index, p.relpath, p.modalities, len(p.samples)) for p in plans]
        assert [r.sizes for r in refs] == [tuple(p.tar_bytes(m) for m in p.modalities) for p in plans]
        assert [r.digest() for r in refs] == [p.digest() for p in plans]
    objects, columns = tmp_path / "objects", tmp_path / "columns"
    for out in (objects, columns):
        for p in plans:
            (bucket_dir(out, p.bucket) / key_index_relpath(p.relpath)).parent.mkdir(parents=True, exist_ok=True)
            (bucket_dir(out, p.bucket) / key_index_relpath(p.relpath)).touch()
    a = write_manifests(objects, "src", plans, root_base="s3://b/p", tar_sha256=_digest_sha)
    b = write_manifests(columns, "src", read_shard_refs(tmp_path / "plan.parquet", config.part_size),
                        root_base="s3://b/p", tar_sha256=_digest_sha)
    assert [m.bucket for m in a] == [m.bucket for m in b]
    for x, y in zip(a, b, strict=True):
        assert x.path.read_bytes() == y.path.read_bytes()
        assert read_wdinfo(y.path).total_key_count == sum(len(p.samples) for p in plans if p.bucket == x.bucket)


# --- memory, scaled down (no time asserted: speed lives in bench/bench_build_scale.py) ------------

def _bench():
    spec = importlib.util.spec_from_file_location("bench_build_scale", ROOT / "bench" / "bench_build_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plan_and_commit_hold_one_row_group_not_the_source(tmp_path: Path) -> None:
    """200,000 samples in row groups of 16,384: the child that plans and commits grows by far
    less than the samples table takes in memory (it never holds every sample)."""
    bench = _bench()
    n = 200_000
    samples = tmp_path / "samples.parquet"
    bench.write_synthetic_samples(samples, n, files="local", chunk_rows=16_384)
    table_bytes = pq.read_table(samples).nbytes
    script = f"""
import json, resource, sys
from pathlib import Path
sys.path.insert(0, {str(ROOT)!r})
import bench.bench_build_scale as b
from pid_platform.sharding.plan import columnar
columnar.ROW_GROUP_ROWS = 16_384  # a big source's row groups, scaled down with it
out = Path({str(tmp_path / "out")!r})
r = b.coordinator_child(Path({str(samples)!r}), out, 64.0)
print(json.dumps(r))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["samples"] == n and r["buckets"] == 8 and r["shards"] > 100
    grown = r["peak_rss"] - r["base_rss"]
    assert table_bytes > 100e6
    assert grown < table_bytes / 2, (grown, table_bytes)
    assert pq.ParquetFile(staging_dir(tmp_path / "out") / STATE_DIR / "plan.parquet").num_row_groups == -(-n // 16_384)
    manifests = sorted(staging_dir(tmp_path / "out").glob("*/wdinfo.json"))
    assert sum(read_wdinfo(m).total_key_count for m in manifests) == n


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[8]], ids=["bytes", "parts", "flat-shuffle"])
@pytest.mark.parametrize("row_group_rows", [64, 128 * 1024], ids=["scattered", "one-group"])
def test_shards_file_written_with_the_plan_holds_the_object_plans_shards(
        tmp_path: Path, config: ShardingConfig, row_group_rows: int) -> None:
    samples = make_samples(600, 10)
    plans = reference_plan(samples, MODS, config)
    write_table(tmp_path / "samples.parquet", samples_table(samples, MODS))
    write_plan_file(tmp_path / "samples.parquet", tmp_path / "plan.parquet", config, row_group_rows=row_group_rows,
                    batch_rows=50, shards_path=tmp_path / "shards.parquet")
    refs = read_shards_file(tmp_path / "shards.parquet", tmp_path / "plan.parquet", config.part_size)
    assert refs == read_shard_refs(tmp_path / "plan.parquet", config.part_size)
    assert [(r.bucket, r.index, r.relpath, r.count, r.sizes, r.digest()) for r in refs] == [
        (p.bucket, p.index, p.relpath, len(p.samples), tuple(p.tar_bytes(m) for m in p.modalities), p.digest())
        for p in plans]
    # Made for another plan (other part size, or a plan of other rows): refused, naming both files.
    with pytest.raises(ValueError, match="shards.parquet was written for another plan than .*plan.parquet"):
        read_shards_file(tmp_path / "shards.parquet", tmp_path / "plan.parquet", config.part_size + 1)
    write_plans(tmp_path / "plan.parquet", plans[:-1], MODS)
    with pytest.raises(ValueError, match="delete it and plan again"):
        read_shards_file(tmp_path / "shards.parquet", tmp_path / "plan.parquet", config.part_size)
