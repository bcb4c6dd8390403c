"""Builds that outgrow one machine: what the coordinator costs at scale (issue 18).

    python bench/bench_build_scale.py [--sections coordinator workers] [--samples 10000000] [--files s3|local]
                                      [--shard-mb 500] [--worker-samples 12000] [--worker-shard-mb 8]
                                      [--overhead-tasks 5] [--work-dir DIR] [--keep]

Sections (``--sections``, default all); each prints its table and its ``PASS``/``MISS`` lines:

* ``coordinator`` - plan + commit of one source of ``--samples`` samples (10,000,000 by default).
  **Data:** a synthetic intake table (``samples.parquet`` as intake writes it, row groups of 1 Mi
  rows, keys in order) written directly, column by column, with no file on disk per sample:
  keys ``img_<9 digits>_<8 hex>``, 8 aspect buckets with realistic shares and 3840-px-class
  sizes, three modalities - ``caption`` (.json, 200 B - 3 KB), ``image`` (.jpg, log-normal around
  1.5 MB, 50 KB - 20 MB) and ``umt5`` (.npy, float16 [20-300, 4096]) - with S3 listing
  fingerprints (``size:etag``, no local path; ``--files local``: ``size:mtime:ctime:inode`` and a
  path per file, the largest rows a build reads). Generated once and cached in the work folder.
  **Timed, in a fresh child process:** *plan* - the build's own plan step,
  ``tasks.plan.stage_plan`` (what ``pid-shard plan`` and the Dagster ``plan`` step run after the
  intake; the table is linked in as the intake staged it): samples.parquet -> plan.parquet (the
  shard plan and every sample in plan order, row groups of 128 Ki rows) and shards.parquet (one
  row per shard: count, tar sizes, plan digest, computed from each row group as it is written),
  through ``plan_files.write_cut``; *commit* - what ``run_commit`` does after
  the write tasks: the shards read back (``plan_files.load_shards``), ``remove_unplanned``,
  ``write_manifests`` (one wdinfo.json per bucket) and ``save_outputs``.
  No tar exists: the commit takes each tar's sha256 from the plan (a stand-in, the shard's plan
  digest, through the ``tar_sha256`` seam of ``write_manifests``) instead of reading the
  writer's digest cache, and one empty stand-in key index per shard is put in place between plan
  and commit (untimed) so the commit's checks run as in a build. Peak RSS is the child's
  ``ru_maxrss``. **Targets:** plan + commit <= 60 s and peak RSS <= 1.5 GB (at 10,000,000 samples;
  a smaller ``--samples`` prints the same lines for what it measured).
  **Before it, in a child of its own:** *intake* - the plan step's intake (``pipeline.run_intake``,
  which ``run_plan`` runs before it cuts the plan) over the same samples as a listing: each
  modality's names, sizes and fingerprints served as ``storage.list_files`` gives them (a
  stand-in for the listing alone: ten million files cannot be put on this disk) and every
  file's outcome in an intake task's part, as after a tasked intake (no file is read: the bench
  stops if one is). Listing, basename join, the outcomes looked up, keys, buckets, then
  samples.parquet, the report and the cache written: its seconds and peak RSS are printed, with
  no target (it holds the listing's columns, about 100 bytes per file); the plan then starts
  from the samples.parquet it staged.

* ``workers`` - one source's first build (``--validate full``: every image decoded) by 1 and by 2
  workers on the same raw drop. **Data:** ``--worker-samples`` samples made from scikit-image's
  photographs (``pid_platform.demo.sample_data``, as ``bench/_data.py`` makes them) replicated
  under new names (hard links); cached in the work folder. **Timed:** the build as the tasks a
  scheduler places (``pid-shard task --stage intake --index I --of N`` x N at once, ``pid-shard
  plan``, ``pid-shard task --index I --of N`` x N at once, ``pid-shard commit``), each task a
  process of its own with ``--num-workers 1``: what N single-core workers (Celery, ECS, a Slurm
  array) do. Wall time, the children's CPU time, and the output's files compared byte for byte
  between N = 1 and N = 2. **Per-task overhead:** a write task of one shard, from its process
  start to the first byte of a tar in the staging folder (polled every millisecond), median
  of ``--overhead-tasks``. **Target:** 2 workers >= 1.7x as fast as 1 (on a 2-core machine
  that other work shares, the ratio is capped by what is free: the CPU times say how busy).
  **Size:** 12,000 samples, a build of about a minute on one worker. What every build pays
  whatever its size - four process starts on its critical path (~0.5 s each) and the plan and
  commit (~1.5 s together) - is a tenth of it here; at 4,000 samples (an 18 s build) it is a
  sixth, and the ratio there was 1.53-1.64x (2026-12-03), which says what per-task overhead
  costs a build that small rather than how the tasks scale.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATA_VERSION = 1  # bump when what is generated changes
SOURCE = "scale"
MODALITIES = ("caption", "image", "umt5")  # sorted, as intake lists them
TARGET_S = 60.0
TARGET_RSS = 1.5e9
CHUNK_ROWS = 1024 * 1024  # rows per generated row group: what pq.write_table writes for intake
# Share of each aspect bucket (PiD's 8), and the long side of a 4K-class image.
BUCKET_SHARES = {(16, 9): 0.30, (4, 3): 0.15, (3, 2): 0.15, (1, 1): 0.13, (9, 16): 0.08, (3, 4): 0.07,
                 (2, 3): 0.06, (21, 9): 0.06}


# --- data --------------------------------------------------------------------------------------

def _fixed_strings(chars: np.ndarray) -> pa.Array:
    """A string array from an (n, width) uint8 matrix of ASCII characters."""
    n, width = chars.shape
    offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(chars).tobytes()))


def _digits(values: np.ndarray, width: int, base: int) -> np.ndarray:
    alphabet = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    v = values.astype(np.uint64)
    out = np.empty((len(v), width), dtype=np.uint8)
    for k in range(width - 1, -1, -1):
        out[:, k] = alphabet[(v % base).astype(np.intp)]
        v //= base
    return out


def _join(*parts) -> pa.Array:
    return pc.binary_join_element_wise(*parts, "")


def synthetic_chunk(start: int, stop: int, seed: int, files: str) -> pa.Table:
    """Rows ``start:stop`` of the synthetic intake table (the columns ``tables.samples_table`` writes)."""
    from loader.formats.twin_tar import bucket_name

    rng = np.random.default_rng([seed, start])
    n = stop - start
    i = np.arange(start, stop, dtype=np.int64)
    basename = _fixed_strings(np.hstack([
        np.frombuffer(b"img_", dtype=np.uint8)[None, :].repeat(n, 0), _digits(i, 9, 10),
        np.full((n, 1), ord("_"), dtype=np.uint8), _digits(rng.integers(0, 2**32, n), 8, 16),
    ]))
    ratios = list(BUCKET_SHARES)
    pick = rng.choice(len(ratios), size=n, p=np.array(list(BUCKET_SHARES.values())) / sum(BUCKET_SHARES.values()))
    rw = np.array([w for w, _ in ratios])[pick]
    rh = np.array([h for _, h in ratios])[pick]
    long_side = rng.integers(3200, 4097, n)
    width = np.where(rw >= rh, long_side, long_side * rw // rh).astype(np.int32)
    height = np.where(rw >= rh, long_side * rh // rw, long_side).astype(np.int32)
    names = pa.array([bucket_name(w, h) for w, h in ratios], pa.string())
    cols: dict[str, pa.Array] = {
        "key": basename, "basename": basename, "width": pa.array(width), "height": pa.array(height),
        "bucket": pc.take(names, pa.array(pick.astype(np.int32))),
    }
    sizes = {
        "caption": rng.integers(200, 3000, n),
        "image": np.clip(rng.lognormal(np.log(1.5e6), 0.5, n), 50_000, 20_000_000).astype(np.int64),
        "umt5": 128 + rng.integers(20, 301, n) * 4096 * 2,
    }
    ext = {"caption": ".json", "image": ".jpg", "umt5": ".npy"}
    for m in MODALITIES:
        size = pa.array(sizes[m].astype(np.int64))
        name = _join(basename, ext[m])
        size_s = pc.cast(size, pa.string())
        if files == "local":
            mtime = 1_733_000_000_000_000_000 + rng.integers(0, 10**15, n)
            inode = 10_000_000 + i * 3 + MODALITIES.index(m)
            fp = _join(size_s, ":", pc.cast(pa.array(mtime), pa.string()), ":",
                       pc.cast(pa.array(mtime + 1_000), pa.string()), ":", pc.cast(pa.array(inode), pa.string()))
            path = _join(f"/data/raw/{SOURCE}/{m}/", name)
        else:
            fp = _join(size_s, ":", _fixed_strings(_digits(rng.integers(0, 2**63, n), 16, 16)),
                       _fixed_strings(_digits(rng.integers(0, 2**63, n), 16, 16)))
            path = pa.nulls(n, pa.string())
        cols[f"name.{m}"], cols[f"size.{m}"], cols[f"fingerprint.{m}"], cols[f"path.{m}"] = name, size, fp, path
    return pa.table(cols)


def write_synthetic_samples(path: Path, samples: int, *, seed: int = 0, files: str = "s3",
                            chunk_rows: int = CHUNK_ROWS) -> Path:
    """samples.parquet of ``samples`` synthetic samples, one row group at a time (bounded memory)."""
    writer = None
    try:
        for start in range(0, samples, chunk_rows):
            chunk = synthetic_chunk(start, min(start + chunk_rows, samples), seed, files)
            if writer is None:
                writer = pq.ParquetWriter(path, chunk.schema, compression="zstd")
            writer.write_table(chunk, row_group_size=chunk_rows)
    finally:
        if writer is not None:
            writer.close()
    return path


def cached_samples(work: Path, samples: int, files: str, log=print) -> Path:
    stamp = {"v": DATA_VERSION, "samples": samples, "files": files}
    path = work / f"samples-n{samples}-{files}.parquet"
    done = path.with_suffix(".json")
    if path.is_file() and done.is_file() and json.loads(done.read_text()) == stamp:
        return path
    log(f"[data] writing a synthetic intake table of {samples:,} samples to {path}")
    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    # In a child: this process stays small, and a child's ru_maxrss starts from its parent's RSS
    # at the fork (Linux keeps the high-water mark across exec).
    _child(["--child-generate", str(path), str(samples), files])
    done.write_text(json.dumps(stamp))
    log(f"[data] {path.stat().st_size / 1e6:,.0f} MB in {time.perf_counter() - t0:.1f} s")
    return path


# --- coordinator: the timed child --------------------------------------------------------------

def plan_digest_sha(_out: Path, shard) -> dict[str, str]:
    """Stand-in for the tars' sha256 (no tar exists here): the shard's plan digest, which fixes
    their bytes and which the real commit computes to check the writer's digest cache."""
    return {m: shard.digest() for m in shard.modalities}


def listing_store(samples_path: Path):
    """A raw root whose listing is the synthetic table's files (a stand-in for the listing only:
    ten million files cannot be put on this disk): each modality's names, sizes and fingerprints
    as columns, as ``storage.list_files`` gives them. Nothing may be read: every outcome is in
    the intake tasks' parts, as after a real tasked intake."""
    from pid_platform.sharding.storage import Listing, SourceStore

    class SyntheticListing(SourceStore):
        uri = f"synthetic://{samples_path.name}"

        def list_sources(self) -> list[str]:
            return [SOURCE]

        def list_modalities(self, source: str) -> list[str]:
            return list(MODALITIES)

        def list_files(self, source: str, modality: str) -> Listing:
            cols = [f"name.{modality}", f"size.{modality}", f"fingerprint.{modality}"]
            files = pq.read_table(samples_path, columns=cols).rename_columns(["name", "size", "fingerprint"])
            folder = None if args_files(samples_path) == "s3" else f"/data/raw/{SOURCE}/{modality}"
            return Listing(modality, files.combine_chunks(), folder)

        def read(self, source, entry, n=None) -> bytes:
            raise AssertionError(f"{entry.name}: the plan step read a file every intake task had validated")

        def read_source_file(self, source: str, name: str, max_bytes: int | None = None) -> bytes | None:
            return None

        def write_source_file(self, source: str, name: str, data: bytes) -> None:
            raise AssertionError("the bench's listing is read-only")

    return SyntheticListing()


def args_files(samples_path: Path) -> str:
    return "local" if samples_path.name.endswith("-local.parquet") else "s3"


def write_intake_part(samples_path: Path, part: Path) -> None:
    """What the intake tasks found for every file of the synthetic table (an ``IntakeCache``
    parquet, as ``pid-shard task --stage intake`` writes it): images valid at their pixel size,
    captions valid, embeddings sniffed; written a row group of the table at a time."""
    from pid_platform.sharding.intake.cache import (
        CACHE_SCHEMA,
        CAPTION,
        IMAGE,
        RULES_VERSION,
        SNIFF,
    )

    kinds = {"caption": CAPTION, "image": IMAGE, "umt5": SNIFF}
    pf = pq.ParquetFile(samples_path)
    schema = CACHE_SCHEMA.with_metadata({"rules_version": str(RULES_VERSION), "validate": "full"})
    part.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(part, schema, compression="zstd") as writer:
        for m in MODALITIES:
            for g in range(pf.num_row_groups):
                t = pf.read_row_group(g, columns=[f"name.{m}", f"fingerprint.{m}", "width", "height"])
                n = t.num_rows
                image = m == "image"
                writer.write_table(pa.table({
                    "modality": pa.repeat(pa.scalar(m, pa.string()), n), "name": t[f"name.{m}"],
                    "fingerprint": t[f"fingerprint.{m}"], "kind": pa.repeat(pa.scalar(kinds[m], pa.string()), n),
                    "reason": pa.nulls(n, pa.string()),
                    "width": t["width"] if image else pa.nulls(n, pa.int32()),
                    "height": t["height"] if image else pa.nulls(n, pa.int32()),
                }, schema=schema))


def intake_child(samples_path: Path, out: Path, shard_mb: float) -> dict:
    """The plan step's intake (``pipeline.run_intake``, what ``run_plan`` runs before it cuts the
    plan) over the synthetic listing, with every file's outcome in an intake task's part:
    listing, basename join, the outcomes looked up, keys and buckets, then samples.parquet, the
    report and the cache staged for the plan; what it measured."""
    from pid_platform.sharding import pipeline
    from pid_platform.sharding.commit import versions
    from pid_platform.sharding.plan.shard_plan import ShardingConfig
    from pid_platform.sharding.tasks.records import intake_part_path

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    staging = versions.begin(out, first_step=True)
    write_intake_part(samples_path, intake_part_path(staging, 0, 1))  # untimed: the intake tasks' work
    start = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    result = pipeline.run_intake(listing_store(samples_path), SOURCE, out, ShardingConfig(max_shard_size_mb=shard_mb),
                                 trust_pickle=False, num_workers=1, stop_if_up_to_date=True)
    seconds = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report = result.report
    return {
        "seconds": seconds, "cpu_s": usage.ru_utime + usage.ru_stime - start.ru_utime - start.ru_stime,
        "samples": report.samples, "files": sum(report.files_seen.values()), "validated": report.files_validated,
        "reused": report.outcomes_reused, "base_rss": base_rss,
        "peak_rss": usage.ru_maxrss * 1024, "samples_mb": result.path.stat().st_size / 1e6,
    }


def coordinator_child(samples_path: Path, out: Path, shard_mb: float) -> dict:
    """Plan + commit of ``samples_path`` staged as the intake of a build of ``out`` (in its staging
    folder, where the manifests are written too); what it measured."""
    from loader.formats.twin_tar import key_index_relpath
    from pid_platform.sharding.commit import versions
    from pid_platform.sharding.commit.manifests import remove_unplanned, write_manifests
    from pid_platform.sharding.commit.state import SAMPLES, save_outputs, state_dir
    from pid_platform.sharding.layout import bucket_dir
    from pid_platform.sharding.plan.plan_files import PLAN, load_shards
    from pid_platform.sharding.plan.shard_plan import ShardingConfig
    from pid_platform.sharding.storage import LocalSourceStore
    from pid_platform.sharding.tasks.plan import stage_plan

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    config = ShardingConfig(max_shard_size_mb=shard_mb)
    # The intake's output, as it stages it (untimed; or staged by ``intake_child`` before): the
    # plan step starts from this folder.
    staging = versions.begin(out, first_step=True)
    state_dir(staging).mkdir(parents=True, exist_ok=True)
    if not (state_dir(staging) / SAMPLES).is_file():
        os.link(samples_path, state_dir(staging) / SAMPLES)
    t0 = time.perf_counter()
    start = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = start.ru_utime + start.ru_stime
    planned = stage_plan(LocalSourceStore(out.parent), SOURCE, out, config)
    t_plan = time.perf_counter() - t0
    plan_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mid = resource.getrusage(resource.RUSAGE_SELF)
    # Stand-ins for the write tasks' key indexes (untimed): the commit checks each one is there.
    for shard in planned:
        p = bucket_dir(staging, shard.bucket) / key_index_relpath(shard.relpath)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.touch()
    del planned
    untimed = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 += (untimed.ru_utime + untimed.ru_stime) - (mid.ru_utime + mid.ru_stime)
    t1 = time.perf_counter()
    shards = load_shards(staging, config)
    remove_unplanned(staging, shards)
    manifests = write_manifests(staging, SOURCE, shards, tar_sha256=plan_digest_sha)
    save_outputs(staging, shards)
    t_commit = time.perf_counter() - t1
    usage = resource.getrusage(resource.RUSAGE_SELF)
    plan = state_dir(staging) / PLAN
    return {
        "cpu_s": usage.ru_utime + usage.ru_stime - cpu0,
        "samples": sum(s.count for s in shards), "shards": len(shards), "buckets": len(manifests),
        "plan_s": t_plan, "commit_s": t_commit, "base_rss": base_rss, "plan_rss": plan_rss,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "plan_mb": plan.stat().st_size / 1e6,
        "manifest_mb": sum(m.path.stat().st_size for m in manifests) / 1e6,
    }


def _child(args: list[str]) -> dict:
    """Run this script with ``args`` in a fresh process; the JSON its last line prints."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"{args[0]} child failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_coordinator(args: argparse.Namespace) -> None:
    samples_path = cached_samples(args.work_dir, args.samples, args.files)
    out = args.work_dir / "out"
    shutil.rmtree(out, ignore_errors=True)
    intake = _child(["--child-intake", str(samples_path), str(out), str(args.shard_mb)])
    if intake["validated"]:
        raise SystemExit(f"the plan step's intake validated {intake['validated']} files the intake tasks had checked")
    # The intake wrote ~3 GB just now: its writeback must not take a core from the timed plan.
    os.sync()
    t0 = time.perf_counter()
    r = _child(["--child-coordinator", str(samples_path), str(out), str(args.shard_mb)])
    wall = time.perf_counter() - t0
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    total = r["plan_s"] + r["commit_s"]
    print(f"\n## coordinator: plan + commit of {r['samples']:,} samples ({args.files} listing, "
          f"{args.shard_mb:g} MB shards)\n")
    print(f"shards {r['shards']:,} in {r['buckets']} buckets; plan.parquet {r['plan_mb']:,.0f} MB, "
          f"manifests {r['manifest_mb']:,.1f} MB; samples.parquet {samples_path.stat().st_size / 1e6:,.0f} MB")
    print(f"{'step':<28}{'seconds':>10}{'peak RSS':>12}")
    print(f"{'intake (run_intake)':<28}{intake['seconds']:>10.1f}{intake['peak_rss'] / 1e9:>10.2f} GB   "
          f"({intake['files']:,} files listed, {intake['reused']:,} outcomes from the intake tasks, "
          f"{intake['validated']} read; {intake['cpu_s']:.1f} CPU-s; a child of its own)")
    print(f"{'child after imports':<28}{'':>10}{r['base_rss'] / 1e9:>10.2f} GB")
    print(f"{'plan (stage_plan)':<28}{r['plan_s']:>10.1f}{r['plan_rss'] / 1e9:>10.2f} GB")
    print(f"{'commit (manifests, outputs)':<28}{r['commit_s']:>10.1f}{r['peak_rss'] / 1e9:>10.2f} GB")
    print(f"{'plan + commit':<28}{total:>10.1f}{r['peak_rss'] / 1e9:>10.2f} GB   (child wall {wall:.1f} s)")
    print(f"CPU time of plan + commit: {r['cpu_s']:.1f} s ({r['cpu_s'] / total:.2f} cores busy on average; load "
          f"average now {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores)")
    n = f"{r['samples']:,} samples"
    print(f"{'PASS' if total <= TARGET_S else 'MISS'}: coordinator plan + commit of {n} <= {TARGET_S:g} s "
          f"({total:.1f} s)")
    print(f"{'PASS' if r['peak_rss'] <= TARGET_RSS else 'MISS'}: coordinator peak RSS at {n} <= "
          f"{TARGET_RSS / 1e9:g} GB ({r['peak_rss'] / 1e9:.2f} GB)")


# --- workers: one source's first build by 1 and 2 workers ---------------------------------------

TARGET_RATIO = 1.7
WORKER_SOURCE = "photos"


def raw_drop(work: Path, samples: int, log=print) -> Path:
    """``<root>/photos/{image,caption,umt5}``: ``samples`` samples of the sample photographs under
    new names (hard links to one copy each); returns the root (cached)."""
    from pid_platform.demo.sample_data import make_sample_source

    root = work / f"raw-n{samples}"
    done = root / ".bench-done.json"
    stamp = {"v": DATA_VERSION, "samples": samples}
    if done.is_file() and json.loads(done.read_text()) == stamp:
        return root
    shutil.rmtree(root, ignore_errors=True)
    base = root / "base"
    log(f"[data] generating the photographs (scikit-image) under {base}")
    make_sample_source(base, with_problems=False)
    stems = sorted(p.stem for p in (base / "caption").iterdir())
    image_ext = {p.stem: p.suffix for p in (base / "image").iterdir()}
    raw = root / WORKER_SOURCE
    for m in ("image", "caption", "umt5"):
        (raw / m).mkdir(parents=True)
    for n in range(samples):
        stem, r = stems[n % len(stems)], n // len(stems)
        for m, ext in (("image", image_ext[stem]), ("caption", ".json"), ("umt5", ".npy")):
            os.link(base / m / f"{stem}{ext}", raw / m / f"{stem}-r{r:04d}{ext}")
    done.write_text(json.dumps(stamp))
    return root


def _pid_shard(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from pid_platform.cli import shard_main; sys.exit(shard_main())", *args]


def _build_options(raw: Path, out: Path, shard_mb: float) -> list[str]:
    return ["--input-dir", str(raw / WORKER_SOURCE), "--output-dir", str(out), "--max-shard-size-mb", f"{shard_mb:g}",
            "--num-workers", "1", "--validate", "full"]


def _run_all(cmds: list[list[str]]) -> list[float]:
    """Run ``cmds`` at once (one process each); each one's seconds from the start to its exit.
    Fails naming the first that fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    outs: list[str] = [""] * len(procs)
    ended: list[float] = [0.0] * len(procs)

    def wait(i: int) -> None:  # a thread each: every process's own end, not the order they are read in
        outs[i] = procs[i].communicate()[0]
        ended[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(procs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c, p, o in zip(cmds, procs, outs, strict=True):
        if p.returncode:
            raise SystemExit(f"{' '.join(c[3:])} failed (exit {p.returncode}):\n{o}")
    return ended


def tasked_build(raw: Path, out: Path, workers: int, shard_mb: float) -> dict:
    """A first build into ``out`` by ``workers`` task processes per stage; wall and CPU seconds."""
    opts = _build_options(raw, out, shard_mb)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    stages: dict = {}
    tasks = _run_all([_pid_shard("task", "--stage", "intake", "--index", str(i), "--of", str(workers), *opts)
                      for i in range(workers)])
    stages["intake"] = time.perf_counter() - t0
    stages["intake_tasks"] = tasks
    _run_all([_pid_shard("plan", *opts)])
    stages["plan"] = time.perf_counter() - t0 - stages["intake"]
    t1 = time.perf_counter()
    stages["write_tasks"] = _run_all([_pid_shard("task", "--index", str(i), "--of", str(workers), *opts)
                                      for i in range(workers)])
    stages["write"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    _run_all([_pid_shard("commit", "--output-dir", str(out), "--num-workers", "1")])
    stages["commit"] = time.perf_counter() - t2
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, **stages}


def output_digests(out: Path) -> dict[str, str]:
    """sha256 of every file of the published output but its build state (which records the tasks)."""
    import hashlib

    from pid_platform.sharding.layout import STATE_DIR

    final = out.resolve()
    found = {}
    for dirpath, dirs, files in os.walk(final):
        if Path(dirpath) == final:
            dirs[:] = [d for d in dirs if d != STATE_DIR]
        for name in files:
            f = Path(dirpath) / name
            found[f.relative_to(final).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return found


def _files_in(folder: Path) -> dict[str, int]:
    from pid_platform.sharding.layout import STATE_DIR

    seen = {}
    for dirpath, dirs, files in os.walk(folder):
        if Path(dirpath) == folder:
            dirs[:] = [d for d in dirs if d != STATE_DIR]
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # renamed between the listing and the stat
                seen[os.path.join(dirpath, name)] = os.stat(os.path.join(dirpath, name)).st_size
    return seen


def task_overhead(raw: Path, out: Path, tasks: int, shard_mb: float) -> list[float]:
    """Seconds from a write task's process start to the first byte it writes, for ``tasks`` tasks
    of one shard each, run one after another on one plan."""
    from pid_platform.sharding.commit import versions

    opts = _build_options(raw, out, shard_mb)
    _run_all([_pid_shard("task", "--stage", "intake", "--index", "0", "--of", "1", *opts)])
    _run_all([_pid_shard("plan", *opts)])
    staging = versions.staging_dir(out)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    from pid_platform.sharding.commit.state import state_dir

    planned = pq.read_table(state_dir(staging) / "plan.parquet", columns=["shard_bucket", "shard_index"])
    count = len(set(zip(*planned.to_pydict().values(), strict=True)))
    gaps = []
    for i in range(min(tasks, count)):
        before = _files_in(staging)
        t0 = time.perf_counter()
        proc = subprocess.Popen(_pid_shard("task", "--index", str(i), "--of", str(count), *opts), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = None
        while first is None and proc.poll() is None:
            now = _files_in(staging)
            if any(size > before.get(f, -1) or (f not in before and size > 0) for f, size in now.items()):
                first = time.perf_counter() - t0
                break
            time.sleep(0.001)
        out_text = proc.communicate()[0]
        if proc.returncode:
            raise SystemExit(f"write task {i} of {count} failed (exit {proc.returncode}):\n{out_text}")
        if first is None:
            raise SystemExit(f"write task {i} of {count} ended before a byte of it was seen: {out_text}")
        gaps.append(first)
    return gaps


def _remove_output(out: Path) -> None:
    """``out`` and what a build keeps beside it (staging and old folders): the next build is a first one."""
    from pid_platform.sharding.commit import versions

    for d in (out, versions.staging_dir(out), versions.old_dir(out)):
        shutil.rmtree(d, ignore_errors=True)


def run_workers(args: argparse.Namespace) -> None:
    raw = raw_drop(args.work_dir, args.worker_samples)
    runs, digests = {}, {}
    for workers in (1, 2):
        out = args.work_dir / f"out-w{workers}"
        _remove_output(out)
        # Written back first: the kernel's flush of what earlier sections and runs wrote (GBs
        # for the coordinator) would otherwise take one of the two cores in the middle of a run.
        os.sync()
        runs[workers] = tasked_build(raw, out, workers, args.worker_shard_mb)
        digests[workers] = output_digests(out)
    same = digests[1] == digests[2] and len(digests[1]) > 0
    over_out = args.work_dir / "out-overhead"
    _remove_output(over_out)
    gaps = task_overhead(raw, over_out, args.overhead_tasks, args.worker_shard_mb)
    if not args.keep:
        for w in (1, 2):
            _remove_output(args.work_dir / f"out-w{w}")
        _remove_output(over_out)
    ratio = runs[1]["wall"] / runs[2]["wall"]
    tars = sum(1 for k in digests[1] if k.endswith(".tar"))
    print(f"\n## workers: first build of {args.worker_samples:,} samples (photographs, --validate full, "
          f"{args.worker_shard_mb:g} MB shards: {tars} tars) by 1 and 2 task processes per stage\n")
    print(f"{'workers':<9}{'wall s':>9}{'cpu s':>9}{'intake':>9}{'plan':>8}{'write':>8}{'commit':>8}")
    for w, r in runs.items():
        print(f"{w:<9}{r['wall']:>9.1f}{r['cpu']:>9.1f}{r['intake']:>9.1f}{r['plan']:>8.1f}{r['write']:>8.1f}"
              f"{r['commit']:>8.1f}")
    print(f"speed-up 2 vs 1 workers: {ratio:.2f}x (CPU time 1: {runs[1]['cpu']:.1f} s, 2: {runs[2]['cpu']:.1f} s; "
          f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores)")
    for w, r in runs.items():
        print(f"tasks of {w} worker{'s' if w > 1 else ''}, seconds each (start to exit): intake "
              f"{' '.join(f'{x:.1f}' for x in r['intake_tasks'])}, write {' '.join(f'{x:.1f}' for x in r['write_tasks'])}")
    busy = ", ".join(f"{w} worker{'s' if w > 1 else ''} {r['cpu'] / r['wall']:.2f}" for w, r in runs.items())
    print(f"cores used (CPU s per wall s): {busy} (2 workers can use 2.00 only where 2 cores are free)")
    print(f"output files of the two builds: {'identical' if same else 'DIFFERENT'} ({len(digests[1])} files)")
    gaps_sorted = sorted(gaps)
    median = gaps_sorted[len(gaps_sorted) // 2]
    print(f"per-task overhead (write task process start -> first byte of a tar), {len(gaps)} tasks: "
          f"median {median * 1000:.0f} ms, min {gaps_sorted[0] * 1000:.0f} ms, max {gaps_sorted[-1] * 1000:.0f} ms")
    if not same:
        raise SystemExit("the builds by 1 and 2 workers differ")
    print(f"{'PASS' if ratio >= TARGET_RATIO else 'MISS'}: first build by 2 workers >= {TARGET_RATIO:g}x as fast as "
          f"by 1 ({ratio:.2f}x)")


SECTIONS = {"coordinator": run_coordinator, "workers": run_workers}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child-intake"]:
        print(json.dumps(intake_child(Path(argv[1]), Path(argv[2]), float(argv[3]))))
        return
    if argv[:1] == ["--child-coordinator"]:
        print(json.dumps(coordinator_child(Path(argv[1]), Path(argv[2]), float(argv[3]))))
        return
    if argv[:1] == ["--child-generate"]:
        write_synthetic_samples(Path(argv[1]), int(argv[2]), files=argv[3])
        print("{}")
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--samples", type=int, default=10_000_000, help="samples of the coordinator's source")
    ap.add_argument("--files", choices=("s3", "local"), default="s3",
                    help="listing the samples come from: s3 (size:etag) or local (fingerprint and path)")
    ap.add_argument("--shard-mb", type=float, default=500.0, help="shard bound (default 500, the build's)")
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "pid-bench-scale")
    ap.add_argument("--worker-samples", type=int, default=12000, help="samples of the workers' source")
    ap.add_argument("--worker-shard-mb", type=float, default=8.0, help="shard bound of the workers' builds")
    ap.add_argument("--overhead-tasks", type=int, default=5, help="write tasks timed for the per-task overhead")
    ap.add_argument("--keep", action="store_true", help="keep the output folders")
    args = ap.parse_args(argv)
    for name in args.sections:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
