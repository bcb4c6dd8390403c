"""Builds that outgrow one machine: what the coordinator costs at scale (issue 18).

    python bench/bench_build_scale.py [--sections coordinator] [--samples 10000000] [--files s3|local]
                                      [--shard-mb 500] [--work-dir DIR] [--keep]

Sections (``--sections``, default all); each prints its table and its ``PASS``/``MISS`` lines:

* ``coordinator`` - plan + commit of one source of ``--samples`` samples (10,000,000 by default).
  **Data:** a synthetic intake table (``samples.parquet`` as intake writes it, row groups of 1 Mi
  rows, keys in order) written directly, column by column, with no file on disk per sample:
  keys ``img_<9 digits>_<8 hex>``, 8 aspect buckets with realistic shares and 3840-px-class
  sizes, three modalities - ``caption`` (.json, 200 B - 3 KB), ``image`` (.jpg, log-normal around
  1.5 MB, 50 KB - 20 MB) and ``umt5`` (.npy, float16 [20-300, 4096]) - with S3 listing
  fingerprints (``size:etag``, no local path; ``--files local``: ``size:mtime:ctime:inode`` and a
  path per file, the largest rows a build reads). Generated once and cached in the work folder.
  **Timed, in a fresh child process:** *plan* - ``columnar.write_plan_file``: samples.parquet ->
  plan.parquet (the shard plan and every sample in plan order, row groups of 128 Ki rows) and
  shards.parquet (one row per shard: count, tar sizes, plan digest, computed from each row group
  as it is written); *commit* - the shards read back from shards.parquet
  (``columnar.read_shards_file``),
  ``remove_unplanned``, ``write_manifests`` (one wdinfo.json per bucket) and ``save_outputs``.
  No tar exists: the commit takes each tar's sha256 from the plan (a stand-in, the shard's plan
  digest, through the ``tar_sha256`` seam of ``write_manifests``) instead of reading the
  writer's digest cache, and one empty stand-in key index per shard is put in place between plan
  and commit (untimed) so the commit's checks run as in a build. Peak RSS is the child's
  ``ru_maxrss``. **Targets:** plan + commit <= 60 s and peak RSS <= 1.5 GB (at 10,000,000 samples;
  a smaller ``--samples`` prints the same lines for what it measured).

A later section (``workers``: one source's first build with 1 and 2 workers) is added beside
``coordinator`` in ``SECTIONS``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
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


def coordinator_child(samples_path: Path, out: Path, shard_mb: float, *, row_group_rows: int | None = None) -> dict:
    """Plan + commit of ``samples_path`` into the staging-like folder ``out``; what it measured."""
    from loader.formats.twin_tar import key_index_relpath, shard_relpath
    from pid_platform.sharding.commit.manifests import remove_unplanned, write_manifests_from_plan
    from pid_platform.sharding.commit.state import save_outputs, state_dir
    from pid_platform.sharding.layout import bucket_dir
    from pid_platform.sharding.plan.columnar import write_plan_file
    from pid_platform.sharding.plan.shard_plan import ShardingConfig

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    config = ShardingConfig(max_shard_size_mb=shard_mb)
    state = state_dir(out)
    state.mkdir(parents=True, exist_ok=True)
    plan = state / "plan.parquet"
    shards_file = state / "shards.parquet"
    t0 = time.perf_counter()
    layout = write_plan_file(samples_path, plan, config, shards_path=shards_file,
                             **({} if row_group_rows is None else {"row_group_rows": row_group_rows}))
    t_plan = time.perf_counter() - t0
    plan_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # Stand-ins for the write tasks' key indexes (untimed): the commit checks each one is there.
    for b, i in zip(layout.shard_bucket.tolist(), layout.shard_index.tolist(), strict=True):
        p = bucket_dir(out, layout.bucket_names[b]) / key_index_relpath(shard_relpath(i, config.part_size))
        p.parent.mkdir(parents=True, exist_ok=True)
        p.touch()
    t1 = time.perf_counter()
    shards, manifests = write_manifests_from_plan(out, SOURCE, plan, config.part_size, tar_sha256=plan_digest_sha,
                                                  shards_path=shards_file)
    remove_unplanned(out, shards)
    save_outputs(out, shards)
    t_commit = time.perf_counter() - t1
    return {
        "samples": int(layout.counts.sum()), "shards": layout.num_shards, "buckets": len(manifests),
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
    print(f"{'child after imports':<28}{'':>10}{r['base_rss'] / 1e9:>10.2f} GB")
    print(f"{'plan (write_plan_file)':<28}{r['plan_s']:>10.1f}{r['plan_rss'] / 1e9:>10.2f} GB")
    print(f"{'commit (manifests, outputs)':<28}{r['commit_s']:>10.1f}{r['peak_rss'] / 1e9:>10.2f} GB")
    print(f"{'plan + commit':<28}{total:>10.1f}{r['peak_rss'] / 1e9:>10.2f} GB   (child wall {wall:.1f} s)")
    n = f"{r['samples']:,} samples"
    print(f"{'PASS' if total <= TARGET_S else 'MISS'}: coordinator plan + commit of {n} <= {TARGET_S:g} s "
          f"({total:.1f} s)")
    print(f"{'PASS' if r['peak_rss'] <= TARGET_RSS else 'MISS'}: coordinator peak RSS at {n} <= "
          f"{TARGET_RSS / 1e9:g} GB ({r['peak_rss'] / 1e9:.2f} GB)")


SECTIONS = {"coordinator": run_coordinator}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
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
    ap.add_argument("--keep", action="store_true", help="keep the coordinator's output folder")
    args = ap.parse_args(argv)
    for name in args.sections:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
