"""A whole build of one raw source, first and again: ``build_source`` against a PiD-style sharder.

    python bench/bench_build_e2e.py [--size-mb 458] [--shard-mb 64] [--reshard-mb 16] [--workers 2]
                                    [--repeat 3] [--work-dir DIR] [--stages] [--profile CONTENDER]

Data: a raw source of real photographs with a JSON caption each (``image/`` + ``caption/``),
about ``--size-mb`` MB: scikit-image's photographs cropped to the 8 aspect ratios, resized
(720-3200 px), given film grain and re-encoded as JPEG (q70-95) or PNG, 100 KB - 3 MB each,
replicated under new names with distinct bytes (``bench_shard_write``'s generator). Generated
once and cached in the work folder.

Contenders, each timed in this process (interpreter start-up left out for all), ``--workers``
workers, every input read once before each run so the page cache is warm:

* ``peer (PiD-style)``   - what PiD's ``scripts/sharding_wds.py`` does: list ``image/``, read each
  image's size from its header (``PIL.Image.open(path).size``), keep stems with a caption, bucket
  by the same nearest aspect ratio, cut shards by the summed file sizes, write each shard's image
  and caption tar with ``tarfile`` (one process per shard, ``--workers`` at a time) and one
  ``wdinfo.json`` per bucket. No validation, no key index, no checksum, no fsync, no staging.
* ``ours, first build, full``   - ``build_source(..., validate="full")`` into an empty folder: every
  image decoded (every JPEG's entropy-coded data, output at 1/8 scale in greyscale), captions
  parsed, tars (hashed by the worker that writes them, then handed to a background fsync), key
  indexes, sha256 manifests, the staged version fsynced and swapped in.
* ``ours, first build, header`` - the same with ``validate="header"`` (size and EXIF from the header).
* ``ours, no-op rebuild``       - ``build_source`` again over the full build, nothing changed.
* ``ours, re-shard``            - then ``build_source`` with ``--reshard-mb`` instead of ``--shard-mb``.

Each round runs: fresh folder, full first build, no-op, re-shard; fresh folder, header first build;
fresh folder, peer. ``sync`` before each timed run. Best of ``--repeat`` rounds, median beside it.
The first round also checks: the full and header builds wrote identical outputs; the no-op wrote
nothing and validated nothing; the re-shard validated nothing; the peer kept the same samples in
the same buckets.

* ``peer (GNU tar + sha256sum + sync)`` - a peer doing the integrity and durability work ours does:
  the same tars as our build (our plan: each tar's files in member order, read from our key
  indexes) written by GNU tar with normalised headers (``--format=ustar``, owner/group 0, mtime 0),
  ``--workers`` tar processes at a time, then ``sha256sum`` over every tar (``--workers`` processes),
  then ``sync``. No validation, no key index, no manifests.
* ``decode floor``             - the cheapest complete decode of the same images on ``--workers``
  threads (``check_image(data, "full")``: every JPEG component entropy-decoded at 1/8 scale in
  greyscale, every PNG inflated), what a full build cannot go below.

Targets (ratio of wall times): no-op <= 0.1x our full first build; re-shard <= 0.3x our full first
build; header first build <= 1.2x the GNU tar peer; full first build <= 1.15x (decode floor + the
GNU tar peer). The PiD-style peer's ratios are printed beside them: it does none of that work. A
miss prints MISS; the exit status does not depend on it. ``--stages`` times each build step of a first build
(intake; tars with their key indexes; manifests + commit), one core's image-check speed at each
level, and the floors against a peer run: the image checks alone on ``--workers`` threads (what
a full build cannot go below) and sha256 of the same bytes (what a header build adds to the
peer's work, with the fsync of the staged version); ``--profile`` runs cProfile over one run
(main thread only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from loader.formats.twin_tar import nearest_bucket
from pid_platform.sharding.pipeline import build_source, run_intake
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.storage import LocalSourceStore
from pid_platform.sharding.tasks.commit import run_commit
from pid_platform.sharding.tasks.plan import stage_plan
from pid_platform.sharding.tasks.write import run_write_task

SOURCE = "e2e"
DROP_VERSION = 1


# ---------------------------------------------------------------- the raw drop


def make_drop(src: Path, size_mb: int) -> dict:
    """``src/{image,caption}`` of about ``size_mb`` MB of image + caption bytes."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_shard_write import _pool, _tag_jpeg, _tag_png

    if src.exists():
        shutil.rmtree(src)
    for m in ("image", "caption"):
        (src / m).mkdir(parents=True)
    rng = random.Random(42)
    pool = _pool(rng)
    total = n = 0
    while total < size_mb * 1_000_000:
        prefix, ext, data = pool[rng.randrange(len(pool))]
        stem = f"{prefix}-{n:06d}"
        img = (_tag_jpeg if ext == "jpg" else _tag_png)(data, f"pid-bench {stem}".encode())
        (src / "image" / f"{stem}.{ext}").write_bytes(img)
        cap = json.dumps({"prompt": f"A grainy photograph ({prefix.split('-')[0]}), sample {n}.",
                          "prompt_short": prefix.split("-")[0]}).encode()
        (src / "caption" / f"{stem}.json").write_bytes(cap)
        total += len(img) + len(cap)
        n += 1
    return {"version": DROP_VERSION, "size_mb": size_mb, "samples": n, "bytes": total}


def ensure_drop(work: Path, size_mb: int) -> dict:
    stamp = work / "drop.json"
    try:
        info = json.loads(stamp.read_text())
        if info.get("version") == DROP_VERSION and info.get("size_mb") == size_mb:
            return info
    except (OSError, ValueError):
        pass
    print(f"raw drop: generating ~{size_mb} MB under {work / 'raw' / SOURCE} (once, about a minute) ...", flush=True)
    stamp.unlink(missing_ok=True)
    info = make_drop(work / "raw" / SOURCE, size_mb)
    stamp.write_text(json.dumps(info))
    return info


def warm(src: Path) -> None:
    for m in ("image", "caption"):
        for e in os.scandir(src / m):
            with open(e.path, "rb") as fh:
                while fh.read(1 << 20):
                    pass


def fresh(path: Path) -> None:
    for p in (path, path.parent / f".{path.name}.pid-staging"):
        if p.exists():
            shutil.rmtree(p)
    os.sync()  # no writeback of an earlier run overlaps the next timed one


# ---------------------------------------------------------------- the PiD-style peer


def _peer_write(args: tuple[str, str, str, int, list[tuple[str, str, str]]]) -> None:
    src, out, bucket, index, items = args
    for modality, pos in (("image", 1), ("caption", 2)):
        dest = Path(out) / bucket / modality / "part_000000" / f"{index:06d}.tar"
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(dest, "w") as tf:
            for item in items:
                name = item[pos]
                tf.add(os.path.join(src, modality, name), arcname=f"{item[0]}.{name.rsplit('.', 1)[1]}")


def peer_shard(src: Path, out: Path, shard_mb: float, workers: int) -> dict[str, int]:
    """PiD's sharding_wds.py, reduced to what it does: header sizes, buckets, tarfile, wdinfo.json."""
    from PIL import Image

    captions = {n.rsplit(".", 1)[0]: n for n in os.listdir(src / "caption")}
    buckets: dict[str, list[tuple[str, str, str, int]]] = defaultdict(list)
    for name in sorted(os.listdir(src / "image")):
        stem = name.rsplit(".", 1)[0]
        if stem not in captions:
            continue
        path = src / "image" / name
        with Image.open(path) as im:
            w, h = im.size
        size = path.stat().st_size + (src / "caption" / captions[stem]).stat().st_size
        buckets[nearest_bucket(w, h)].append((stem, name, captions[stem], size))
    bound = shard_mb * 1024 * 1024
    jobs, manifests = [], {}
    for bucket in sorted(buckets):
        shards: list[list] = [[]]
        used = 0
        for item in buckets[bucket]:
            if shards[-1] and used + item[3] > bound:
                shards.append([])
                used = 0
            shards[-1].append(item)
            used += item[3]
        jobs += [(str(src), str(out), bucket, i, [it[:3] for it in s]) for i, s in enumerate(shards)]
        manifests[bucket] = [len(s) for s in shards]
    with mp.get_context("fork").Pool(workers) as pool:
        pool.map(_peer_write, jobs, chunksize=1)
    for bucket, counts in manifests.items():
        doc = {"data_keys": ["caption", "image"], "data_list": [f"part_000000/{i:06d}.tar" for i in range(len(counts))],
               "data_list_key_count": counts, "total_key_count": sum(counts), "root": str(out / bucket)}
        (out / bucket / "wdinfo.json").write_text(json.dumps(doc))
    return {b: sum(c) for b, c in manifests.items()}


def tar_plan(out: Path) -> list[tuple[str, str, list[str]]]:
    """Every tar of a build as (path relative to ``out``, modality, raw file names in member order),
    read from the build's key indexes: what the GNU tar peer writes."""
    from loader.formats.key_index import BASENAME, index_modalities, member_column, read_key_index
    from loader.formats.layout import KEY_INDEX_DIR, KEY_INDEX_SUFFIX, TAR_SUFFIX

    plan = []
    for idx in sorted(out.glob(f"*/{KEY_INDEX_DIR}/*/*{KEY_INDEX_SUFFIX}")):
        table = read_key_index(idx)
        bucket_dir = idx.parent.parent.parent
        shard = f"{idx.parent.name}/{idx.name[: -len(KEY_INDEX_SUFFIX)]}{TAR_SUFFIX}"
        basenames = table.column(BASENAME).to_pylist()
        for m in index_modalities(table):
            exts = [name.rsplit(".", 1)[1] for name in table.column(member_column(m)).to_pylist()]
            plan.append((str((bucket_dir / m / shard).relative_to(out)), m,
                         [f"{b}.{e}" for b, e in zip(basenames, exts, strict=True)]))
    return plan


def _gnu_tar(args: tuple[str, str, list[str]]) -> None:
    folder, dest, names = args
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    # -C before -T: GNU tar applies it only to the names that follow it.
    subprocess.run(["tar", "-cf", dest, "--format=ustar", "--owner=0", "--group=0", "--numeric-owner",
                    "--mtime=@0", "--no-recursion", "-C", folder, "--null", "-T", "-"],
                   input=b"\0".join(n.encode() for n in names), check=True)


def gnu_tar_peer(src: Path, out: Path, plan: list[tuple[str, str, list[str]]], workers: int) -> int:
    """The same tars with GNU tar, then sha256sum over them, then sync; returns the tar count."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(str(src / m), str(out / rel), names) for rel, m, names in plan]
    with ThreadPoolExecutor(workers) as pool:  # each thread waits on its own tar process
        list(pool.map(_gnu_tar, jobs))
    tars = [dest for _, dest, _ in jobs]
    groups = [tars[i::workers] for i in range(workers)]
    procs = [subprocess.Popen(["sha256sum", *g], stdout=subprocess.DEVNULL) for g in groups if g]
    for proc in procs:
        if proc.wait() != 0:
            raise RuntimeError("sha256sum failed")
    subprocess.run(["sync"], check=True)
    return len(tars)


def decode_floor(datas: list[bytes], workers: int) -> None:
    """Every image decoded completely, the cheapest way, on ``workers`` threads."""
    from concurrent.futures import ThreadPoolExecutor

    from pid_platform.sharding.intake.file_checks import check_image

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda d: check_image(d, "full"), datas, chunksize=8))


def _cpu() -> float:
    """User + system seconds of this process (all threads) and of its reaped children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def check_rates(src: Path) -> list[str]:
    """One core's speed at each validation level: every image checked in this thread."""
    from pid_platform.sharding.intake.file_checks import check_image

    datas = [Path(e.path).read_bytes() for e in sorted(os.scandir(src / "image"), key=lambda e: e.name)]
    mb = sum(map(len, datas)) / 1e6
    lines = []
    for level in ("header", "full"):
        c = time.process_time()
        for d in datas:
            check_image(d, level)
        s = time.process_time() - c
        lines.append(f"check_image {level}: {s:.2f} CPU s for {len(datas)} images, {mb:.0f} MB ({mb / s:.0f} MB/s per core)")
    return lines


def _wall_cpu(fn, repeat: int = 2) -> tuple[float, float]:
    """Best wall and best CPU seconds of ``repeat`` calls of ``fn``."""
    walls, cpus = [], []
    for _ in range(repeat):
        c, t = _cpu(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
        cpus.append(_cpu() - c)
    return min(walls), min(cpus)


def floors(src: Path, out_peer: Path, shard_mb: float, workers: int) -> list[str]:
    """What bounds each first build, on ``workers`` threads, against a peer run: the full
    build's image checks alone (JPEGs, then every image), the header build's sha256 alone."""
    from concurrent.futures import ThreadPoolExecutor

    from pid_platform.sharding.intake.file_checks import check_image

    def peer():
        fresh(out_peer)
        peer_shard(src, out_peer, shard_mb, workers)

    warm(src)
    peer_wall, peer_cpu = _wall_cpu(peer)
    fresh(out_peer)
    names = sorted(e.name for e in os.scandir(src / "image"))
    datas = {n: (src / "image" / n).read_bytes() for n in names}
    jpegs = [d for n, d in datas.items() if n.lower().endswith((".jpg", ".jpeg"))]
    every = list(datas.values())

    def on_threads(fn, items):
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(fn, items, chunksize=8))

    lines = [f"peer: {peer_wall:.2f} s wall, {peer_cpu:.2f} CPU s"]
    for label, items in ((f"{len(jpegs)} JPEGs", jpegs), (f"every image ({len(every)})", every)):
        mb = sum(map(len, items)) / 1e6
        wall, cpu = _wall_cpu(lambda items=items: on_threads(lambda d: check_image(d, "full"), items))
        lines.append(f"floor of a full build: check_image full of {label}, {mb:.0f} MB, on {workers} threads: "
                     f"{wall:.2f} s wall ({cpu:.2f} CPU s) = {wall / peer_wall:.1f}x the peer's whole run")
    mb = sum(map(len, every)) / 1e6

    def sha(d: bytes) -> None:
        hashlib.sha256(d).digest()

    wall, cpu = _wall_cpu(lambda: on_threads(sha, every))
    lines.append(f"sha256 of the same bytes (what a header build adds for the manifests) on {workers} threads: "
                 f"{wall:.2f} s wall ({cpu:.2f} CPU s) = {wall / peer_wall:.2f}x the peer's whole run")
    return lines


# ---------------------------------------------------------------- ours


def ours(raw: Path, out: Path, shard_mb: float, workers: int, validate: str = "full"):
    return build_source(LocalSourceStore(raw), SOURCE, out, ShardingConfig(max_shard_size_mb=shard_mb),
                        num_workers=workers, validate=validate)


def output_bytes(out: Path) -> dict[str, bytes]:
    files = {}
    for dirpath, dirs, names in os.walk(out):
        dirs[:] = [d for d in dirs if d != ".pid-build"]
        for n in names:
            p = Path(dirpath) / n
            files[str(p.relative_to(out))] = p.read_bytes()
    return files


def stages(raw: Path, out: Path, shard_mb: float, workers: int, validate: str) -> list[tuple[str, float]]:
    """Each step of a first build, timed on its own (the same steps ``build_source`` runs)."""
    store, config = LocalSourceStore(raw), ShardingConfig(max_shard_size_mb=shard_mb)
    times = []
    t = time.perf_counter()
    run_intake(store, SOURCE, out, config, trust_pickle=False, num_workers=workers, validate=validate)
    times.append(("intake", time.perf_counter() - t))
    t = time.perf_counter()
    stage_plan(store, SOURCE, out, config)
    run_write_task(store, SOURCE, out, 0, 1, num_workers=workers)
    times.append(("plan + tars (hashed) + key indexes", time.perf_counter() - t))
    t = time.perf_counter()
    run_commit(out, num_workers=workers)
    times.append(("manifests + commit", time.perf_counter() - t))
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=458, help="raw drop size in MB (default 458)")
    ap.add_argument("--shard-mb", type=float, default=64.0, help="shard bound of the first builds (default 64)")
    ap.add_argument("--reshard-mb", type=float, default=16.0, help="shard bound of the re-shard (default 16)")
    ap.add_argument("--workers", type=int, default=2, help="workers for every contender (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds (default 3)")
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "pid-bench-e2e")
    ap.add_argument("--stages", action="store_true",
                    help="time each step of a full and a header first build, and the floors of each against the peer")
    ap.add_argument("--profile", choices=("full", "header", "noop", "reshard", "peer"),
                    help="cProfile one run of a contender (main process only) and exit")
    args = ap.parse_args(argv)
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    info = ensure_drop(work, args.size_mb)
    raw, src = work / "raw", work / "raw" / SOURCE
    print(f"raw drop: {info['samples']} photographs + captions, {info['bytes'] / 1e6:.0f} MB, at {src}")
    out_ours, out_header, out_peer = work / "out-ours", work / "out-header", work / "out-peer"

    if args.stages:
        for validate in ("full", "header"):
            fresh(out_ours)
            warm(src)
            steps = stages(raw, out_ours, args.shard_mb, args.workers, validate)
            total = sum(s for _, s in steps)
            print(f"first build, validate={validate}: {total:.2f}s = "
                  + ", ".join(f"{name} {s:.2f}s" for name, s in steps))
        fresh(out_ours)
        for line in check_rates(src) + floors(src, out_peer, args.shard_mb, args.workers):
            print(line)
        return 0

    if args.profile:
        import cProfile
        import pstats

        run = {
            "full": lambda: ours(raw, out_ours, args.shard_mb, args.workers),
            "header": lambda: ours(raw, out_ours, args.shard_mb, args.workers, "header"),
            "noop": lambda: ours(raw, out_ours, args.shard_mb, args.workers),
            "reshard": lambda: ours(raw, out_ours, args.reshard_mb, args.workers),
            "peer": lambda: peer_shard(src, out_peer, args.shard_mb, args.workers),
        }[args.profile]
        fresh(out_ours)
        fresh(out_peer)
        if args.profile in ("noop", "reshard"):
            ours(raw, out_ours, args.shard_mb, args.workers)
        warm(src)
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        fresh(out_ours)
        fresh(out_peer)
        return 0

    labels = {
        "peer": "peer (PiD-style)",
        "gnu": "peer (GNU tar+sha256+sync)",
        "floor": "decode floor",
        "full": "ours, first build, full",
        "header": "ours, first build, header",
        "noop": "ours, no-op rebuild",
        "reshard": "ours, re-shard",
    }
    times: dict[str, list[float]] = {k: [] for k in labels}

    cpu: dict[str, list[float]] = {k: [] for k in labels}

    def timed(key: str, fn):
        warm(src)
        os.sync()
        c0 = _cpu()
        t = time.perf_counter()
        res = fn()
        times[key].append(time.perf_counter() - t)
        cpu[key].append(_cpu() - c0)
        return res

    plan: list[tuple[str, str, list[str]]] = []  # our tars, for the GNU tar peer (from round 1)
    datas = [Path(e.path).read_bytes() for e in sorted(os.scandir(src / "image"), key=lambda e: e.name)]
    for rnd in range(1, args.repeat + 1):
        fresh(out_ours)
        full = timed("full", lambda: ours(raw, out_ours, args.shard_mb, args.workers))
        noop = timed("noop", lambda: ours(raw, out_ours, args.shard_mb, args.workers))
        if rnd == 1:
            assert not full.up_to_date and full.report.files_validated == 2 * info["samples"], full.report
            assert noop.up_to_date and noop.report.files_validated == 0, noop.report
            reference = output_bytes(out_ours)
        reshard = timed("reshard", lambda: ours(raw, out_ours, args.reshard_mb, args.workers))
        if rnd == 1:
            assert reshard.report.files_validated == 0 and reshard.shards > full.shards, reshard.report
        fresh(out_header)
        timed("header", lambda: ours(raw, out_header, args.shard_mb, args.workers, "header"))
        if rnd == 1:
            assert output_bytes(out_header) == reference, "header and full builds differ"
        if rnd == 1:
            plan.extend(tar_plan(out_header))
        fresh(out_peer)
        timed("gnu", lambda: gnu_tar_peer(src, out_peer, plan, args.workers))
        if rnd == 1:
            mine = {rel: (out_header / rel).stat().st_size for rel, _, _ in plan}
            theirs = {rel: (out_peer / rel).stat().st_size for rel, _, _ in plan}
            # GNU tar pads its archives to 10 KiB records: a few KB more per tar, the same members.
            assert all(abs(theirs[r] - mine[r]) < 20480 for r in mine), "GNU tar peer wrote other tars"
        timed("floor", lambda: decode_floor(datas, args.workers))
        fresh(out_peer)
        peer = timed("peer", lambda: peer_shard(src, out_peer, args.shard_mb, args.workers))
        if rnd == 1:
            ours_buckets = {b: s.samples for b, s in full.buckets.items()}
            assert peer == ours_buckets, (peer, ours_buckets)
            print(f"check: full and header outputs identical; no-op and re-shard validated nothing; the peer "
                  f"kept the same {full.samples} samples in the same {len(peer)} buckets ({full.shards} of our "
                  f"shards, {reshard.shards} after the re-shard)")
        print(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    for p in (out_ours, out_header, out_peer):
        fresh(p)

    best = {k: min(v) for k, v in times.items()}
    print()
    print(f"whole build: {info['samples']} photographs + captions, {info['bytes'] / 1e6:.0f} MB, {args.workers} "
          f"workers, {os.cpu_count()} CPUs, warm page cache; best and median of {args.repeat} rounds")
    best_cpu = {k: min(v) for k, v in cpu.items()}
    print(f"{'contender':<28}{'best s':>8}{'median s':>10}{'vs peer':>9}{'vs full':>9}{'CPU s':>8}{'CPU vs peer':>13}")
    for k, label in labels.items():
        print(f"{label:<28}{best[k]:>8.2f}{statistics.median(times[k]):>10.2f}"
              f"{best[k] / best['peer']:>8.2f}x{best[k] / best['full']:>8.2f}x"
              f"{best_cpu[k]:>8.2f}{best_cpu[k] / best_cpu['peer']:>12.2f}x")
    print("(wall seconds judge the targets; CPU = user + system seconds of this process's threads and of the "
          "peer's worker processes, which a shared machine disturbs less; fsync waits are not CPU)")
    targets = [
        ("no-op rebuild <= 0.1x our full first build", best["noop"] / best["full"], 0.1),
        ("re-shard <= 0.3x our full first build", best["reshard"] / best["full"], 0.3),
        ("header first build <= 1.2x the GNU tar peer", best["header"] / best["gnu"], 1.2),
        ("full first build <= 1.15x (decode floor + GNU tar peer)",
         best["full"] / (best["floor"] + best["gnu"]), 1.15),
    ]
    print(f"(against the PiD-style peer, which validates, hashes and syncs nothing: header "
          f"{best['header'] / best['peer']:.2f}x, full {best['full'] / best['peer']:.2f}x)")
    print()
    for text, ratio, limit in targets:
        print(f"{'PASS' if ratio <= limit else 'MISS'}: {text} ({ratio:.2f}x)")
    print("(what bounds the first builds: --stages prints the image checks alone and sha256 alone on the same "
          "workers, each as a multiple of a peer run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
